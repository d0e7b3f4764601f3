"""When fp8 weights take the fp8-matmul kernel (``mosaic_gpu``), read at trace time.

``choose`` says, from ``JAXSERVE_FP8_MATMUL`` and the device, how steps of few tokens multiply
by fp8 weights in this process: ``off`` (XLA's GEMMs; the default until the H200's numbers are
in), ``auto`` (the Mosaic GPU kernel on a process of one Hopper-or-newer NVIDIA GPU), ``on``
(the kernel wherever: natively on a GPU, in Pallas interpret mode elsewhere, for tests).
``takes`` answers for one step's token count, up to ``max_tokens()`` (the crossover with XLA's
own fp8 GEMM; ``JAXSERVE_FP8_MATMUL_MAX_TOKENS``); ``describe`` writes the start-up log line.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.env_choice import devices_per_model, env_choice
from pallas_kernels.fp8_matmul.mosaic_gpu import MAX_ROWS

FP8_MATMUL_ENV = "JAXSERVE_FP8_MATMUL"
FP8_MATMUL_CHOICES = ("auto", "on", "off")
MAX_TOKENS_ENV = "JAXSERVE_FP8_MATMUL_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 64


def requested() -> str:
    """``JAXSERVE_FP8_MATMUL`` (default ``off``), validated."""
    return env_choice(FP8_MATMUL_ENV, FP8_MATMUL_CHOICES, "off")


def max_tokens() -> int:
    """The largest step (tokens) that takes the kernel: ``JAXSERVE_FP8_MATMUL_MAX_TOKENS``,
    default 64, at most ``MAX_ROWS``."""
    value = int(os.environ.get(MAX_TOKENS_ENV, str(DEFAULT_MAX_TOKENS)))
    if not 1 <= value <= MAX_ROWS:
        raise ValueError(f"{MAX_TOKENS_ENV}={value} must be in [1, {MAX_ROWS}]")
    return value


def choose() -> tuple[str, str]:
    """``("mosaic_gpu" | "interpret" | "xla", why)``: how fp8 weights meet steps of few
    tokens in this process."""
    value, backend = requested(), jax.default_backend()
    if value == "off":
        return "xla", f"{FP8_MATMUL_ENV}=off"
    if value == "on":
        if backend == "gpu":
            return "mosaic_gpu", f"{FP8_MATMUL_ENV}=on"
        return "interpret", f"{FP8_MATMUL_ENV}=on, Pallas interpret mode on the {backend} backend"
    if backend != "gpu":
        return "xla", f"the kernel is Mosaic GPU; this is the {backend} backend"
    if devices_per_model() > 1:
        return "xla", f"{devices_per_model()} devices a model: the kernel is not partitioned yet"
    capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
    if float(capability) < 9.0:
        return "xla", f"compute capability {capability}: fp8 wgmma needs Hopper (9.0) or newer"
    return "mosaic_gpu", f"{FP8_MATMUL_ENV}=auto"


def takes(num_tokens: int) -> str | None:
    """The kernel's mode (``"mosaic_gpu"`` or ``"interpret"``) for a step of ``num_tokens``
    tokens (static: the step's bucket), or None for XLA's GEMM. Read at trace time."""
    path, _ = choose()
    if path == "xla" or num_tokens > max_tokens():
        return None
    return path


def describe() -> str:
    """The start-up log line, e.g. ``fp8 matmul: Pallas Mosaic GPU kernel for steps of up to
    64 tokens (JAXSERVE_FP8_MATMUL=auto)`` or ``fp8 matmul: XLA's GEMMs (...)``."""
    path, why = choose()
    if path == "xla":
        return f"fp8 matmul: XLA's GEMMs ({why})"
    mode = "Pallas Mosaic GPU kernel" + (" in interpret mode" if path == "interpret" else "")
    return f"fp8 matmul: {mode} for steps of up to {max_tokens()} tokens ({why})"
