"""Does dispatching a step wait for the device? The host's time of each call a step makes,
with the device idle and while a long program runs on it.

The step log's ``dispatch`` span (the engine building and launching a step) and ``wait`` add up
to about the same time whichever way the time between them falls (EAGLE-3 at batch 64 on an
H100: 4.16 + 2.85 ms with the drafts on the device, 3.20 + 4.15 ms without; 2026-12-06), as if
a call in the dispatch waited for the device's previous work. Each case below is timed on the
host, alone and right after launching about 20 ms of device work (a chain of matmuls):
a call that takes about the busy program's remaining time there waits for it.

  put_small     ``jax.device_put`` of a 4 KiB numpy array (a step's packed inputs)
  put_large     ``jax.device_put`` of a 4 MiB numpy array
  call          a small jitted program on device arrays (dispatch alone)
  call_numpy    the same program given a numpy array (a transfer inside the call)
  donate        a jitted program that donates its argument (as a step donates the KV cache)
  donate_busy   the same, donating the busy program's own output
  pinned_put    ``jax.device_put`` through pinned host memory (``memory_kind="pinned_host"``),
                where the backend has it

    python -m benchmarks.probes.dispatch_block [--busy-ms 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def busy_program(size: int, steps: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``steps`` matmuls of ``[size, size]`` in a row: device work that takes a while."""

    @jax.jit
    def run(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, steps, lambda _, y: jnp.tanh(y @ w), x)

    return run


def calibrate(busy_ms: float, size: int) -> tuple[Callable, jax.Array, jax.Array, float]:
    """A busy program of about ``busy_ms`` on this device, its inputs, and its measured ms."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (size, size), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.bfloat16) / size**0.5
    steps = 8
    while True:
        run = busy_program(size, steps)
        jax.block_until_ready(run(x, w))
        start = time.perf_counter()
        jax.block_until_ready(run(x, w))
        ms = (time.perf_counter() - start) * 1e3
        if ms >= busy_ms or steps >= 1 << 16:
            return run, x, w, ms
        steps = max(steps * 2, int(steps * busy_ms / max(ms, 1e-3)))


def cases(busy_out: Callable[[], jax.Array]) -> dict[str, Callable[[], object]]:
    """Each case: a call whose host time is measured (``busy_out``: the busy program's output,
    for the case that donates it)."""
    small = np.arange(1024, dtype=np.int32)
    large = np.zeros(1 << 20, np.float32)
    on_device = jax.device_put(small)
    add = jax.jit(lambda a: a + 1)
    donated = jax.jit(lambda a: a + 1, donate_argnums=0)
    out: dict[str, Callable[[], object]] = {
        "put_small": lambda: jax.device_put(small),
        "put_large": lambda: jax.device_put(large),
        "call": lambda: add(on_device),
        "call_numpy": lambda: add(small),
        "donate": lambda: donated(jax.device_put(small)),
        "donate_busy": lambda: donated(busy_out()),
    }
    device = jax.devices()[0]
    try:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        staged = jax.device_put(small, pinned)
        jax.block_until_ready(jax.device_put(staged, device))
        out["pinned_put"] = lambda: jax.device_put(jax.device_put(small, pinned), device)
    except Exception as exc:  # a backend without pinned host memory
        print(f"pinned_put: not run ({type(exc).__name__}: {exc})")
    return out


def host_ms(call: Callable[[], object], before: Callable[[], object] | None, repeats: int) -> float:
    """The best host time of ``call`` (ms), each time right after ``before`` (launched, not
    waited for) when given; the device drained between repeats."""
    best = float("inf")
    for _ in range(repeats):
        pending = before() if before is not None else None
        start = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - start)
        jax.block_until_ready(result)
        if isinstance(pending, jax.Array) and not pending.is_deleted():  # (not donated)
            jax.block_until_ready(pending)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=20.0)
    parser.add_argument("--size", type=int, default=4096, help="the busy matmuls' size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    run, x, w, busy = calibrate(args.busy_ms, args.size)
    print(f"busy program: {busy:.1f} ms", flush=True)
    latest: list[jax.Array] = []

    def launch() -> jax.Array:
        latest[:] = [run(x, w)]
        return latest[0]

    def busy_out() -> jax.Array:
        return latest[0] if latest else run(x, w)

    rows = []
    for name, call in cases(busy_out).items():
        jax.block_until_ready(call())  # compiles
        idle = host_ms(call, None, args.repeats) if name != "donate_busy" else float("nan")
        loaded = host_ms(call, launch, args.repeats)
        rows.append({"case": name, "idle_ms": idle, "busy_ms": loaded, "busy_program_ms": busy})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'case':<12} {'idle ms':>9} {'busy ms':>9}  (busy program {busy:.1f} ms)")
    for row in rows:
        waits = " <- waits for the device" if row["busy_ms"] > 0.5 * busy else ""
        print(f"{row['case']:<12} {row['idle_ms']:>9.3f} {row['busy_ms']:>9.3f}{waits}")


if __name__ == "__main__":
    main()
