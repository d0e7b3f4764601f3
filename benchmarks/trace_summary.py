"""Summarise the device side of a Perfetto trace written by ``jax.profiler.trace``.

For each device stream: the span from its first kernel to its last, the time kernels ran
(busy) and the idle gaps between them, and the kernels grouped by name (digits dropped, so
``fusion.12`` and ``fusion.31`` are one row), largest total first. ``--by-module`` first
splits each stream's kernels by the XLA program that launched them (the ``hlo_module`` the
profiler records with each kernel: ``jit_step``, ``jit_drafting_chain``, ...), so that a
drafter's chain and the verify step it feeds read apart in one trace.

``--host`` summarises the host's threads instead: per thread, its events grouped by name
(XLA's and PJRT's annotations: ``PjitFunction(step)``, ``Wait for usage holds``, a command
buffer's recording, ...), each name's inclusive time per step, largest first; the threads
with the most event time first (``--threads`` of them). A host call that waits for the device
(a launch that blocks) shows there as the wait's own event.

    python -m benchmarks.trace_summary TRACE_DIR_OR_FILE [--top 25] [--steps N] [--by-module]
    python -m benchmarks.trace_summary TRACE_DIR_OR_FILE --host [--threads 3] [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path


def load(path: Path) -> list[dict]:
    if path.is_dir():  # the newest trace below it (a profile dir collects one per run)
        path = max(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=1, help="steps in the trace (per-step us)")
    parser.add_argument("--by-module", action="store_true", help="kernels by XLA program first")
    parser.add_argument("--host", action="store_true", help="the host's threads, not the device")
    parser.add_argument("--threads", type=int, default=3, help="with --host: how many threads")
    args = parser.parse_args()
    events = load(args.trace)
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    thread = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("name") == "thread_name"
    }
    streams: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if is_device(process.get(e["pid"], "")) != args.host:
            streams[(e["pid"], e.get("tid"))].append(e)
    if args.host:
        print_host(streams, process, thread, args)
        return
    for key, evs in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        evs.sort(key=lambda e: e["ts"])
        span = evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"]
        busy, end = 0.0, evs[0]["ts"]
        for e in evs:  # union of intervals (nested events count once)
            start, stop = max(e["ts"], end), e["ts"] + e["dur"]
            if stop > start:
                busy += stop - start
                end = stop
        label = f"{process.get(key[0], key[0])} / {thread.get(key, key[1])}"
        print(
            f"\n{label}: {len(evs)} events, span {span / args.steps:.0f} us/step, "
            f"busy {busy / args.steps:.0f} us/step ({busy / span:.0%}), "
            f"idle {(span - busy) / args.steps:.0f} us/step"
        )
        if not args.by_module:
            print_kernels(evs, args.steps, args.top, "  ")
            continue
        modules: dict[str, list[dict]] = collections.defaultdict(list)
        for e in evs:
            modules[e.get("args", {}).get("hlo_module", "(no module)")].append(e)
        for module, module_evs in sorted(modules.items(), key=lambda kv: -total(kv[1])):
            print(
                f"  {module}: {total(module_evs) / args.steps:.1f} us/step, "
                f"{len(module_evs) / args.steps:.1f} kernels/step"
            )
            print_kernels(module_evs, args.steps, args.top, "    ")


def is_device(process_name: str) -> bool:
    return "GPU" in process_name or "/device:" in process_name and "CPU" not in process_name


def print_host(
    threads: dict[tuple, list[dict]], process: dict, thread: dict, args: argparse.Namespace
) -> None:
    """Each of the busiest host threads' events by name: inclusive time per step (a parent's
    time holds its children's), count per step and mean, largest total first."""
    busiest = sorted(threads.items(), key=lambda kv: -total(kv[1]))[: args.threads]
    for key, evs in busiest:
        label = f"{process.get(key[0], key[0])} / {thread.get(key, key[1])}"
        print(f"\n{label}: {len(evs)} events")
        print_kernels(evs, args.steps, args.top, "  ")


def total(evs: list[dict]) -> float:
    return sum(e["dur"] for e in evs)


def print_kernels(evs: list[dict], steps: int, top: int, indent: str) -> None:
    """The kernels of ``evs`` grouped by name (digits dropped), largest total first."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for e in evs:
        groups[re.sub(r"[\d_.]+$", "", re.sub(r"\.\d+", "", e["name"]))].append(e["dur"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, durs in rows:
        print(
            f"{indent}{sum(durs) / steps:9.1f} us/step  {len(durs) / steps:7.1f} x  "
            f"{sum(durs) / len(durs):8.2f} us avg  {name[:90]}"
        )


if __name__ == "__main__":
    main()
