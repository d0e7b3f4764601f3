"""Metrics: Prometheus series with vLLM's names, under ``vllm:`` and ``jaxserve:``, and the
periodic stats line.

``--metrics-prefix`` picks the names (``METRIC_PREFIXES``): under ``vllm:`` every series is
named, labelled (``model_name``, ``engine``="0") and bucketed as vLLM's
``vllm/v1/metrics/loggers.py`` does, with its two info series (``vllm:cache_config_info``,
``vllm:lora_requests_info``), so dashboards, the Prometheus adapter and llm-d's scheduler read
jaxserve as they read vLLM; under ``jaxserve:`` the same series carry only ``model_name``, plus
jaxserve's own (rate-limited and aborted requests).

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

from jaxserve.engine.interfaces import EngineClient, EngineStats
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
# --metrics-prefix -> the prefixes exported.
METRIC_PREFIXES = {"both": ("vllm", "jaxserve"), "vllm": ("vllm",), "jaxserve": ("jaxserve",)}
VLLM_ENGINE = "0"  # the engine label of vLLM's series: one engine per server
# vLLM's FinishReason values: each vllm:request_success series exists from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)


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


def label_names(prefix: str) -> list[str]:
    """vLLM labels its series by model and engine; jaxserve's by model alone."""
    return ["model_name", "engine"] if prefix == "vllm" else ["model_name"]


def label_values(prefix: str, model_name: str) -> list[str]:
    return [model_name, VLLM_ENGINE] if prefix == "vllm" else [model_name]


# (name, help, EngineStats field): gauges, and counters (exported with _total).
ENGINE_GAUGES = (
    ("num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)
ENGINE_COUNTERS = (
    (
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
)
# Speculative decoding's (vLLM's spec_decode_* counters), exported while it is on.
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    (
        "spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        "spec_num_accepted_tokens",
    ),
)
# jaxserve's own (no vLLM name): exported under jaxserve: only.
JAXSERVE_COUNTERS = (
    ("num_aborted_requests", "Requests aborted (client gone, shutdown).", "num_aborted"),
)


class EngineStatsCollector(Collector):
    """Reads ``engine.stats()`` at every scrape."""

    def __init__(
        self, engine: EngineClient, model_name: str, prefixes: tuple[str, ...] = ("jaxserve",)
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefixes = prefixes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for prefix in self.prefixes:
            names, values = label_names(prefix), label_values(prefix, self.model_name)
            counters = ENGINE_COUNTERS + (JAXSERVE_COUNTERS if prefix == "jaxserve" else ())
            for name, doc, field in ENGINE_GAUGES:
                gauge = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=names)
                gauge.add_metric(values, getattr(stats, field))
                yield gauge
            for name, doc, field in counters:
                counter = CounterMetricFamily(f"{prefix}:{name}", doc, labels=names)
                counter.add_metric(values, getattr(stats, field))
                yield counter
            if stats.spec_decode:
                yield from spec_decode_counters(stats, prefix, self.model_name)
        if "vllm" in self.prefixes:
            yield self.cache_config_info(stats)
            yield lora_requests_info(stats)

    def cache_config_info(self, stats: EngineStats) -> Metric:
        """vLLM's ``vllm:cache_config_info``: a gauge of 1 labelled with the cache's settings
        as ``CacheConfig.metrics_info`` renders them (``str`` of each value), and ``engine``.
        vLLM labels it with every CacheConfig field; these are the ones jaxserve has."""
        config = self.engine.config
        info = {
            "block_size": config.block_size,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "num_cpu_blocks": None,
            "num_gpu_blocks": stats.num_gpu_blocks or None,
            "num_gpu_blocks_override": config.num_gpu_blocks_override,
            "prefix_caching_hash_algo": "sha256",
            "engine": VLLM_ENGINE,
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        family.add_metric([str(v) for v in info.values()], 1.0)
        return family


def spec_decode_counters(stats: EngineStats, prefix: str, model_name: str) -> Iterator[Metric]:
    """vLLM's ``spec_decode_*`` counters, and the accepted drafts by their ``position`` in
    the draft (0: the first drafted token)."""
    names, values = label_names(prefix), label_values(prefix, model_name)
    for name, doc, field in SPEC_DECODE_COUNTERS:
        counter = CounterMetricFamily(f"{prefix}:{name}", doc, labels=names)
        counter.add_metric(values, getattr(stats, field))
        yield counter
    per_pos = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*names, "position"],
    )
    for position, count in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([*values, str(position)], count)
    yield per_pos


def lora_requests_info(stats: EngineStats) -> Metric:
    """vLLM's ``vllm:lora_requests_info``: labelled with the adapters loaded at most
    (``max_lora``) and those of running and waiting requests (comma-separated), valued with
    the time (vLLM sets it to the time of its last step). vLLM exports it only with LoRA on;
    jaxserve always does, with ``max_lora="0"`` and no adapters while it serves none."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    values = [
        str(stats.max_lora),
        ",".join(stats.waiting_lora_adapters),
        ",".join(stats.running_lora_adapters),
    ]
    family.add_metric(values, time.time())
    return family


class _Fanout:
    """The same series under each exported prefix, observed or counted together."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class ServerMetrics:
    def __init__(
        self, engine: EngineClient, model_name: str, max_model_len: int, prefix: str = "both"
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefixes = METRIC_PREFIXES[prefix]
        self.registry.register(EngineStatsCollector(engine, model_name, self.prefixes))
        self.request_success = {
            p: Counter(
                f"{p}:request_success",
                "Count of successfully processed requests.",
                [*label_names(p), "finished_reason"],
                registry=self.registry,
            )
            for p in self.prefixes
        }
        for reason in FINISH_REASONS:
            self._count_finished(reason)
        self.rate_limited = None
        if "jaxserve" in self.prefixes:
            self.rate_limited = Counter(
                "jaxserve:rate_limited_requests",
                "Requests refused with 429, by reason (requests, tokens, queue_full).",
                ["model_name", "reason"],
                registry=self.registry,
            )
            for reason in RATE_LIMIT_REASONS:
                self.rate_limited.labels(model_name, reason)
        self._add_histograms(max_model_len)

    def _histogram(self, name: str, doc: str, buckets: Any) -> _Fanout:
        return _Fanout(
            [
                Histogram(
                    f"{p}:{name}", doc, label_names(p), buckets=buckets, registry=self.registry
                ).labels(*label_values(p, self.model_name))
                for p in self.prefixes
            ]
        )

    def _add_histograms(self, max_model_len: int) -> None:
        histogram = self._histogram
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        size_buckets = token_buckets(max_model_len)
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", size_buckets
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", size_buckets
        )
        self.params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            size_buckets,
        )

    def _count_finished(self, reason: str, amount: int = 0) -> None:
        for p, counter in self.request_success.items():
            counter.labels(*label_values(p, self.model_name), reason).inc(amount)

    def observe(self, record: RequestRecord) -> None:
        now = time.time()
        metrics = record.engine_metrics
        arrival = metrics.arrival_time if metrics is not None else record.start_time
        for reason in record.finish_reasons.values():
            self._count_finished(reason, 1)
        params = record.request.params
        self.prompt_tokens.observe(len(record.request.prompt_token_ids))
        self.generation_tokens.observe(record.num_generation_tokens)
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
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
            self._observe_phases(metrics, arrival)
        finished = (metrics and metrics.finished_time) or now
        self.e2e.observe(max(0.0, finished - arrival))

    def _observe_phases(self, metrics: Any, arrival: float) -> None:
        """Queue, prefill, decode and inference times, split as vLLM splits them: scheduled,
        first token, last token."""
        scheduled = metrics.first_scheduled_time
        self.queue_time.observe(max(0.0, scheduled - arrival))
        if metrics.first_token_time is None or metrics.last_token_time is None:
            return
        self.prefill_time.observe(max(0.0, metrics.first_token_time - scheduled))
        self.decode_time.observe(max(0.0, metrics.last_token_time - metrics.first_token_time))
        self.inference_time.observe(max(0.0, metrics.last_token_time - scheduled))

    def count_rate_limited(self, reason: str) -> None:
        if self.rate_limited is not None:
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
        drafts = stats.spec_num_drafts - last.spec_num_drafts
        if stats.spec_decode and drafts:  # vLLM's SpecDecodingLogging, over the interval
            drafted = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
            accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
            line += (
                f", Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
            )
        _LOG.info(line)
        return line
