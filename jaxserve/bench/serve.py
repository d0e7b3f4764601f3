"""`jaxserve bench serve`: replay prompts against a running server at several request rates.

For each rate the load generator sends the dataset's prompts (`datasets.py`) as streaming
OpenAI requests with Poisson arrivals (gamma when ``--burstiness`` is not 1), times every streamed
chunk (`stats.RequestOutput`), prints vLLM's result table (`stats.format_table`) and saves JSON.
After the sweep `report.py` writes the capacity note and plots into ``--result-dir``. While a rate
runs, the server's ``/metrics`` is polled for ``num_requests_waiting`` / ``num_requests_running``
(jaxserve's or vLLM's names) so that the note can name a queue-length scale-out trigger.

Tests and scripts call `benchmark(config)` directly; the CLI calls `add_serve_arguments` and
`run_serve`. Environment proxies are ignored: the benchmark measures the server, not a proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from jaxserve.bench import report
from jaxserve.bench.datasets import DatasetSpec, SampleRequest, sample_requests
from jaxserve.bench.stats import (
    GOODPUT_KEYS,
    RateResult,
    RequestOutput,
    ServerQueueStats,
    SweepResult,
    compute_metrics,
    format_rate,
    format_table,
    parse_goodput,
)
from jaxserve.flag_names import command_flags, in_flag_terms

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_METRICS_POLL_S = 0.5
_QUEUE_GAUGE = re.compile(
    r"^(jaxserve|vllm):num_requests_(waiting|running)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE
)


class BenchmarkError(RuntimeError):
    """The benchmark cannot run against this server (unreachable, no model, rejected request)."""


@dataclasses.dataclass(frozen=True)
class ServeBenchConfig:
    """One sweep: where to send, what to send, at which rates, and the latency target."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id from GET /v1/models
    endpoint: str = "/v1/completions"
    request_rates: tuple[float, ...] = (2.0, 4.0, 8.0, math.inf)  # req/s; inf sends all at once
    num_prompts: int = 200
    max_concurrency: int | None = None
    dataset: str = "random"  # random | jsonl:PATH | prefix-repetition
    random_input_len: int = 256
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_token_low: int = 10
    random_token_high: int = 500
    prefix_len: int = 256
    num_prefixes: int = 1
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # SLOs in ms
    target_ttft_p95_ms: float = 2000.0
    target_itl_p95_ms: float = 100.0
    api_key: str | None = None
    burstiness: float = 1.0
    timeout: float = 600.0  # s per request, whole stream
    show_progress: bool = True
    scrape_metrics: bool = True

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={self.base_url!r} must start with http:// or https://")
        # The server root is wanted (/metrics lives there); accept a URL ending in /v1 too.
        root = self.base_url.rstrip("/").removesuffix("/v1")
        object.__setattr__(self, "base_url", root)
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r} must be one of {', '.join(ENDPOINTS)}")
        if not self.request_rates or not all(r > 0 for r in self.request_rates):
            raise ValueError(f"request_rates={self.request_rates} must be non-empty and all > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")
        for name in ("target_ttft_p95_ms", "target_itl_p95_ms", "burstiness", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for key, ms in self.goodput.items():
            if key not in GOODPUT_KEYS or not ms > 0:
                raise ValueError(f"goodput[{key!r}]={ms}: keys {GOODPUT_KEYS}, values > 0 ms")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        self.dataset_spec()  # validates the dataset fields

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def dataset_spec(self) -> DatasetSpec:
        return DatasetSpec.parse(
            self.dataset,
            num_prompts=self.num_prompts,
            input_len=self.random_input_len,
            output_len=self.random_output_len,
            range_ratio=self.random_range_ratio,
            prefix_len=self.prefix_len,
            num_prefixes=self.num_prefixes,
            token_low=self.random_token_low,
            token_high=self.random_token_high,
            as_text=self.is_chat,
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, object]:
        """For the result JSON: every field except the API key."""
        out = dataclasses.asdict(self)
        del out["api_key"]
        out["request_rates"] = [format_rate(r) for r in self.request_rates]
        return out


def arrival_offsets(num: int, rate: float, burstiness: float, seed: Sequence[int]) -> np.ndarray:
    """Send times in seconds after the start of a rate: f64[num], the first one at 0.

    Gaps are gamma-distributed with mean 1/rate; shape ``burstiness`` = 1 is a Poisson process,
    lower is burstier, higher is more regular. ``rate = inf`` sends everything at once.
    """
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng(list(seed))
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)  # f64[num]
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def parse_queue_gauges(text: str) -> tuple[str, dict[str, float]] | None:
    """Sums ``<prefix>:num_requests_{waiting,running}`` over label sets in Prometheus text."""
    found: dict[str, dict[str, float]] = {}
    for prefix, kind, value in _QUEUE_GAUGE.findall(text):
        totals = found.setdefault(prefix, {})
        totals[kind] = totals.get(kind, 0.0) + float(value)
    for prefix in ("jaxserve", "vllm"):
        if "waiting" in found.get(prefix, {}):
            return prefix, found[prefix]
    return None


async def _poll_server_queue(
    client: httpx.AsyncClient, stop: asyncio.Event
) -> ServerQueueStats | None:
    prefix, waiting, running = "", [], []
    while not stop.is_set():
        try:
            response = await client.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            break
        parsed = parse_queue_gauges(response.text) if response.status_code == 200 else None
        if parsed is None:
            break
        prefix = parsed[0]
        waiting.append(parsed[1]["waiting"])
        running.append(parsed[1].get("running", 0.0))
        try:
            await asyncio.wait_for(stop.wait(), _METRICS_POLL_S)
        except TimeoutError:
            pass
    return ServerQueueStats.of_samples(prefix, waiting, running)


def _payload(config: ServeBenchConfig, model: str, sample: SampleRequest) -> dict[str, object]:
    payload: dict[str, object] = {
        "model": model,
        "max_tokens": sample.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if config.is_chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    return payload


def _chunk_text(chunk: dict, is_chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if not is_chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    model: str,
    sample: SampleRequest,
    t0: float,
) -> RequestOutput:
    """Sends one streaming request and times it; never raises for a failed request."""
    out = RequestOutput(prompt_len=sample.prompt_len or 0)
    start = last = time.perf_counter()
    out.start_time = start - t0
    num_chunks, usage, is_done = 0, None, False
    try:
        async with asyncio.timeout(config.timeout):
            payload = _payload(config, model, sample)
            async with client.stream("POST", config.endpoint, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    out.error = f"HTTP {response.status_code}: {body[:300]}"
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        is_done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error") or chunk.get("object") == "error":
                        out.error = f"stream error: {json.dumps(chunk)[:300]}"
                        return out
                    usage = chunk.get("usage") or usage
                    if _chunk_text(chunk, config.is_chat):
                        if num_chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itls.append(now - last)
                        last, num_chunks = now, num_chunks + 1
        if not is_done:
            out.error = "the stream ended without data: [DONE]"
            return out
    except TimeoutError:
        out.error = f"timed out after {config.timeout:g} s"
        return out
    except Exception as e:  # every request is accounted for, whatever went wrong
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        out.latency = (last if num_chunks and not out.error else time.perf_counter()) - start
    out.success = True
    if num_chunks == 0:  # nothing streamed: the first token is the end
        out.ttft = out.latency
    if usage:
        out.prompt_len = int(usage.get("prompt_tokens", out.prompt_len))
        out.output_len = int(usage.get("completion_tokens", num_chunks))
    else:
        out.output_len = num_chunks
    return out


async def run_rate(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    model: str,
    requests: Sequence[SampleRequest],
    rate: float,
    rate_index: int,
) -> RateResult:
    """Sends every request at one rate and waits for all of them."""
    offsets = arrival_offsets(len(requests), rate, config.burstiness, (config.seed, rate_index))
    semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))
    bar = tqdm(
        total=len(requests),
        desc=f"rate {format_rate(rate)} req/s",
        disable=not config.show_progress,
    )
    stop = asyncio.Event()
    poller = (
        asyncio.create_task(_poll_server_queue(client, stop)) if config.scrape_metrics else None
    )

    async def limited(sample: SampleRequest) -> RequestOutput:
        async with semaphore:
            out = await send_request(client, config, model, sample, t0)
        bar.update(1)
        return out

    t0 = time.perf_counter()
    tasks = []
    for sample, offset in zip(requests, offsets, strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(sample)))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    stop.set()
    server_queue = await poller if poller else None
    bar.close()
    metrics = compute_metrics(outputs, duration, config.goodput)
    return RateResult(rate, metrics, outputs, server_queue)


async def fetch_model_id(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchmarkError(
            f"could not read a model id from {client.base_url}v1/models "
            f"({type(e).__name__}: {e}); pass --model"
        ) from e


async def benchmark(
    config: ServeBenchConfig, on_progress: Callable[[SweepResult], None] | None = None
) -> SweepResult:
    """Runs the sweep; `on_progress` gets the partial result after each rate."""
    spec = config.dataset_spec()
    requests = sample_requests(spec)  # the probe's; each rate of a synthetic set draws its own
    requests_per_rate = spec.name != "jsonl"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    async with httpx.AsyncClient(
        base_url=config.base_url,
        headers=headers,
        timeout=httpx.Timeout(config.timeout, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    ) as client:
        model = config.model or await fetch_model_id(client)
        probe = await send_request(client, config, model, requests[0], time.perf_counter())
        if not probe.success:
            raise BenchmarkError(f"the first test request failed: {probe.error}")
        sweep = SweepResult(config.to_dict(), model, date, ())
        for index, rate in enumerate(config.request_rates):
            if requests_per_rate:
                requests = sample_requests(dataclasses.replace(spec, rate_index=index))
            result = await run_rate(client, config, model, requests, rate, index)
            sweep = dataclasses.replace(sweep, rates=(*sweep.rates, result))
            if on_progress:
                on_progress(sweep)
    return sweep


def _parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rates {text!r}: e.g. 2,4,8,inf") from None
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--request-rates {text!r}: rates must be > 0")
    return rates


def _parse_goodput(text: str) -> dict[str, float]:
    try:
        return parse_goodput(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``bench serve`` flags (vLLM's spellings where the concept exists)."""
    d = ServeBenchConfig()
    add = parser.add_argument
    add("--base-url", default=d.base_url, help="server root (default %(default)s)")
    add("--model", default=None, help="model id to request (default: first of GET /v1/models)")
    add("--endpoint", default=d.endpoint, choices=ENDPOINTS)
    add(
        "--request-rates",
        "--request-rate",
        type=_parse_rates,
        default=d.request_rates,
        metavar="R1,R2,...",
        help="req/s to sweep, 'inf' = all at once (default 2,4,8,inf)",
    )
    add("--num-prompts", type=int, default=d.num_prompts, help="requests per rate (%(default)s)")
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add(
        "--dataset",
        "--dataset-name",
        default=d.dataset,
        help="random | jsonl:PATH | prefix-repetition (default %(default)s)",
    )
    add("--random-input-len", type=int, default=d.random_input_len)
    add("--random-output-len", type=int, default=d.random_output_len)
    add(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths uniform in [L*(1-r), L*(1+r)]",
    )
    add(
        "--random-token-low",
        type=int,
        default=d.random_token_low,
        help="random prompt token ids are drawn from [low, high)",
    )
    add("--random-token-high", type=int, default=d.random_token_high)
    add("--prefix-len", type=int, default=d.prefix_len, help="prefix-repetition: shared tokens")
    add("--num-prefixes", type=int, default=d.num_prefixes, help="prefix-repetition: prefixes")
    add("--ignore-eos", action="store_true", help="generate exactly max_tokens tokens")
    add("--temperature", type=float, default=d.temperature)
    add("--seed", type=int, default=d.seed)
    add(
        "--goodput",
        type=_parse_goodput,
        default={},
        metavar="KEY:MS,...",
        help="SLOs for goodput, keys ttft, tpot, itl, e2el (e.g. ttft:500,itl:50)",
    )
    add(
        "--target-ttft-p95-ms",
        type=float,
        default=d.target_ttft_p95_ms,
        help="latency target of the capacity note (default %(default)s)",
    )
    add(
        "--target-itl-p95-ms",
        type=float,
        default=d.target_itl_p95_ms,
        help="latency target of the capacity note (default %(default)s)",
    )
    add("--api-key", default=None, help="default: $JAXSERVE_API_KEY or $OPENAI_API_KEY")
    add(
        "--result-dir",
        default=None,
        help="where JSON, capacity.md and plots go (default ./jaxserve-bench-DATE-TIME)",
    )
    add("--burstiness", type=float, default=d.burstiness, help="1.0 = Poisson arrivals")
    add("--timeout", type=float, default=d.timeout, help="seconds per request (%(default)s)")
    add("--disable-tqdm", dest="show_progress", action="store_false", help="no progress bars")
    add(
        "--no-server-metrics",
        dest="scrape_metrics",
        action="store_false",
        help="do not poll the server's /metrics for its queue length",
    )


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The config from parsed flags (flag destinations are the config's field names)."""
    names = {f.name for f in dataclasses.fields(ServeBenchConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["request_rates"] = tuple(args.request_rates)
    values["goodput"] = dict(args.goodput)
    env = os.environ
    values["api_key"] = args.api_key or env.get("JAXSERVE_API_KEY") or env.get("OPENAI_API_KEY")
    return ServeBenchConfig(**values)


def run_serve(args: argparse.Namespace) -> int:
    """The ``bench serve`` command: sweep, print, save, write the capacity note."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(
            f"error: {in_flag_terms(str(e), command_flags(add_serve_arguments))}", file=sys.stderr
        )
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result_dir = Path(args.result_dir or f"jaxserve-bench-{stamp}")

    def on_progress(sweep: SweepResult) -> None:
        latest = sweep.rates[-1]
        print(format_table(latest.metrics, latest.request_rate, config.max_concurrency))
        sweep.save(result_dir)

    try:
        sweep = asyncio.run(benchmark(config, on_progress))
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; the rates finished so far are in {result_dir}/", file=sys.stderr)
        return 130
    note = report.write_report(result_dir, sweep.to_dict())
    print(f"\nResults, capacity note and plots: {note.parent}/ ({note.name})")
    print(report.summary(sweep.to_dict()))
    return 0 if any(r.metrics.completed for r in sweep.rates) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxserve bench serve",
        description="Replay prompts against an OpenAI-compatible server at several request "
        "rates; print TTFT/TPOT/ITL/E2EL and write a capacity note.",
    )
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
