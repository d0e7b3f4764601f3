"""Metrics: Prometheus series with vLLM's names under ``jaxserve:``, and the periodic stats line.

Two sources feed it. Engine-wide numbers (running / waiting requests, KV-cache usage, prefix
cache and token counters, preemptions, aborts) are read from ``EngineCore.stats`` at scrape
time by a custom collector, so they are never stale. Per-request numbers (latencies, sizes,
finish reasons) are observed when ``Generation`` reports a finished ``RequestRecord``. Every app
gets its own ``CollectorRegistry`` so several apps can live in one process (tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.interfaces import EngineClient
from jaxserve.server.generation import RequestRecord

_LOG = logging.getLogger("jaxserve.server.stats")

# Bucket edges in seconds, the same spread as vLLM's so dashboards keep their resolution.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on
# Why a request got 429: a rate limit (ratelimit.py) or the engine's waiting queue.
RATE_LIMIT_REASONS = ("requests", "tokens", "queue_full")


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` at every scrape."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        label = [self.model_name]
        gauges = (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0-1).",
                stats.kv_cache_usage,
            ),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        counters = (
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            (
                "num_preemptions",
                "Sequences preempted for lack of KV-cache blocks.",
                stats.num_preemptions,
            ),
            ("prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.generation_tokens),
            (
                "num_aborted_requests",
                "Requests aborted (client gone, shutdown).",
                stats.num_aborted,
            ),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(
                f"jaxserve:{name}", doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.request_success = Counter(
            "jaxserve:request_success",
            "Finished sequences, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "jaxserve:rate_limited_requests",
            "Requests refused with 429, by reason (requests, tokens, queue_full).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        for reason in RATE_LIMIT_REASONS:
            self.rate_limited.labels(model_name, reason)
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between successive outputs of a request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last output.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        size_buckets = token_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", size_buckets
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated per finished request.", size_buckets
        )

    def observe(self, record: RequestRecord) -> None:
        now = time.time()
        metrics = record.engine_metrics
        arrival = metrics.arrival_time if metrics is not None else record.start_time
        for reason in record.finish_reasons.values():
            self.request_success.labels(self.model_name, reason).inc()
        self.prompt_tokens.observe(len(record.request.prompt_token_ids))
        self.generation_tokens.observe(record.num_generation_tokens)
        first_token = (metrics and metrics.first_token_time) or record.first_token_time
        last_token = (metrics and metrics.last_token_time) or record.last_token_time
        if first_token is not None:
            self.ttft.observe(max(0.0, first_token - arrival))
            num_samples = max(1, len(record.finish_reasons))
            per_sample = record.num_generation_tokens / num_samples
            if last_token is not None and per_sample > 1:
                self.tpot.observe(max(0.0, (last_token - first_token) / (per_sample - 1)))
        for latency in record.inter_token_latencies:
            self.itl.observe(latency)
        if metrics is not None and metrics.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, metrics.first_scheduled_time - arrival))
        finished = (metrics and metrics.finished_time) or now
        self.e2e.observe(max(0.0, finished - arrival))

    def count_rate_limited(self, reason: str) -> None:
        self.rate_limited.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """Logs one line of engine activity per interval, in vLLM's words, only while busy."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._last_time = time.monotonic()
        self._last = engine.stats()

    def log(self) -> str | None:
        """Log (and return) the line for the interval since the last call, if there was work."""
        now, stats = time.monotonic(), self.engine.stats()
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = stats, now
        prompt = stats.prompt_tokens - last.prompt_tokens
        generation = stats.generation_tokens - last.generation_tokens
        if not (prompt or generation or stats.num_running or stats.num_waiting):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        line = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        _LOG.info(line)
        return line
