"""When the model takes the skinny-matmul kernel (``triton``), read at trace time.

``choose`` says, from ``JAXSERVE_SKINNY_MATMUL`` and the backend, how decode-sized matmuls run in
this process: ``off`` (the default until the H200 numbers are in), ``auto`` (on an NVIDIA GPU
with one device, for steps of up to ``max_tokens()`` tokens), ``on`` (wherever, for steps of up
to ``max_tokens()``: natively on a GPU, in Pallas interpret mode elsewhere, for tests).
``takes`` answers for one step's token count (``models/quant.py``), ``describe`` writes the
start-up log line.
"""

from __future__ import annotations

import os

from pallas_kernels.env_choice import env_choice, one_device_triton_path
from pallas_kernels.skinny_matmul.triton import MAX_ROWS

SKINNY_ENV = "JAXSERVE_SKINNY_MATMUL"
SKINNY_CHOICES = ("auto", "on", "off")
MAX_TOKENS_ENV = "JAXSERVE_SKINNY_MATMUL_MAX_TOKENS"


def requested() -> str:
    """``JAXSERVE_SKINNY_MATMUL`` (default ``off``), validated."""
    return env_choice(SKINNY_ENV, SKINNY_CHOICES, "off")


def max_tokens() -> int:
    """The largest step (tokens) that takes the kernel: ``JAXSERVE_SKINNY_MATMUL_MAX_TOKENS``,
    default and at most ``MAX_ROWS``."""
    value = int(os.environ.get(MAX_TOKENS_ENV, str(MAX_ROWS)))
    if not 1 <= value <= MAX_ROWS:
        raise ValueError(f"{MAX_TOKENS_ENV}={value} must be in [1, {MAX_ROWS}]")
    return value


def choose() -> tuple[str, str]:
    """``("triton" | "interpret" | "xla", why)``: how decode-sized matmuls run in this process."""
    return one_device_triton_path(SKINNY_ENV, requested(), forced="on", off="off", fallback="xla")


def takes(num_tokens: int) -> str | None:
    """The kernel's mode (``"triton"`` or ``"interpret"``) for a step of ``num_tokens`` tokens
    (static: the step's bucket), or None for XLA's matmul. Read at trace time."""
    path, _ = choose()
    if path == "xla" or num_tokens > max_tokens():
        return None
    return path


def describe() -> str:
    """The start-up log line, e.g. ``Skinny matmul: Pallas Triton kernel for steps of up to
    64 tokens (JAXSERVE_SKINNY_MATMUL=auto)`` or ``Skinny matmul: off (...)``."""
    path, why = choose()
    if path == "xla":
        return f"Skinny matmul: off, XLA's matmuls ({why})"
    mode = "Pallas Triton kernel" + (" in interpret mode" if path == "interpret" else "")
    return f"Skinny matmul: {mode} for steps of up to {max_tokens()} tokens ({why})"
