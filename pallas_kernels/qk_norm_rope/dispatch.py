"""When a step norms and turns q and k on the kernel (``triton``), read at trace time.

``JAXSERVE_QK_NORM_ROPE``: ``auto`` (the default: the kernel on a process of one GPU, for steps
of at least ``MIN_TOKENS`` tokens), ``off`` (XLA's reduction and pass per tensor,
``decoder.normed_rotary``), ``on`` (the kernel wherever its shapes fit: natively on a GPU, in
Pallas interpret mode elsewhere, for tests). Timed on an H100 (2026-12-07) with the cuBLAS
option set of the pooling steps: the 16,384-token Qwen3-0.6B embedding step 1.8 ms shorter
(45.9% -> 48.6% of the bf16 peak), its native tests passing. ``takes``
answers for one call's shapes, ``describe`` writes the start-up log line.
"""

from __future__ import annotations

from typing import Any

from pallas_kernels.env_choice import env_choice, one_device_triton_path
from pallas_kernels.qk_norm_rope import triton

ENV = "JAXSERVE_QK_NORM_ROPE"
CHOICES = ("off", "auto", "on")
MIN_TOKENS = 1024  # ``auto``: prompt-sized steps, where the second read of q and k is long


def requested() -> str:
    return env_choice(ENV, CHOICES, "auto")


def choose() -> tuple[str, str]:
    """``("triton" | "interpret" | "xla", why)`` for this process."""
    return one_device_triton_path(ENV, requested(), forced="on", off="off", fallback="xla")


def takes(qkv: Any, first: int, heads: int) -> str | None:
    """The kernel's mode for these heads of ``qkv [T, X, D]``, or None for XLA's passes."""
    path, _ = choose()
    if path == "xla" or (requested() == "auto" and qkv.shape[0] < MIN_TOKENS):
        return None
    if triton.unsupported_reason(qkv, first, heads) is not None:
        return None
    return path


def describe() -> str:
    """The start-up log line, e.g. ``Per-head norm and rotary: XLA's reduction and pass
    (JAXSERVE_QK_NORM_ROPE=off)``."""
    path, why = choose()
    if path == "xla":
        return f"Per-head norm and rotary: XLA's reduction and pass ({why})"
    mode = "Pallas Triton kernel" + (" in interpret mode" if path == "interpret" else "")
    steps = f"steps of at least {MIN_TOKENS} tokens" if requested() == "auto" else "every step"
    return f"Per-head norm and rotary: one pass on the {mode}, {steps} it fits ({why})"
