"""When an encoder's residual add and LayerNorm run on the kernel (``triton``), read at trace
time.

``JAXSERVE_LAYER_NORM``: ``auto`` (the default: the kernel on a process of one GPU), ``off``
(XLA's normalizing fusion, the add inside it), ``on`` (the kernel wherever its shapes fit:
natively on a GPU, in Pallas interpret mode elsewhere, for tests). Timed on an H100
(2026-12-07, BGE-large's 16,384-token step): 35.8 us a norm against XLA's 39, the share 44.9%
-> 45.2% (44.8% -> 45.1% with cuBLAS's options), its native tests passing.
``takes`` answers for one call's shapes, ``describe`` writes the start-up log line.
"""

from __future__ import annotations

from typing import Any

from pallas_kernels.env_choice import env_choice, one_device_triton_path
from pallas_kernels.layer_norm import triton

ENV = "JAXSERVE_LAYER_NORM"
CHOICES = ("off", "auto", "on")


def requested() -> str:
    return env_choice(ENV, CHOICES, "auto")


def choose() -> tuple[str, str]:
    """``("triton" | "interpret" | "xla", why)`` for this process."""
    return one_device_triton_path(ENV, requested(), forced="on", off="off", fallback="xla")


def takes(x: Any, residual: Any) -> str | None:
    """The kernel's mode for ``LayerNorm(x + residual)`` at these shapes, or None for XLA's."""
    path, _ = choose()
    if path == "xla" or triton.unsupported_reason(x, residual) is not None:
        return None
    return path


def describe() -> str:
    """The start-up log line, e.g. ``Residual add and LayerNorm: XLA's fusions
    (JAXSERVE_LAYER_NORM=off)``."""
    path, why = choose()
    if path == "xla":
        return f"Residual add and LayerNorm: XLA's fusions ({why})"
    mode = "Pallas Triton kernel" + (" in interpret mode" if path == "interpret" else "")
    return f"Residual add and LayerNorm: one pass on the {mode} where it fits ({why})"
