"""Where a run's time went, from the engine's step log (``JAXSERVE_STEP_LOG``, #36's profile).

Groups the steps by kind: decode-only steps by their batch size, steps that hold prompt tokens
(with decodes beside them or not). Per group: the steps, their share of the run's wall time, the
mean step period and tokens, and the host's spans (propose, schedule, dispatch, process) against
the time the host waited for the device (``wait``), and the host's time between one step's end
and the next one's start (``between``: the caller's loop, outputs handed out, objects freed;
the period comes from the steps' starts, so it counts). Under asynchronous scheduling a step
whose wait is near zero was paced by the host: the device finished before the host needed it,
and idled.

    JAXSERVE_STEP_LOG=steps.jsonl jaxserve bench throughput ...
    python -m benchmarks.step_log_summary steps.jsonl [--skip 50]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DECODE_BUCKETS = (8, 32, 64, 128, 256, 512, 1024)
HOST_PACED_MS = 0.05  # a wait under this: the device was not what the step waited for
IDLE_MS = 1000.0  # a longer gap between two steps: the engine was idle (two runs in one log)
SPANS = ("propose", "schedule", "dispatch", "wait", "process")  # (older logs: no propose)


def kind_of(step: dict) -> str:
    if step["prompt_tokens"] == 0:
        for bound in DECODE_BUCKETS:
            if step["decode"] <= bound:
                return f"decode <= {bound}"
        return f"decode > {DECODE_BUCKETS[-1]}"
    return "prompt + decode" if step["decode"] else "prompt only"


def with_periods(steps: list[dict]) -> list[dict]:
    """Each step with its period (ms from its start to the next step's; the last step's: its
    own span) and ``between``: the part of the period after the step's spans ended, the host's
    time outside the engine's step (the caller's loop, the outputs handed out, the step's
    objects freed). A gap over IDLE_MS (the engine had no work: between two runs in one log)
    counts as the step's own span only."""
    out = []
    for i, step in enumerate(steps):
        last = i + 1 == len(steps)
        period = step["total_ms"] if last else 1e3 * (steps[i + 1]["t"] - step["t"])
        if period - step["total_ms"] > IDLE_MS:
            period = step["total_ms"]
        out.append({**step, "period": period, "between": max(0.0, period - step["total_ms"])})
    return out


def summarize(steps: list[dict]) -> list[dict]:
    """One row per kind (``kind_of``), largest share of the wall time first."""
    steps = with_periods(steps)
    total = sum(s["period"] for s in steps) or 1.0
    groups: dict[str, list[dict]] = {}
    for step in steps:
        groups.setdefault(kind_of(step), []).append(step)
    rows = []
    for kind, group in groups.items():
        n = len(group)
        ms = sum(s["period"] for s in group)
        rows.append(
            {
                "kind": kind,
                "steps": n,
                "share": ms / total,
                "period_ms": ms / n,
                "between_ms": sum(s["between"] for s in group) / n,
                "tokens": sum(s["tokens"] for s in group) / n,
                "decode": sum(s["decode"] for s in group) / n,
                "prompt_tokens": sum(s["prompt_tokens"] for s in group) / n,
                **{span: sum(s.get(span, 0.0) for s in group) / n for span in SPANS},
                "host_paced": sum(s["wait"] < HOST_PACED_MS for s in group) / n,
            }
        )
    return sorted(rows, key=lambda r: -r["share"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N steps")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    lines = args.log.read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.strip()][args.skip :]
    if not steps:  # (a run that failed before its first step)
        print(f"{args.log}: no steps")
        return
    rows = summarize(steps)
    wall = sum(r["period_ms"] * r["steps"] for r in rows) / 1e3
    out_tokens = sum(s["decode"] for s in steps)
    print(f"{len(steps)} steps, {wall:.1f} s of steps, {out_tokens:,} decode tokens")
    print(
        "| kind | steps | share of time | period ms | tokens | decodes | prompt tokens | "
        "propose ms | schedule ms | dispatch ms | wait ms | process ms | between ms | "
        "host-paced |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['steps']} | {r['share']:.1%} | {r['period_ms']:.2f} | "
            f"{r['tokens']:.0f} | {r['decode']:.0f} | {r['prompt_tokens']:.0f} | "
            f"{r['propose']:.2f} | {r['schedule']:.2f} | {r['dispatch']:.2f} | {r['wait']:.2f} | "
            f"{r['process']:.2f} | {r['between_ms']:.2f} | {r['host_paced']:.0%} |"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
