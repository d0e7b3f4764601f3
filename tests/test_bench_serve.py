"""`jaxserve bench serve` against a fake OpenAI-compatible streaming server on 127.0.0.1.

The fake server streams one chunk per token after a fixed first-token delay, ends with a usage
chunk and ``[DONE]``, and fails chosen prompts: with an HTTP 500, or with an error event in the
middle of the stream. Its /metrics reports the requests in flight as ``num_requests_waiting``.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from jaxserve.bench import report, serve
from jaxserve.bench.datasets import DatasetSpec, sample_requests

MODEL = "fake-model"
FIRST_TOKEN_DELAY_S = 0.03
TOKEN_DELAY_S = 0.002
# asyncio runs a timer once it is due within the clock's resolution, so a sleep may end that
# much early; measured delays are compared with this slack per sleep.
SLEEP_SLACK_S = time.get_clock_info("monotonic").resolution + 1e-3


def fake_app(fail_http: set[str], fail_stream: set[str], api_key: str | None = None) -> Starlette:
    """Prompts (JSON-encoded) in `fail_http` get a 500, in `fail_stream` an error mid-stream."""
    in_flight = 0

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(
            f'jaxserve:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
            f'jaxserve:num_requests_waiting{{model_name="{MODEL}"}} {float(in_flight)}\n'
        )

    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == MODEL
        is_chat = request.url.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
        key = json.dumps(prompt)
        if key in fail_http:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        num_prompt = len(prompt.split()) if is_chat else len(prompt)
        num_out = body["max_tokens"]

        async def events() -> AsyncIterator[str]:
            nonlocal in_flight
            in_flight += 1
            try:
                await asyncio.sleep(FIRST_TOKEN_DELAY_S)
                for i in range(num_out):
                    if i == 1 and key in fail_stream:
                        yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                        return
                    choice = (
                        {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                        if is_chat
                        else {"index": 0, "text": f"t{i} ", "finish_reason": None}
                    )
                    yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
                    await asyncio.sleep(TOKEN_DELAY_S)
                usage = {
                    "prompt_tokens": num_prompt,
                    "completion_tokens": num_out,
                    "total_tokens": num_prompt + num_out,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


@contextmanager
def running(app: Starlette) -> Iterator[str]:
    """Serves `app` with uvicorn in a thread on a free loopback port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _config(base_url: str, **overrides: object) -> serve.ServeBenchConfig:
    values: dict = dict(
        base_url=base_url,
        request_rates=(50.0, math.inf),
        num_prompts=12,
        random_input_len=8,
        random_output_len=6,
        random_range_ratio=0.5,
        seed=3,
        target_ttft_p95_ms=1000.0,
        target_itl_p95_ms=100.0,
        show_progress=False,
    )
    values.update(overrides)
    return serve.ServeBenchConfig(**values)


def test_sweep_accounts_for_every_request_and_token() -> None:
    config = _config("http://unused")
    spec = config.dataset_spec()
    # Each rate draws fresh prompts (no prefix-cache reuse across rates).
    per_rate = [sample_requests(dataclasses.replace(spec, rate_index=i)) for i in range(2)]
    assert per_rate[0][0].prompt != per_rate[1][0].prompt
    fail_http = {json.dumps(samples[i].prompt) for samples in per_rate for i in (2, 7)}
    fail_stream = {json.dumps(samples[5].prompt) for samples in per_rate}
    with running(fake_app(fail_http, fail_stream)) as url:
        config = _config(url, goodput={"ttft": 10_000.0})
        sweep = asyncio.run(serve.benchmark(config))

    assert sweep.model == MODEL
    assert [r.request_rate for r in sweep.rates] == [50.0, math.inf]
    for rate, samples in zip(sweep.rates, per_rate, strict=True):
        m = rate.metrics
        assert len(rate.outputs) == config.num_prompts
        assert (m.completed, m.failed) == (9, 3)
        for i, (sample, out) in enumerate(zip(samples, rate.outputs, strict=True)):
            if i in (2, 7):
                assert not out.success and out.error.startswith("HTTP 500"), out
            elif i == 5:
                assert not out.success and "engine died" in out.error, out
            else:
                assert out.success, out
                assert out.prompt_len == sample.prompt_len == len(sample.prompt)
                assert out.output_len == sample.output_len
                assert len(out.itls) == sample.output_len - 1  # one chunk per token
                assert out.ttft >= FIRST_TOKEN_DELAY_S - SLEEP_SLACK_S
                # The server cannot send the last token sooner; chunks may arrive coalesced.
                sleeps = sample.output_len
                least = FIRST_TOKEN_DELAY_S + (sleeps - 1) * TOKEN_DELAY_S - sleeps * SLEEP_SLACK_S
                assert out.latency >= least
                assert out.ttft + sum(out.itls) == pytest.approx(out.latency)
        good = [s for i, s in enumerate(samples) if i not in (2, 5, 7)]
        assert m.total_input_tokens == sum(s.prompt_len for s in good)
        assert m.total_output_tokens == sum(s.output_len for s in good)
        assert m.latencies["ttft"].count == 9
        assert m.latencies["itl"].count == sum(s.output_len - 1 for s in good)
        assert m.request_goodput == pytest.approx(m.request_throughput)
        assert m.max_concurrent_requests >= 1
        assert rate.server_queue is not None and rate.server_queue.metric_prefix == "jaxserve"
    burst = sweep.rates[1]
    # rate=inf sends at once: every request before any has finished (an order, where "< 0.5 s"
    # was a clock); each takes the server's first-token delay at least.
    first_end = min(o.start_time + o.latency for o in burst.outputs if o.success)
    assert max(o.start_time for o in burst.outputs) < first_end
    assert burst.metrics.max_concurrent_requests >= 6


def test_cli_writes_results_capacity_note_and_plots(tmp_path, capsys) -> None:
    with running(fake_app(set(), set(), api_key="sekret")) as url:
        rc = serve.main(
            [
                f"--base-url={url}/v1",
                "--request-rates=40,inf",
                "--num-prompts=10",
                "--random-input-len=4",
                "--random-output-len=4",
                "--max-concurrency=4",
                "--api-key=sekret",
                "--disable-tqdm",
                f"--result-dir={tmp_path}",
            ]
        )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("============ Serving Benchmark Result ============") == 2
    assert "---------------Time to First Token----------------" in out
    assert "Successful requests:                     10" in out
    assert "Maximum request concurrency:             4" in out
    assert "P95 ITL (ms):" in out and "P99 E2EL (ms):" in out

    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert "sekret" not in (tmp_path / "sweep.json").read_text()
    assert [r["request_rate"] for r in sweep["rates"]] == ["40", "inf"]
    per_rate = json.loads((tmp_path / "rate_40.json").read_text())
    assert per_rate["output_lens"] == [4] * 10 and per_rate["errors"] == [""] * 10
    assert max(r["max_concurrent_requests"] for r in sweep["rates"]) <= 4
    note = (tmp_path / "capacity.md").read_text()
    assert "# Capacity note: fake-model" in note
    assert "Highest rate within target: 40 req/s" in note
    for name in report.PLOT_NAMES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The note can be written again from the saved JSON, with another target.
    (tmp_path / "capacity.md").unlink()
    assert report.main([str(tmp_path), "--target-ttft-p95-ms=0.001"]) == 0
    assert (
        "The lowest tested rate, 40 req/s, already breaks the target"
        in (tmp_path / "capacity.md").read_text()
    )


def test_chat_endpoint_sends_text_prompts() -> None:
    with running(fake_app(set(), set())) as url:
        config = _config(
            url, endpoint="/v1/chat/completions", request_rates=(math.inf,), num_prompts=4
        )
        sweep = asyncio.run(serve.benchmark(config))
    outputs = sweep.rates[0].outputs
    assert all(o.success for o in outputs)
    samples = sample_requests(config.dataset_spec())
    assert all(isinstance(s.prompt, str) for s in samples)
    assert [o.prompt_len for o in outputs] == [len(s.prompt.split()) for s in samples]


def test_unreachable_server_and_rejected_requests_are_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    with pytest.raises(serve.BenchmarkError, match="pass --model"):
        asyncio.run(serve.benchmark(_config(f"http://127.0.0.1:{free_port}")))
    with running(fake_app(set(), set(), api_key="right")) as url:
        with pytest.raises(serve.BenchmarkError, match="HTTP 401"):
            asyncio.run(serve.benchmark(_config(url, api_key="wrong")))


def test_arrivals_are_poisson_at_the_rate_and_deterministic() -> None:
    offsets = serve.arrival_offsets(20_000, 8.0, 1.0, (0, 1))  # f64[20000]
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)  # exponential: std == mean
    regular = np.diff(serve.arrival_offsets(20_000, 8.0, 100.0, (0, 1)))
    assert regular.mean() == pytest.approx(1 / 8.0, rel=0.03) and regular.std() < 0.02
    np.testing.assert_array_equal(offsets, serve.arrival_offsets(20_000, 8.0, 1.0, (0, 1)))
    assert not np.array_equal(offsets, serve.arrival_offsets(20_000, 8.0, 1.0, (1, 1)))
    assert not serve.arrival_offsets(5, math.inf, 1.0, (0, 0)).any()


def test_datasets_lengths_ranges_and_seeds(tmp_path) -> None:
    spec = DatasetSpec(name="random", num_prompts=200, input_len=100, output_len=10, seed=7)
    reqs = sample_requests(spec)
    assert all(len(r.prompt) == r.prompt_len == 100 and r.output_len == 10 for r in reqs)
    ids = np.concatenate([r.prompt for r in reqs])  # i64[200 * 100]
    assert ids.min() >= 10 and ids.max() < 500
    assert sample_requests(spec) == reqs
    other = sample_requests(DatasetSpec(name="random", num_prompts=200, input_len=100, seed=8))
    assert other[0].prompt != reqs[0].prompt

    ranged = sample_requests(
        DatasetSpec(name="random", num_prompts=300, input_len=100, output_len=20, range_ratio=0.5)
    )
    lens = [r.prompt_len for r in ranged]
    assert 50 <= min(lens) < 60 and 140 < max(lens) <= 150
    assert all(10 <= r.output_len <= 30 for r in ranged)

    prefixed = sample_requests(
        DatasetSpec(
            name="prefix-repetition", num_prompts=6, input_len=5, prefix_len=16, num_prefixes=2
        )
    )
    assert all(r.prompt_len == 21 for r in prefixed)
    assert prefixed[0].prompt[:16] == prefixed[2].prompt[:16] != prefixed[1].prompt[:16]
    assert prefixed[0].prompt[16:] != prefixed[2].prompt[16:]

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"prompt": "bye"}\n')
    rows = sample_requests(DatasetSpec.parse(f"jsonl:{path}", num_prompts=3, output_len=9))
    assert [(r.prompt, r.output_len) for r in rows] == [
        ("hello there", 3),
        ("bye", 9),
        ("hello there", 3),
    ]
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2"):
        sample_requests(DatasetSpec.parse(f"jsonl:{path}", num_prompts=1))
    with pytest.raises(ValueError, match="range_ratio=1.5"):
        DatasetSpec(name="random", num_prompts=1, range_ratio=1.5)


def test_config_and_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="endpoint="):
        serve.ServeBenchConfig(endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="dataset='sharegpt'"):
        serve.ServeBenchConfig(dataset="sharegpt")
    with pytest.raises(ValueError, match="goodput"):
        serve.ServeBenchConfig(goodput={"speed": 1.0})
    assert serve.ServeBenchConfig(base_url="http://h:1/v1/").base_url == "http://h:1"
    assert "api_key" not in serve.ServeBenchConfig(api_key="k").to_dict()
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    args = parser.parse_args(["--request-rates", "2,4,inf", "--goodput", "ttft:500,itl:50"])
    config = serve.config_from_args(args)
    assert config.request_rates == (2.0, 4.0, math.inf)
    assert config.goodput == {"ttft": 500.0, "itl": 50.0}
    assert config.num_prompts == 200 and config.endpoint == "/v1/completions"
    with pytest.raises(SystemExit):
        parser.parse_args(["--request-rates", "2,-1"])
