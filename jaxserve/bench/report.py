"""The capacity note: how much load one server holds within a latency target.

Reads a sweep (`stats.SweepResult.to_dict()`, or ``sweep.json`` from a result directory) and
writes ``capacity.md`` (setup, a row per rate, the highest rate within target, the knee, a
scale-out trigger) and three PNG plots next to it. Run it again on saved results, for example
with another target, as ``python -m jaxserve.bench.report RESULT_DIR``.

- Within target: no failed request, p95 TTFT <= target and p95 ITL <= target.
- Highest rate within target: the highest tested rate such that it and every lower rate are
  within target. ``rate=inf`` (all prompts at once) is a burst, not a sustained rate: it is shown
  as the saturation throughput and never counted as a capacity.
- Knee: the first step between consecutive rates where p95 TTFT at least doubles (and grows by
  at least a tenth of the TTFT target), or where achieved throughput grows by less than half as
  much as the offered rate (relative growth).
- Scale-out trigger: the lower of the highest rate within target and the last rate before the
  knee; the queue threshold is the most requests the server had waiting at that rate (from its
  ``/metrics``), or, when the server exposes no queue gauge, the peak in-flight requests seen by
  the client.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

_TTFT_GROWTH = 2.0  # p95 TTFT multiplying by this much between two rates is a knee
_TTFT_GROWTH_MIN_FRACTION = 0.1  # ... when it also grows by this fraction of the target
_THROUGHPUT_GAIN_MIN = 0.5  # achieved growth below this share of offered growth is a knee
PLOT_NAMES = ("ttft_vs_rate.png", "itl_vs_rate.png", "throughput_vs_rate.png")


@dataclasses.dataclass(frozen=True)
class RatePoint:
    """One tested rate, as the note reads it (latencies in ms)."""

    rate: float
    num_prompts: int
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    p50_ttft: float
    p95_ttft: float
    p95_itl: float
    p95_e2el: float
    peak_concurrency: int
    server_waiting_max: float | None
    within_target: bool
    verdict: str  # "yes", or why not

    @classmethod
    def of(cls, row: dict, target_ttft: float, target_itl: float) -> RatePoint:
        problems = []
        if row["failed"]:
            problems.append(f"{row['failed']} failed")
        if row["completed"] and row["p95_ttft_ms"] > target_ttft:
            problems.append(f"TTFT {row['p95_ttft_ms']:,.0f} > {target_ttft:,.0f} ms")
        if row["completed"] and row["p95_itl_ms"] > target_itl:
            problems.append(f"ITL {row['p95_itl_ms']:,.1f} > {target_itl:,.1f} ms")
        queue = row.get("server_queue")
        return cls(
            rate=float(row["request_rate"]),
            num_prompts=row["num_prompts"],
            completed=row["completed"],
            failed=row["failed"],
            request_throughput=row["request_throughput"],
            output_throughput=row["output_throughput"],
            p50_ttft=row["median_ttft_ms"],
            p95_ttft=row["p95_ttft_ms"],
            p95_itl=row["p95_itl_ms"],
            p95_e2el=row["p95_e2el_ms"],
            peak_concurrency=row["max_concurrent_requests"],
            server_waiting_max=queue["waiting_max"] if queue else None,
            within_target=row["completed"] > 0 and not problems,
            verdict="; ".join(problems) if problems else "yes",
        )


@dataclasses.dataclass(frozen=True)
class CapacityAnalysis:
    target_ttft_p95_ms: float
    target_itl_p95_ms: float
    points: tuple[RatePoint, ...]  # finite rates ascending, then inf if tested
    highest_within: RatePoint | None
    first_breaking: RatePoint | None
    knee: tuple[RatePoint, RatePoint, str] | None  # (last before, first at, why)
    saturation: RatePoint | None  # the rate=inf point
    trigger_rate: float | None  # req/s
    trigger_queue: int | None
    trigger_metric: str  # the gauge the queue threshold is stated on


def analyze(
    sweep: dict, target_ttft_p95_ms: float | None = None, target_itl_p95_ms: float | None = None
) -> CapacityAnalysis:
    """Reads the capacity out of a sweep; targets default to the ones the sweep ran with."""
    config = sweep["config"]
    ttft = target_ttft_p95_ms or float(config["target_ttft_p95_ms"])
    itl = target_itl_p95_ms or float(config["target_itl_p95_ms"])
    points = sorted((RatePoint.of(row, ttft, itl) for row in sweep["rates"]), key=lambda p: p.rate)
    finite = [p for p in points if math.isfinite(p.rate)]
    saturation = next((p for p in points if math.isinf(p.rate)), None)
    highest = first_breaking = None
    for p in finite:
        if not p.within_target:
            first_breaking = p
            break
        highest = p
    knee = _find_knee(finite, ttft)
    candidates = [p for p in (highest, knee[0] if knee else None) if p is not None]
    trigger = min(candidates, key=lambda p: p.rate) if highest and candidates else None
    prefix = next(
        (r["server_queue"]["metric_prefix"] for r in sweep["rates"] if r.get("server_queue")),
        "jaxserve",
    )
    if trigger is None:
        queue, metric = None, f"`{prefix}:num_requests_waiting`"
    elif trigger.server_waiting_max is not None:
        queue, metric = (
            max(1, math.ceil(trigger.server_waiting_max)),
            f"`{prefix}:num_requests_waiting`",
        )
    else:
        queue = max(1, trigger.peak_concurrency)
        metric = f"`{prefix}:num_requests_running` + `{prefix}:num_requests_waiting`"
    return CapacityAnalysis(
        ttft,
        itl,
        (*finite, *([saturation] if saturation else [])),
        highest,
        first_breaking,
        knee,
        saturation,
        trigger.rate if trigger else None,
        queue,
        metric,
    )


def _find_knee(
    finite: Sequence[RatePoint], target_ttft: float
) -> tuple[RatePoint, RatePoint, str] | None:
    for before, at in zip(finite, finite[1:], strict=False):
        if not (before.completed and at.completed):
            continue
        grew = at.p95_ttft - before.p95_ttft
        if at.p95_ttft >= _TTFT_GROWTH * before.p95_ttft and grew >= (
            _TTFT_GROWTH_MIN_FRACTION * target_ttft
        ):
            why = f"p95 TTFT jumps from {before.p95_ttft:,.0f} to {at.p95_ttft:,.0f} ms"
            return before, at, why
        offered = at.rate / before.rate - 1.0
        achieved = at.request_throughput / before.request_throughput - 1.0
        if achieved < _THROUGHPUT_GAIN_MIN * offered:
            why = (
                f"throughput grows only from {before.request_throughput:.2f} to "
                f"{at.request_throughput:.2f} req/s"
            )
            return before, at, why
    return None


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def summary(sweep: dict) -> str:
    """The capacity findings in a few lines (also printed at the end of a sweep)."""
    return "\n".join(_findings(analyze(sweep)))


def _findings(a: CapacityAnalysis) -> list[str]:
    lines = []
    if a.highest_within:
        p = a.highest_within
        lines.append(
            f"- **Highest rate within target: {_rate(p.rate)} req/s** (p95 TTFT "
            f"{p.p95_ttft:,.0f} ms, p95 ITL {p.p95_itl:,.1f} ms, "
            f"{p.output_throughput:,.0f} output tok/s)."
        )
    elif a.first_breaking:
        p = a.first_breaking
        lines.append(
            f"- **The lowest tested rate, {_rate(p.rate)} req/s, already breaks the target** "
            f"({p.verdict}). Test lower rates, or scale up."
        )
    else:
        lines.append("- No finite rate was tested: run rates such as 2,4,8 to find the capacity.")
    if a.first_breaking and a.highest_within:
        lines.append(
            f"- **The target breaks at {_rate(a.first_breaking.rate)} req/s**: "
            f"{a.first_breaking.verdict}."
        )
    elif a.highest_within:
        lines.append(
            "- Every finite rate tested is within target: the capacity is at least the highest "
            "one; test higher rates to find where it breaks."
        )
    if a.knee:
        before, at, why = a.knee
        lines.append(f"- **Knee between {_rate(before.rate)} and {_rate(at.rate)} req/s**: {why}.")
    elif len([p for p in a.points if math.isfinite(p.rate)]) > 1:
        lines.append("- No knee within the tested rates: latency and throughput still scale.")
    if a.saturation and a.saturation.completed:
        s = a.saturation
        lines.append(
            f"- **Saturation** (all {s.num_prompts} prompts at once): "
            f"{s.request_throughput:.2f} req/s, {s.output_throughput:,.0f} output tok/s, "
            f"p95 TTFT {s.p95_ttft:,.0f} ms"
            + ("." if s.within_target else f"; the burst breaks the target ({s.verdict}).")
        )
    if a.trigger_rate is not None:
        lines.append(
            f"- **Scale-out trigger**: add a replica when sustained load exceeds "
            f"**{_rate(a.trigger_rate)} req/s**, or {a.trigger_metric} stays above "
            f"**{a.trigger_queue}** for 5 minutes."
        )
    return lines


def _workload(c: dict) -> str:
    unit = "words" if c["endpoint"].endswith("chat/completions") else "tokens"
    ratio = f" (±{c['random_range_ratio']:.0%})" if c["random_range_ratio"] else ""
    lengths = f"input {c['random_input_len']} {unit}, output {c['random_output_len']} tokens"
    if c["dataset"] == "random":
        text = f"random prompts, {lengths}{ratio}"
    elif c["dataset"] == "prefix-repetition":
        text = (
            f"prefix repetition, {c['num_prefixes']} shared prefix(es) of {c['prefix_len']} "
            f"{unit} + random {lengths}{ratio}"
        )
    else:
        text = f"{c['dataset']} (output {c['random_output_len']} tokens where not given)"
    eos = "EOS ignored; " if c["ignore_eos"] else ""
    return f"{text}; {eos}temperature {c['temperature']}; seed {c['seed']}"


def render_markdown(sweep: dict, a: CapacityAnalysis, plots: Sequence[str]) -> str:
    c = sweep["config"]
    lines = [
        f"# Capacity note: {sweep['model']}",
        "",
        f"- Date: {sweep['date']}",
        f"- Server: {c['base_url']}{c['endpoint']}, model `{sweep['model']}`",
        f"- Workload: {_workload(c)}",
        f"- Load: {c['num_prompts']} prompts per rate, "
        + ("Poisson" if c["burstiness"] == 1.0 else f"gamma (burstiness {c['burstiness']})")
        + f" arrivals, max concurrency {c['max_concurrency'] or 'unlimited'}",
        f"- Latency target: p95 TTFT <= {a.target_ttft_p95_ms:,g} ms and p95 ITL <= "
        f"{a.target_itl_p95_ms:,g} ms, no failed request",
        "",
        "## Results per request rate",
        "",
        "| Rate (req/s) | Success | Achieved (req/s) | Output (tok/s) | p50 TTFT (ms) "
        "| p95 TTFT (ms) | p95 ITL (ms) | p95 E2E (ms) | Server queue max | Within target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in a.points:
        queue = "n/a" if p.server_waiting_max is None else f"{p.server_waiting_max:g}"
        lines.append(
            f"| {_rate(p.rate)} | {p.completed}/{p.num_prompts} | {p.request_throughput:.2f} "
            f"| {p.output_throughput:,.0f} | {p.p50_ttft:,.0f} | {p.p95_ttft:,.0f} "
            f"| {p.p95_itl:,.1f} | {p.p95_e2el:,.0f} | {queue} | {p.verdict} |"
        )
    lines += [
        "",
        "## Capacity",
        "",
        *_findings(a),
        "",
        "These figures hold for this workload (prompt and answer lengths, arrivals) on this "
        "server configuration; measure again after any model, flag or traffic change.",
        "",
    ]
    if plots:
        lines += ["## Plots", "", *(f"![{name[:-4]}]({name})" for name in plots), ""]
    else:
        lines += ["(Plots need matplotlib: `pip install matplotlib`.)", ""]
    return "\n".join(lines)


def write_plots(a: CapacityAnalysis, result_dir: Path) -> list[str]:
    """p95 TTFT, p95 ITL (with the target) and output throughput against the rate, as PNGs.

    Finite rates are joined by a line; rate=inf is a separate point at the right.
    """
    try:
        from matplotlib.figure import Figure  # Figure alone renders with Agg, no pyplot state
    except ImportError:
        return []
    inf_x = max((p.rate for p in a.points if math.isfinite(p.rate)), default=1.0) * 1.25
    xs = [p.rate if math.isfinite(p.rate) else inf_x for p in a.points]
    num_finite = sum(math.isfinite(p.rate) for p in a.points)
    series = (  # (label, y of each point, target, what each point's y is)
        ("TTFT (ms)", a.target_ttft_p95_ms, {"p95": "p95_ttft", "p50": "p50_ttft"}),
        ("p95 ITL (ms)", a.target_itl_p95_ms, {"p95": "p95_itl"}),
        ("output throughput (tok/s)", None, {"output": "output_throughput"}),
    )
    for name, (ylabel, target, fields) in zip(PLOT_NAMES, series, strict=True):
        fig = Figure(figsize=(6, 4), dpi=100)
        ax = fig.subplots()
        for (legend, field), style in zip(fields.items(), ("o-", ".:"), strict=False):
            ys = [getattr(p, field) for p in a.points]
            line = ax.plot(xs[:num_finite], ys[:num_finite], style, label=legend)[0]
            ax.plot(xs[num_finite:], ys[num_finite:], style[0], color=line.get_color())
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", label=f"target {target:g} ms")
        ax.set_xticks(xs, [_rate(p.rate) for p in a.points])
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel, title=f"{ylabel} vs request rate")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(result_dir / name, format="png")
    return list(PLOT_NAMES)


def write_report(
    result_dir: Path,
    sweep: dict | None = None,
    *,
    target_ttft_p95_ms: float | None = None,
    target_itl_p95_ms: float | None = None,
) -> Path:
    """Writes capacity.md and the plots into `result_dir`; reads sweep.json if no sweep given."""
    result_dir = Path(result_dir)
    if sweep is None:
        sweep = json.loads((result_dir / "sweep.json").read_text())
    a = analyze(sweep, target_ttft_p95_ms, target_itl_p95_ms)
    result_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(a, result_dir)
    note = result_dir / "capacity.md"
    note.write_text(render_markdown(sweep, a, plots))
    return note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxserve.bench.report",
        description="Write capacity.md and plots from a `jaxserve bench serve` result directory.",
    )
    parser.add_argument("result_dir", type=Path)
    parser.add_argument("--target-ttft-p95-ms", type=float, default=None)
    parser.add_argument("--target-itl-p95-ms", type=float, default=None)
    args = parser.parse_args(argv)
    if not (args.result_dir / "sweep.json").is_file():
        print(f"error: {args.result_dir}/sweep.json not found", file=sys.stderr)
        return 1
    note = write_report(
        args.result_dir,
        target_ttft_p95_ms=args.target_ttft_p95_ms,
        target_itl_p95_ms=args.target_itl_p95_ms,
    )
    print(note.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
