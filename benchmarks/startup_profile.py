"""Where a start goes: sample the main thread's stack while ``jaxserve launch``'s start-up runs.

Runs what ``launch`` runs before it serves (imports, the backend, ``AsyncEngine.from_config``:
tokenizer, weights, warm-up) in this process, with a thread that reads the main thread's
stack every ``--interval-ms``. Prints the wall time of each phase and the functions that took
the most of it (inclusive: a function's share counts every sample with it on the stack).
Sampling, not tracing: the start runs at its own speed (``cProfile`` doubles the cost of
tracing-heavy Python and sees nothing of the time spent in C++ with the GIL released).

    python -m benchmarks.startup_profile MODEL_DIR [launch arguments] [--top 30]
"""

from __future__ import annotations

import collections
import sys
import threading
import time

START = time.perf_counter()


class StackSampler:
    """Samples one thread's stack every ``interval`` seconds, on a daemon thread."""

    def __init__(self, thread_id: int, interval: float) -> None:
        self.thread_id = thread_id
        self.interval = interval
        # seconds: each sample weighs the time since the one before it (the sampler waits
        # for the GIL, so samples come further apart while the main thread holds it)
        self.inclusive: collections.Counter = collections.Counter()
        self.leaf: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            weight, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            self.leaf[_name(frame)] += weight
            seen = set()
            while frame is not None:
                name = _name(frame)
                if name not in seen:
                    seen.add(name)
                    self.inclusive[name] += weight
                frame = frame.f_back

    def report(self, top: int) -> None:
        print(
            f"\n{self.samples} samples, every {self.interval * 1e3:.0f} ms or when the GIL allowed"
        )
        print("\ninclusive (a function and everything it called):")
        for name, seconds in self.inclusive.most_common(top):
            print(f"  {seconds:7.2f} s  {name}")
        print("\nself (the innermost Python frame):")
        for name, seconds in self.leaf.most_common(top // 2):
            print(f"  {seconds:7.2f} s  {name}")


def _name(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "jaxserve/", "pallas_kernels/", "lib/python"):
        if marker in path:
            path = path[path.index(marker) :]
            break
    return f"{path}:{code.co_name}"


def main() -> None:
    argv = sys.argv[1:]
    top = 30
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i : i + 2]
    interval = 0.005
    if "--interval-ms" in argv:
        i = argv.index("--interval-ms")
        interval = float(argv[i + 1]) / 1e3
        del argv[i : i + 2]
    phases: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        phases.append((name, time.perf_counter()))

    with StackSampler(threading.get_ident(), interval) as sampler:
        import logging

        from jaxserve.cli import build_parser, hide_torch

        hide_torch()  # as launch does
        args = build_parser(["launch", *argv]).parse_args(["launch", *argv])
        logging.basicConfig(level="INFO", format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        from jaxserve.runner.devices import quiet_backend_probe
        from jaxserve.server.launch.flags import engine_config_from_args

        quiet_backend_probe()
        config = engine_config_from_args(args)
        mark("imports and arguments")
        from jaxserve.engine.async_engine import AsyncEngine
        from jaxserve.server.app import build_app  # noqa: F401  (launch imports it here too)

        mark("engine and server imports")
        from jaxserve.runner.devices import start_backend

        start_backend()
        mark("backend")
        engine = AsyncEngine.from_config(config)
        mark("engine (tokenizer, weights, warm-up)")
    engine.shutdown()
    print(f"\n{'phase':40} {'s':>7}")
    last = START
    for name, at in phases:
        print(f"{name:40} {at - last:7.2f}")
        last = at
    print(f"{'total':40} {last - START:7.2f}")
    print(
        "torch imported:",
        sys.modules.get("torch") is not None,
        "; transformers:",
        "transformers" in sys.modules,
    )
    sampler.report(top)


if __name__ == "__main__":
    main()
