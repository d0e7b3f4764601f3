"""The kernels' environment switches (``JAXSERVE_ATTENTION``, ``JAXSERVE_MLA``, ...): one
reading and one error for all of them, the path a one-device Triton kernel's switch picks, and
how many devices one model spans (``devices_per_model``: what "one device" means for them)."""

from __future__ import annotations

import os

import jax

# The devices one model's step spans (its tensor-parallel size), set by the runner that builds
# the model's programs; None: every device of the process. A process of data-parallel replicas
# holds several devices, but each replica's programs run on its own one: its kernels need no
# partitioning, so a one-device kernel still applies there.
_devices_per_model: int | None = None


def set_devices_per_model(count: int | None) -> None:
    """The runner's tensor-parallel size (None: back to the process's device count)."""
    global _devices_per_model
    if count is not None and count < 1:
        raise ValueError(f"devices per model {count} must be >= 1")
    _devices_per_model = count


def devices_per_model() -> int:
    """The devices one model's step spans: the runner's tensor-parallel size once it has said
    (``set_devices_per_model``), else every device of the process."""
    return _devices_per_model or jax.device_count()


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
    if devices_per_model() > 1:
        return fallback, f"{devices_per_model()} devices a model: the kernel is not partitioned yet"
    return "triton", f"{name}=auto"
