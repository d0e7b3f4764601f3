"""Native memory in use, which Python's own accounting (``tracemalloc``, the cyclic collector's
counts) never sees: llguidance's Rust allocates with the C library's malloc.

``resident_bytes`` is cheap (one read of ``/proc/self/statm``) and is what the grammar cache
charges a compile with (grammar.py). ``allocated_bytes`` is exact but walks every free chunk of
every malloc arena: 0.03 ms in a small process, 20-25 ms per call in a served 8B model's after
warm-up (XLA's compiles leave the heap in many pieces; measured on the H200), so it is for tests
and diagnostics only."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


def _mallinfo2() -> Any:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int:
    """Bytes malloc has handed out in the whole process (glibc; 0 elsewhere, where a grammar
    is counted at its source's size). llguidance allocates with malloc, so the growth across a
    compile is what the grammar keeps, give or take what other threads did meanwhile."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return 0
