"""Slow clients, rate limits, a burst past capacity and an engine crash, against real servers.

RELIABILITY.md row 25 (slowloris body -> 408; a client that stops reading has its request
aborted after ``send_timeout_s``), the per-client rate limits (``ratelimit.py``), scenario 7
(a burst at 10x capacity: 429 with Retry-After past ``max_queued_requests``) and scenario 6
(an engine exception: every waiter fails, ``/health`` 503, exit status 1).

One real engine on the tiny Llama fixture serves several apps (each with its own settings) on
loopback ports; the crash runs ``jaxserve launch`` in a subprocess whose step loop raises on cue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import select
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve.cli import build_parser
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.guard.ratelimit import RateLimiter, TokenBucket
from jaxserve.server.launch.flags import settings_from_args
from jaxserve.server.settings import ServerSettings
from tests.conftest import (
    free_port,
    metric,
    pace_steps,
    paced_launch_command,
    tiny_engine_config,
    tiny_server,
    wait_for,
    wait_idle,
)

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
MODEL = "tiny"
MAX_SEQS = 4
MAX_QUEUED = 8  # capacity: MAX_SEQS running + MAX_QUEUED waiting
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def engine():
    config = tiny_engine_config(
        MODEL,
        max_model_len=256,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=NUM_BLOCKS,
    )
    engine = AsyncEngine.from_config(config, max_queued_requests=MAX_QUEUED)
    # Steps of at least 5 ms: the slow reader's 240-token request must still be generating
    # when its writes time out, however fast the device.
    pace_steps(engine.core, 0.005)
    engine.start()
    yield engine
    engine.shutdown()


def completion(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "prompt": "the river", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}  # fmt: skip


# -- row 25: slow body, slow reader ---------------------------------------------------------


def raw_request(port: int, head: bytes, pieces: list[bytes], pause_s: float) -> bytes:
    """Send ``head`` then each piece ``pause_s`` apart, stopping once the server answers;
    return everything the server sent until it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for piece in pieces:
            if select.select([sock], [], [], pause_s)[0]:
                break  # answered (or closed) before the body was complete
            sock.sendall(piece)
        reply = b""
        try:
            while data := sock.recv(65536):
                reply += data
        except ConnectionResetError:
            pass
        return reply


def post_head(framing: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + framing
        + b"\r\n\r\n"
    )


def test_slow_body_gets_408_and_a_prompt_one_is_served(engine):
    body = json.dumps(completion()).encode()
    with tiny_server(MODEL, {"request_body_timeout_s": 0.5}, engine=engine) as bg:
        # Declared length, half sent, then silence.
        start = time.monotonic()
        reply = raw_request(
            bg.port, post_head(b"Content-Length: %d" % len(body)), [body[:10]], pause_s=0.0
        )
        assert reply.startswith(b"HTTP/1.1 408"), reply
        # Not before the deadline (no machine's slowness makes it early); not stuck past it
        # either, or the socket's own timeout ends raw_request first.
        assert time.monotonic() - start >= 0.5
        assert b"connection: close" in reply.lower()
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and "0.5 seconds" in error["message"]
        # Slowloris: a byte every 0.1 s keeps the connection busy, yet the deadline holds.
        trickle = [b"1\r\n%c\r\n" % c for c in body]
        reply = raw_request(bg.port, post_head(b"Transfer-Encoding: chunked"), trickle, 0.1)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        # A body in two pieces inside the deadline is served.
        reply = raw_request(
            bg.port,
            post_head(b"Content-Length: %d\r\nConnection: close" % len(body)),
            [body[:10], body[10:]],
            pause_s=0.1,
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert httpx.get(f"{bg.url}/health").status_code == 200
    wait_idle(engine)


def test_help_documents_the_new_flags(capsys):
    argv = ["launch", "--help"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--request-body-timeout", "--send-timeout"):
        assert re.search(rf"{flag} [A-Z_]+ [^()]+ \(default: 30\.0\)", text), flag
    assert "--rate-limit-rpm" in text and "--rate-limit-tpm" in text
    argv = ["launch", "--request-body-timeout", "5", "--send-timeout", "7",
            "--rate-limit-rpm", "60", "--rate-limit-tpm", "10k"]  # fmt: skip
    settings = settings_from_args(build_parser(argv).parse_args(argv), "m")
    assert settings.request_body_timeout_s == 5.0 and settings.send_timeout_s == 7.0
    assert settings.rate_limit_rpm == 60 and settings.rate_limit_tpm == 10_000


def test_slow_reader_is_cut_off_and_its_request_aborted(engine, caplog):
    num_aborted = engine.core.stats.num_aborted
    # About 1.5 MB of events (20 top logprobs each, 8 samples) and small socket buffers on both
    # ends (64 KiB: smaller ones make loopback TCP crawl), so the server's writes block as soon
    # as the client stops reading.
    body = completion(max_tokens=240, n=8, logprobs=20, stream=True, temperature=1.0)
    request = json.dumps(body).encode()
    with tiny_server(MODEL, {"send_timeout_s": 0.5}, engine=engine) as bg:
        bg.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # inherited on accept
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", bg.port))
        sock.sendall(post_head(b"Content-Length: %d" % len(request)) + request)
        # The client reads nothing; the response is ended and the request aborted.
        wait_for(lambda: engine.core.stats.num_aborted > num_aborted, 10, "the abort")
        wait_idle(engine)
        sock.settimeout(10)
        received = b""
        while data := sock.recv(65536):  # what was buffered, then the server's close
            received += data
        sock.close()
        assert received.startswith(b"HTTP/1.1 200")
        assert b"data: [DONE]" not in received  # cut, not finished
        # What the server still held for it: the kernel buffers plus uvicorn's 64 KiB.
        assert len(received) < 512 * 1024
        # One warning from the server; a deliberate cut is no error of uvicorn's.
        assert "read nothing for 0.5s; ending the response" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        # A client that keeps reading is not cut, though the stream lasts longer than the
        # timeout: the timeout is per write, not per response.
        steady = completion(max_tokens=150, logprobs=20, stream=True)
        start = time.monotonic()
        with httpx.stream("POST", f"{bg.url}/v1/completions", json=steady, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start > 0.5
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert engine.core.stats.num_aborted == num_aborted + 1


# -- rate limits ----------------------------------------------------------------------------


def test_token_bucket_refills_and_forgets_the_oldest_client():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0], max_clients=2)
    assert [bucket.spend("a", 1) for _ in range(60)] == [0.0] * 60
    assert bucket.spend("a", 1) == pytest.approx(1.0)  # 1 per second refill
    now[0] = 0.5
    assert bucket.spend("a", 1) == pytest.approx(0.5)
    now[0] = 1.0
    assert bucket.spend("a", 1) == 0.0
    assert bucket.spend("a", 61) == float("inf")  # more than a minute's allowance
    bucket.spend("b", 1)
    bucket.spend("c", 1)
    assert list(bucket.buckets) == ["b", "c"]  # "a" was least recently used
    assert bucket.spend("a", 60) == 0.0  # forgotten: a full bucket again
    assert RateLimiter.from_settings(ServerSettings(served_model_names=("m",))) is None
    for bad in ({"rate_limit_rpm": 0}, {"rate_limit_tpm": -5}, {"request_body_timeout_s": 0},
                {"send_timeout_s": -1.0}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerSettings(served_model_names=("m",), **bad)


def test_requests_per_minute_per_key(engine):
    with tiny_server(MODEL, {"api_key": "k1", "rate_limit_rpm": 3}, engine=engine) as bg:
        headers = {"Authorization": "Bearer k1"}
        with httpx.Client(base_url=bg.url, headers=headers, timeout=30) as http:
            for _ in range(3):
                assert http.post("/v1/completions", json=completion()).status_code == 200
            refused = http.post("/v1/completions", json=completion())
            assert refused.status_code == 429
            assert 1 <= int(refused.headers["retry-after"]) <= 20  # 3/min: one every 20 s
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
            assert "3 requests per minute" in error["message"]
            assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200  # not limited
        # The key is the client: another address with the same key shares its allowance.
        elsewhere = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=bg.url, headers=headers, transport=elsewhere) as http:
            assert http.post("/v1/completions", json=completion()).status_code == 429
        assert metric(bg.url, "jaxserve:rate_limited_requests_total", 'reason="requests"') == 2
        with openai.OpenAI(base_url=f"{bg.url}/v1", api_key="k1", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
    wait_idle(engine)


def test_tokens_per_minute_per_address(engine):
    with tiny_server(MODEL, {"rate_limit_tpm": 100}, engine=engine) as bg:
        num_prompt = httpx.post(f"{bg.url}/tokenize", json={"prompt": "the river"}).json()["count"]
        cost = num_prompt + 2 * 20  # n=2 reserves max_tokens twice
        local = httpx.Client(base_url=bg.url, timeout=30)
        other = httpx.Client(  # another client address on the loopback network
            base_url=bg.url, timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2")
        )
        with local, other:
            spent = 0
            while spent + cost <= 100:
                assert local.post("/v1/completions", json=completion(20, n=2)).status_code == 200
                spent += cost
            refused = local.post("/v1/completions", json=completion(20, n=2))
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert f"needs {cost})" in refused.json()["error"]["message"]
            too_big = local.post("/v1/completions", json=completion(200))
            assert too_big.status_code == 429 and "Request too large" in too_big.text
            # Another address has its own allowance.
            assert other.post("/v1/completions", json=completion(20, n=2)).status_code == 200
            assert metric(bg.url, "jaxserve:rate_limited_requests_total", 'reason="tokens"') == 2
    wait_idle(engine)


# -- scenario 7: a burst at 10x capacity ----------------------------------------------------


async def burst(url: str, count: int) -> list[tuple[int, dict, float | None]]:
    """``count`` concurrent streams: (status, headers or the finish, time to first token);
    the finish's ``seconds``: the request's end-to-end time."""

    async def one(http: httpx.AsyncClient) -> tuple[int, dict, float | None]:
        start = time.monotonic()
        body = completion(16, stream=True, stream_options={"include_usage": True})
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, {**response.headers, **response.json()}, None
            ttft, out = None, {}
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    ttft = ttft or time.monotonic() - start
                    event = json.loads(line[len("data: ") :])
                    for choice in event["choices"]:
                        out["finish"] = choice["finish_reason"] or out.get("finish")
                    out["usage"] = event.get("usage") or out.get("usage")
            out["seconds"] = time.monotonic() - start
            return 200, out, ttft

    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        return await asyncio.gather(*(one(http) for _ in range(count)))


def test_burst_past_capacity_gets_429_and_admitted_requests_finish(engine):
    capacity = MAX_SEQS + MAX_QUEUED
    most_waiting = 0
    watching = threading.Event()
    watching.set()

    def watch_queue() -> None:
        nonlocal most_waiting
        while watching.is_set():
            most_waiting = max(most_waiting, engine.core.num_waiting())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch_queue)
    watcher.start()
    with tiny_server(MODEL, engine=engine) as bg:
        try:
            results = asyncio.run(burst(bg.url, 10 * capacity))
        finally:
            watching.clear()
            watcher.join()
        admitted = [(out, ttft) for status, out, ttft in results if status == 200]
        refused = [out for status, out, _ in results if status == 429]
        assert len(admitted) + len(refused) == len(results)
        # Every queue slot is used; how many more got in depends on how fast the engine thread
        # moved requests from the queue to running while the burst arrived (up to MAX_SEQS).
        assert MAX_QUEUED <= len(admitted) <= capacity + MAX_SEQS
        assert len(refused) >= len(results) // 2
        for out in refused:
            assert out["retry-after"] == "1" and out["error"]["code"] == "rate_limit_exceeded"
        for out, _ in admitted:
            assert out["finish"] == "length" and out["usage"]["completion_tokens"] == 16
        assert most_waiting <= MAX_QUEUED
        # An admitted request waits behind at most a full queue: its first token comes before
        # twice the median admitted request's whole time, in the same burst (measured: 1.0-1.1
        # times, beside a CPU hog or not; "< 3 s" was a shared machine's clock). A request
        # left waiting until the others finished would be past it.
        last_ttft = max(ttft for _, ttft in admitted)
        e2e = sorted(out["seconds"] for out, _ in admitted)
        assert last_ttft < 2 * e2e[len(e2e) // 2], (last_ttft, e2e)
        assert metric(bg.url, "jaxserve:rate_limited_requests_total", 'reason="queue_full"') == (
            len(refused)
        )
    wait_idle(engine)


# -- scenario 6: an engine exception in a launched server -----------------------------------


def read_events(url: str, body: dict, out: dict, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            out["status"] = response.status_code
            out["events"] = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[len("data: ") :])
                    started.set()
    except Exception as exc:
        out["error"] = repr(exc)
    finally:
        started.set()


def post(url: str, body: dict, out: dict) -> None:
    try:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        out["status"], out["body"] = response.status_code, response.json()
    except Exception as exc:
        out["error"] = repr(exc)


def test_engine_exception_fails_every_waiter_and_exits_nonzero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    crash_file = tmp_path / "crash"
    log_path = tmp_path / "server.log"
    # The step loop raises once `crash_file` exists; steps of at least 50 ms keep the 240-token
    # streams running (12 s at least) until then, on any device and however long the
    # requests below take to reach the engine on a busy machine.
    launch, env = paced_launch_command(0.05, crash_file=crash_file)
    command = [
        *launch, str(FIXTURE), "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", MODEL, "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", str(MAX_SEQS),
        "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", str(NUM_BLOCKS),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: process.poll() is not None or health(url) == 200, 180, "start-up")
        assert process.poll() is None, log_path.read_text()
        # Three long streams start first and run together (MAX_SEQS = 4); of the three plain
        # requests that follow, one runs and two wait in the queue.
        streams = [({}, threading.Event()) for _ in range(3)]
        threads = [
            threading.Thread(
                target=read_events, args=(url, completion(240, stream=True), out, started)
            )
            for out, started in streams
        ]
        for thread in threads:
            thread.start()
        for _, started in streams:
            assert started.wait(30)
        posts = [{} for _ in range(3)]
        threads += [threading.Thread(target=post, args=(url, completion(240), o)) for o in posts]
        for thread in threads[3:]:
            thread.start()
        wait_for(lambda: engine_load(url) >= 6, 30, "the plain requests to reach the engine")
        crash_file.touch()
        # "/health 503 within 5 s" is the watchdog's poll interval (test_server_faults checks
        # it); the wait here only has to see it, however busy the machine.
        wait_for(lambda: health(url) != 200, 60, "/health to stop answering 200")
        assert health(url) in (503, None)  # 503 while the server stops, then the port closes
        assert process.wait(timeout=30) == 1
        for thread in threads:
            thread.join(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    for out, _ in streams:  # a stream ends with an error event, then [DONE]
        assert out["status"] == 200 and "error" not in out, out
        assert json.loads(out["events"][-2])["error"]["type"] == "server_error", out["events"][-2]
        assert out["events"][-1] == "[DONE]"
    for out in posts:  # 500 for a running request, 503 for one that never started
        assert out.get("status") in (500, 503), out
        assert out["body"]["error"]["type"] == "server_error"
    assert 503 in [out["status"] for out in posts]
    log = log_path.read_text()
    assert "injected device failure" in log and "Exiting with status 1" in log


def engine_load(url: str) -> float:
    """Requests running or waiting, from /metrics."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith(("jaxserve:num_requests_running{", "jaxserve:num_requests_waiting{"))
    )


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code
    except httpx.TransportError:
        return None
