"""The kernels' environment switches (``JAXSERVE_ATTENTION``, ``JAXSERVE_MLA``, ...): one
reading and one error for all of them, and the path a one-device Triton kernel's switch picks."""

from __future__ import annotations

import os

import jax


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable ``name``, lower-cased (``default`` when unset or empty); a
    value outside ``choices`` is a ValueError naming the variable and the choices."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def one_device_triton_path(
    name: str, value: str, *, forced: str, off: str, fallback: str
) -> tuple[str, str]:
    """``("triton" | "interpret" | fallback, why)`` of a Pallas Triton kernel not partitioned
    across devices, switched by ``name`` (its value ``value``): ``off`` takes the fallback,
    ``forced`` the kernel (interpreted off the GPU), anything else (``auto``) the kernel on a
    process of one GPU and the fallback elsewhere."""
    backend = jax.default_backend()
    if value == off:
        return fallback, f"{name}={off}"
    if value == forced:
        if backend == "gpu":
            return "triton", f"{name}={forced}"
        return "interpret", f"{name}={forced}, Pallas interpret mode on the {backend} backend"
    if backend != "gpu":
        return fallback, f"the kernel is Pallas Triton; this is the {backend} backend"
    if jax.device_count() > 1:
        return fallback, f"{jax.device_count()} devices: the kernel is not partitioned yet"
    return "triton", f"{name}=auto"
