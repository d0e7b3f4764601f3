"""Faults the real engine cannot be made to produce on cue: a fake core behind the real
``AsyncEngine`` and the real app, served on a loopback port.

``FakeCore`` generates hand-computable tokens (sample ``j`` of a request emits token
``(last prompt token + step + j) % vocab``), one per step, and can hold every request in the
waiting queue, fail one request, or crash the step loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.interfaces import EngineStats
from jaxserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.generation import EngineRequest, Generation
from jaxserve.server.launch.serve import DrainingServer
from jaxserve.server.lifecycle import ServerState
from jaxserve.server.metrics import StatsLogger
from jaxserve.server.settings import ServerSettings
from tests.conftest import tiny_server

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
MODEL = "fake"
FAIL_TOKEN = 7  # a prompt ending in this token fails in the "engine"


class FakeCore:
    def __init__(self, step_s: float = 0.005) -> None:
        self.config = EngineConfig(model=str(FIXTURE), served_model_name=MODEL)
        self.model_config = None
        self.tokenizer = Tokenizer(FIXTURE)
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = 64
        self.step_s = step_s
        self.hold = False  # keep everything waiting
        self.crash: BaseException | None = None  # raised by the next step
        self.waiting: list[dict] = []
        self.running: list[dict] = []
        self.aborted: list[str] = []
        self._lock = threading.Lock()
        self.generation_tokens = 0

    def shutdown(self) -> None:
        pass

    def capacity_lines(self) -> list[str]:
        return ["KV cache size: 1,024 tokens"]

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, priority=0,
                    cache_salt=None, arrival_time=None, group_id=None):  # fmt: skip
        request = {
            "id": request_id,
            "prompt": list(prompt_token_ids),
            "params": params,
            "step": 0,
            "metrics": RequestMetrics(arrival_time=arrival_time or time.time()),
        }
        with self._lock:
            self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            for queue in (self.waiting, self.running):
                for request in list(queue):
                    if request["id"] == request_id:
                        queue.remove(request)
                        self.aborted.append(request_id)

    is_sleeping = False  # no sleep mode

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.crash is not None

    def num_waiting(self) -> int:
        return sum(request["params"].n for request in self.waiting)  # samples, as the engine

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting(),
            kv_cache_usage=0.5 if self.running else 0.0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=self.generation_tokens,
            num_aborted=len(self.aborted),
            num_steps=0,
        )

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        if self.crash is not None:
            raise self.crash
        with self._lock:
            if not self.hold:
                self.running += self.waiting
                self.waiting = []
            running = list(self.running)
        outputs = []
        for request in running:
            params, k = request["params"], request["step"]
            request["step"] += 1
            metrics = request["metrics"]
            metrics.first_scheduled_time = metrics.first_scheduled_time or time.time()
            metrics.first_token_time = metrics.first_token_time or time.time()
            failed = request["prompt"][-1] == FAIL_TOKEN
            done = failed or request["step"] >= params.max_tokens
            samples = []
            for j in range(params.n):
                token = (request["prompt"][-1] + k + j) % self.vocab_size
                samples.append(
                    CompletionOutput(
                        index=j,
                        text=f"<{token}>",
                        token_ids=[token],
                        finish_reason=("error" if failed else "length") if done else None,
                    )
                )
            self.generation_tokens += params.n
            if done:
                metrics.finished_time = time.time()
                with self._lock:
                    self.running.remove(request)
            outputs.append(
                RequestOutput(
                    request["id"], None, request["prompt"], samples, finished=done,
                    metrics=metrics, error="injected failure" if failed and done else None,
                )
            )  # fmt: skip
        return outputs


@contextlib.contextmanager
def serve(core: FakeCore, max_queued_requests: int | None = None, **settings):
    """The fake engine behind a loopback server (``tiny_server``); yields the server and the
    event the watchdog sets when the engine dies."""
    engine = AsyncEngine(core, max_queued_requests=max_queued_requests)
    engine.start()
    dead = threading.Event()
    try:
        settings = {"watchdog_interval_s": 0.05, **settings}
        with tiny_server(MODEL, settings, engine=engine, on_engine_dead=dead.set) as server:
            yield server, dead
    finally:
        engine.shutdown()


def expected_text(last_token: int, num_tokens: int, sample: int = 0) -> str:
    return "".join(f"<{(last_token + k + sample) % 320}>" for k in range(num_tokens))


def test_fake_engine_round_trip_and_streaming():
    core = FakeCore()
    with serve(core) as (bg, _), openai.OpenAI(
        base_url=f"{bg.url}/v1", api_key="x", max_retries=0
    ) as client:  # fmt: skip
        result = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=5, n=2)
        assert [c.text for c in result.choices] == [expected_text(4, 5, 0), expected_text(4, 5, 1)]
        chunks = list(
            client.completions.create(model=MODEL, prompt=[3, 9], max_tokens=4, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == expected_text(9, 4)


def test_queue_full_is_429_with_retry_after():
    core = FakeCore()
    core.hold = True
    body = {"model": MODEL, "prompt": [5], "max_tokens": 2}
    with serve(core, max_queued_requests=2) as (bg, _), httpx.Client(base_url=bg.url) as http:
        with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then the client gives up
            http.post("/v1/completions", json={**body, "n": 2}, timeout=0.3)
        deadline = time.monotonic() + 60
        while core.waiting:  # the disconnect removed it from the waiting queue (row 24)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(core.aborted) == 1
        # n counts as n slots: two queued samples fill a queue of two.
        blocker = threading.Thread(
            target=lambda: http.post("/v1/completions", json={**body, "n": 2}, timeout=5)
        )
        blocker.start()
        while not core.waiting:
            time.sleep(0.01)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        with openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt=[5], max_tokens=2)
        core.hold = False
        blocker.join(5)
        assert http.post("/v1/completions", json=body).status_code == 200


def test_one_failed_request_does_not_stop_the_others():
    core = FakeCore()
    with serve(core) as (bg, _), httpx.Client(base_url=bg.url, timeout=10) as http:
        ok_body = {"model": MODEL, "prompt": [2], "max_tokens": 30}
        neighbour: dict = {}
        thread = threading.Thread(
            target=lambda: neighbour.update(http.post("/v1/completions", json=ok_body).json())
        )
        thread.start()
        failed = http.post("/v1/completions", json={**ok_body, "prompt": [FAIL_TOKEN]})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error"
        streamed = http.post(
            "/v1/completions", json={**ok_body, "prompt": [FAIL_TOKEN], "stream": True}
        )
        assert streamed.status_code == 200
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        thread.join(10)
        assert neighbour["choices"][0]["text"] == expected_text(2, 30)
        assert http.get("/health").status_code == 200
        assert 'finished_reason="error"' in http.get("/metrics").text


def test_engine_crash_fails_waiters_and_turns_health_503():
    core = FakeCore(step_s=0.01)
    with serve(core) as (bg, dead), httpx.Client(base_url=bg.url, timeout=10) as http:
        body = {"model": MODEL, "prompt": [1], "max_tokens": 60, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            core.crash = RuntimeError("device lost")
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        # RELIABILITY.md's "within 5 s" is the watchdog's poll interval (asserted as such);
        # the wait only has to see the report, however busy the machine.
        assert ServerSettings(served_model_names=(MODEL,)).watchdog_interval_s <= 1.0
        assert dead.wait(60), "the watchdog did not report the dead engine"
        health = http.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        refused = http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503


def test_a_steps_outputs_wake_the_event_loop_once_in_order():
    """Six streams decode together: each step's outputs reach the event loop in one call
    (``call_soon_threadsafe`` wrote to the loop's wake-up pipe per output: 1.9 ms of the engine
    thread a step at 1,000 streams), and each stream still gets every token once, in order."""
    core = FakeCore(step_s=0.01)
    engine = AsyncEngine(core)
    engine.start()
    batches: list[int] = []

    async def scenario() -> dict[str, list[int]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if args and isinstance(args[0], list):
                batches.append(len(args[0]))
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        async def stream(name: str) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate([4, 5], SamplingParams(max_tokens=8), name):
                tokens.extend(out.outputs[0].token_ids)
            return tokens

        names = [f"s{i}" for i in range(6)]
        results = await asyncio.gather(*(stream(name) for name in names))
        return dict(zip(names, results, strict=True))

    try:
        tokens = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert all(t == list(range(5, 13)) for t in tokens.values()), tokens  # the fake's k-th: 5 + k
    assert sum(batches) >= 6 * 8 and max(batches) > 1  # several streams' outputs per call
    assert len(batches) < sum(batches)


def test_drain_finishes_short_requests_and_aborts_long_ones():
    core = FakeCore(step_s=0.01)
    engine = AsyncEngine(core)
    engine.start()

    async def scenario():
        state = ServerState(engine)
        results = {}

        async def run(name: str, max_tokens: int) -> None:
            request = EngineRequest(name, [4], SamplingParams(max_tokens=max_tokens, n=2))
            generation = Generation(engine, [request])
            state.begin(generation)
            await generation.start()
            reasons = {}
            async for _, delta in generation.deltas():
                for out in delta.outputs:
                    if out.finish_reason:
                        reasons[out.index] = out.finish_reason
            state.end(generation)
            results[name] = reasons

        tasks = [asyncio.create_task(run("short", 3)), asyncio.create_task(run("long", 60))]
        await asyncio.sleep(0.03)
        num_aborted = await state.drain(timeout_s=0.2)
        assert state.is_draining and not state.is_ready
        await asyncio.gather(*tasks)
        return num_aborted, results

    num_aborted, results = asyncio.run(scenario())
    assert num_aborted == 1
    assert results == {"short": {0: "length", 1: "length"}, "long": {0: "abort", 1: "abort"}}
    assert core.aborted == ["long"] and not core.running
    engine.shutdown()


def test_request_log_is_off_by_default_and_private_unless_asked(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.server.requests")
    secret = "my secret prompt"
    for settings, expect_line, expect_text in (
        ({}, False, False),
        ({"enable_log_requests": True}, True, False),
        ({"enable_log_requests": True, "log_prompts": True}, True, True),
    ):
        caplog.clear()
        core = FakeCore()
        with serve(core, **settings) as (bg, _):
            body = {"model": MODEL, "prompt": secret, "max_tokens": 2}
            assert httpx.post(f"{bg.url}/v1/completions", json=body).status_code == 200
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert ("finish_reason=length" in logged) == expect_line
        assert (secret in logged) == expect_text
        assert ("generation_tokens=2" in logged) == expect_line


def test_stats_line_only_while_busy(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.server.stats")
    core = FakeCore()
    engine = AsyncEngine(core)
    stats_logger = StatsLogger(engine)
    assert stats_logger.log() is None  # idle: nothing logged
    core.generation_tokens = 50
    core.running = [{"id": "x"}]
    line = stats_logger.log()
    assert line is not None and "Running: 1 reqs, Waiting: 0 reqs" in line
    assert "Avg generation throughput:" in line and "KV cache usage: 50.0%" in line
    assert "Prefix cache hit rate: 0.0%" in line
    assert [r.getMessage() for r in caplog.records] == [line]


def test_metrics_can_require_the_key():
    core = FakeCore()
    with serve(core, api_key="secret", metrics_require_key=True) as (bg, _):
        assert httpx.get(f"{bg.url}/metrics").status_code == 401
        assert httpx.get(f"{bg.url}/health").status_code == 200
        headers = {"Authorization": "Bearer secret"}
        assert httpx.get(f"{bg.url}/metrics", headers=headers).status_code == 200
        spec = httpx.get(f"{bg.url}/openapi.json", headers=headers).json()
        assert spec["security"] == [{"bearer": []}]
        assert spec["paths"]["/health"]["get"]["security"] == []
        assert "security" not in spec["paths"]["/metrics"]["get"]


def run_draining_server(core: FakeCore, shutdown_timeout_s: float):
    """``jaxserve launch``'s server wiring around a fake engine, in a thread."""
    engine = AsyncEngine(core)
    engine.start()
    holder: dict[str, DrainingServer] = {}
    app = build_app(
        engine,
        ServerSettings(served_model_names=(MODEL,), watchdog_interval_s=0.05),
        on_engine_dead=lambda: holder["server"].stop_on_engine_death(),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http="h11", log_config=None, lifespan="on")
    server = DrainingServer(config, app.state.ctx.state, shutdown_timeout_s)
    holder["server"] = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return engine, server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_draining_server_exits_when_the_engine_dies():
    core = FakeCore()
    engine, server, thread, _ = run_draining_server(core, shutdown_timeout_s=5)
    core.crash = RuntimeError("device lost")
    thread.join(10)
    assert not thread.is_alive() and server.engine_died  # launch then exits 1
    engine.shutdown()


def test_draining_server_signal_drains_then_stops():
    core = FakeCore(step_s=0.01)
    engine, server, thread, url = run_draining_server(core, shutdown_timeout_s=0.2)
    body = {"model": MODEL, "prompt": [3], "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.handle_exit(signal.SIGTERM, None)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    thread.join(10)
    assert not thread.is_alive() and not server.engine_died
    assert server.state.is_draining and core.aborted
    engine.shutdown()
