"""Benchmark statistics: per-request timings in, the serving metrics of one request rate out.

`serve.py` fills one `RequestOutput` per request sent; `compute_metrics` turns a rate's outputs
into `BenchmarkMetrics`, which `format_table` prints in vLLM's ``bench serve`` layout and
`to_dict` saves with vLLM's JSON key names (``mean_ttft_ms``, ``p99_itl_ms``, ...). A sweep's
results (`RateResult`, `SweepResult`) are saved as JSON in the result directory, which
`report.py` reads back. Latencies are measured in seconds and reported in milliseconds.

Definitions (as vLLM's benchmark uses them):
- TTFT: request sent -> first streamed chunk carrying generated text.
- ITL: the gaps between consecutive chunks carrying text, pooled over all requests.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token.
- E2EL: request sent -> last chunk.
- Goodput: successful requests per second that meet every SLO given; the ``itl`` SLO applies to
  a request's mean inter-token latency.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (95, 99)  # printed and saved next to mean and median
LATENCY_METRICS = (  # (key, name in the table, section header)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclasses.dataclass
class RequestOutput:
    """What the load generator observed for one request (times in seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # usage.prompt_tokens, or the dataset's count when usage is missing
    output_len: int = 0  # usage.completion_tokens, or the number of text chunks
    ttft: float = 0.0
    itls: list[float] = dataclasses.field(default_factory=list)  # one per gap between chunks
    latency: float = 0.0  # e2e for a success; time until the failure otherwise
    start_time: float = 0.0  # when it was sent, relative to the start of its rate

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True)
class Distribution:
    """Summary of one latency, in milliseconds; all zero when there is no sample."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[int, float], ...]  # ((95, p95), (99, p99))

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, tuple((p, 0.0) for p in PERCENTILES))
        ms = [v * 1000.0 for v in values]
        return cls(
            count=len(ms),
            mean=float(np.mean(ms)),
            median=percentile(ms, 50),
            std=float(np.std(ms)),
            percentiles=tuple((p, percentile(ms, p)) for p in PERCENTILES),
        )


@dataclasses.dataclass(frozen=True)
class BenchmarkMetrics:
    """The result of one request rate."""

    completed: int
    failed: int
    duration: float  # s, first request sent -> last request finished
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful req/s
    request_goodput: float | None  # req/s meeting the SLOs; None without --goodput
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_output_tokens_per_s: float  # busiest one-second window
    max_concurrent_requests: int
    latencies: dict[str, Distribution]  # keyed by LATENCY_METRICS keys

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "latencies"
        }
        for key, dist in self.latencies.items():
            out[f"mean_{key}_ms"] = dist.mean
            out[f"median_{key}_ms"] = dist.median
            out[f"std_{key}_ms"] = dist.std
            for p, value in dist.percentiles:
                out[f"p{p}_{key}_ms"] = value
        return out


def parse_goodput(text: str) -> dict[str, float]:
    """``"ttft:500,itl:50"`` -> ``{"ttft": 500.0, "itl": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(
                f"--goodput item {item!r} must be KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}={value!r} must be a number of ms") from None
        if not ms > 0:
            raise ValueError(f"--goodput {key}={value!r} must be > 0 ms")
        slos[key] = ms
    return slos


def meets_slos(output: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a request is 'good': successful and within every SLO (ms)."""
    if not output.success:
        return False
    observed = {
        "ttft": output.ttft,
        "tpot": output.tpot or 0.0,
        "itl": float(np.mean(output.itls)) if output.itls else 0.0,
        "e2el": output.latency,
    }
    return all(observed[key] * 1000.0 <= limit for key, limit in slos.items())


def max_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at once, from their start times and latencies."""
    events = []
    for out in outputs:
        events.append((out.start_time, 1))
        events.append((out.start_time + out.latency, -1))
    events.sort()  # at equal times -1 sorts first: a request that ends frees its slot
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(outputs: Sequence[RequestOutput]) -> float:
    """Output tokens in the busiest one-second window (windows aligned on the rate's start).

    A chunk may carry several tokens; each request's tokens are spread evenly over its chunks.
    """
    times: list[float] = []
    weights: list[float] = []
    for out in outputs:
        if not out.success or out.output_len == 0:
            continue
        chunk_times = out.start_time + out.ttft + np.cumsum([0.0, *out.itls])  # f64[chunks]
        times.extend(chunk_times.tolist())
        weights.extend([out.output_len / len(chunk_times)] * len(chunk_times))
    if not times:
        return 0.0
    seconds = np.floor(np.asarray(times)).astype(np.int64)  # i64[num_chunks]
    per_second = np.bincount(seconds - seconds.min(), weights=weights)  # f64[num_seconds]
    return float(per_second.max())


def compute_metrics(
    outputs: Sequence[RequestOutput], duration: float, goodput_slos: dict[str, float] | None
) -> BenchmarkMetrics:
    """The metrics of one rate; `duration` is the rate's wall time in seconds."""
    if duration <= 0:
        raise ValueError(f"duration={duration} must be > 0")
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_len for o in done)
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for o in done if (t := o.tpot) is not None],
        "itl": [gap for o in done for gap in o.itls],
        "e2el": [o.latency for o in done],
    }
    goodput = None
    if goodput_slos:
        goodput = sum(meets_slos(o, goodput_slos) for o in done) / duration
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        duration=duration,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration,
        request_goodput=goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_output_tokens_per_s(done),
        max_concurrent_requests=max_concurrency(outputs),
        latencies={key: Distribution.of_seconds(samples[key]) for key, _, _ in LATENCY_METRICS},
    )


def format_table(
    metrics: BenchmarkMetrics, request_rate: float, max_concurrency_limit: int | None
) -> str:
    """The result of one rate, laid out like vLLM's ``bench serve`` output."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: float | int, fmt: str) -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics.completed, "")
    row("Failed requests:", metrics.failed, "")
    if max_concurrency_limit is not None:
        row("Maximum request concurrency:", max_concurrency_limit, "")
    if math.isfinite(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", metrics.duration, ".2f")
    row("Total input tokens:", metrics.total_input_tokens, "")
    row("Total generated tokens:", metrics.total_output_tokens, "")
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    if metrics.request_goodput is not None:
        row("Request goodput (req/s):", metrics.request_goodput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", metrics.max_concurrent_requests, ".2f")
    row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for key, name, header in LATENCY_METRICS:
        dist = metrics.latencies[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", dist.mean, ".2f")
        row(f"Median {name} (ms):", dist.median, ".2f")
        for p, value in dist.percentiles:
            row(f"P{p} {name} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_rate(rate: float) -> str:
    """``2.0`` -> ``"2"``, ``0.5`` -> ``"0.5"``, ``inf`` -> ``"inf"`` (JSON and file names)."""
    return f"{rate:g}"


@dataclasses.dataclass(frozen=True)
class ServerQueueStats:
    """The server's own queue gauges, polled from its /metrics while one rate ran."""

    metric_prefix: str  # "jaxserve" or "vllm"
    num_samples: int
    waiting_max: float
    waiting_mean: float
    running_max: float

    @classmethod
    def of_samples(
        cls, prefix: str, waiting: Sequence[float], running: Sequence[float]
    ) -> ServerQueueStats | None:
        if not waiting:
            return None
        return cls(prefix, len(waiting), max(waiting), float(np.mean(waiting)), max(running))


@dataclasses.dataclass(frozen=True)
class RateResult:
    """Everything measured at one request rate."""

    request_rate: float  # req/s configured; inf = all at once
    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]  # one per request, in sending order
    server_queue: ServerQueueStats | None  # None when /metrics had no queue gauges

    def summary_dict(self) -> dict[str, object]:
        return {
            "request_rate": format_rate(self.request_rate),
            "num_prompts": len(self.outputs),
            **self.metrics.to_dict(),
            "server_queue": dataclasses.asdict(self.server_queue) if self.server_queue else None,
        }

    def to_dict(self) -> dict[str, object]:
        """The summary plus the per-request arrays (vLLM's names, times in seconds)."""
        return {
            **self.summary_dict(),
            "input_lens": [o.prompt_len for o in self.outputs],
            "output_lens": [o.output_len for o in self.outputs],
            "ttfts": [o.ttft for o in self.outputs],
            "itls": [o.itls for o in self.outputs],
            "e2els": [o.latency for o in self.outputs],
            "start_times": [o.start_time for o in self.outputs],
            "errors": [o.error for o in self.outputs],
        }


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """A whole ``bench serve`` run: the setup and one `RateResult` per rate, in run order."""

    config: dict[str, object]  # ServeBenchConfig.to_dict(): no API key
    model: str
    date: str  # ISO 8601, local time with offset
    rates: tuple[RateResult, ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "date": self.date,
            "model": self.model,
            "config": self.config,
            "rates": [r.summary_dict() for r in self.rates],
        }

    def save(self, result_dir: Path) -> None:
        """Writes ``sweep.json`` and one ``rate_<R>.json`` per rate (with per-request data)."""
        result_dir.mkdir(parents=True, exist_ok=True)
        header = {"date": self.date, "model": self.model, "config": self.config}
        for r in self.rates:
            path = result_dir / f"rate_{format_rate(r.request_rate)}.json"
            path.write_text(json.dumps({**header, **r.to_dict()}, indent=1) + "\n")
        (result_dir / "sweep.json").write_text(json.dumps(self.to_dict(), indent=1) + "\n")
