"""Native memory in use: what a grammar's compile keeps, for the byte-bounded cache
(grammar.py). llguidance's Rust allocates with the C library's malloc, which Python's own
memory accounting (``tracemalloc``, the cyclic collector's counts) never sees."""

from __future__ import annotations

import ctypes
import ctypes.util
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
