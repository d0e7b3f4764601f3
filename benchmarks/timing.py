"""One way the benchmarks time a jitted call: back to back, best of a few runs."""

from __future__ import annotations

import time

import jax


def best_time(fn, *args, iters: int = 20, runs: int = 3) -> float:
    """Seconds per call of ``fn(*args)`` dispatched ``iters`` times back to back (the best of
    ``runs`` such runs), after one call that compiles and warms up."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best
