"""Load and fault scenarios 1-5 of RELIABILITY.md, and determinism, against real servers.

Two servers for the module, each started once:
- ``launched``: ``jaxserve launch`` in a subprocess on the tiny Llama fixture, so the load
  clients, the ``/health`` probe and the server do not share a GIL, its RSS can be read, and
  SIGTERM ends it for real (scenarios 1, 4, 5; the SIGTERM test runs last and stops it);
- ``tiny_pool``: an in-process engine with a KV pool far too small for its batch, so the test
  can watch block ref counts (scenarios 2, 3, and determinism over HTTP).

Scale: 200 concurrent clients by default; ``JAXSERVE_RELIABILITY_SCALE=full`` runs 1,000.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.sampling_params import MAX_N
from tests.conftest import (
    free_port,
    metric,
    paced_launch_command,
    start_server,
    tiny_server,
    wait_for,
    wait_idle,
)

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
MODEL = "tiny"
IS_FULL_SCALE = os.environ.get("JAXSERVE_RELIABILITY_SCALE", "") == "full"
NUM_CLIENTS = 1000 if IS_FULL_SCALE else 200
BODY_LIMIT = 2 * 1024 * 1024  # the default --max-request-body-bytes
# Counted in paced steps of at least MIN_STEP_S, so no machine's speed decides who finishes in
# the SIGTERM test's drain: its 240-token streams need 2 waves x 240 steps (4.8 s at least),
# more than the drain; its 6-token ones fit unless a step takes 0.3 s.
MIN_STEP_S = 0.01
SHUTDOWN_TIMEOUT_S = 2.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("launch") / "server.log"
    # Paced steps (the CPU takes longer anyway): on a fast GPU the SIGTERM test's 240-token
    # streams would otherwise all finish within the drain, and none be aborted.
    launch, env = paced_launch_command(MIN_STEP_S)
    command = [
        *launch, str(FIXTURE),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
        "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "512",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, env, log_path, url)
    try:
        yield SimpleNamespace(url=url, port=port, process=process, log_path=log_path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


# -- scenario 1: many concurrent streams, 30% disconnecting --------------------------------

# Runs in its own process: GETs /health every 5 ms until a line arrives on stdin, then prints
# the latencies.
HEALTH_PROBE = """
import select, socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
request = b"GET /health HTTP/1.1\\r\\nHost: probe\\r\\n\\r\\n"
latencies = []
while not select.select([sys.stdin], [], [], 0.005)[0]:
    start = time.perf_counter()
    sock.sendall(request)
    reply = b""
    while b"\\r\\n\\r\\n" not in reply:
        reply += sock.recv(4096)
    latencies.append(time.perf_counter() - start)
    assert reply.startswith(b"HTTP/1.1 200"), reply
print(" ".join(f"{x:.6f}" for x in latencies))
"""


async def stream_client(http: httpx.AsyncClient, i: int, cut_after: int, out: dict) -> None:
    """One streaming completion; with ``cut_after`` > 0, close the connection after that many
    chunks of a request far longer than that (so the engine is still running it)."""
    body = {
        "model": MODEL,
        "prompt": f"client {i} asks about the river",
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "max_tokens": 200 if cut_after else 16,
        "stream_options": {"include_usage": True},
    }
    num_chunks = 0
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        out["status"] = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                if event["choices"]:
                    num_chunks += 1
                    out["finish"] = event["choices"][0]["finish_reason"] or out.get("finish")
                if event.get("usage"):
                    out["usage"] = event["usage"]
                if cut_after and num_chunks >= cut_after:
                    return  # leaving the block closes the connection
    out["seconds"] = time.perf_counter() - start


async def run_clients(url: str, cuts: dict[int, int]) -> list[dict]:
    results: list[dict] = [{} for _ in range(NUM_CLIENTS)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(
            *(stream_client(http, i, cuts.get(i, 0), results[i]) for i in range(NUM_CLIENTS))
        )
    return results


@pytest.mark.slow
def test_concurrent_streams_with_random_disconnects(launched):
    url = launched.url
    rng = random.Random(1)
    cuts = {i: rng.randint(1, 4) for i in rng.sample(range(NUM_CLIENTS), NUM_CLIENTS * 3 // 10)}
    aborted_before = metric(url, "jaxserve:num_aborted_requests_total")
    probe = subprocess.Popen(
        [sys.executable, "-c", HEALTH_PROBE, str(launched.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        results = asyncio.run(run_clients(url, cuts))
    finally:
        out, _ = probe.communicate("stop\n", timeout=30)
    assert probe.returncode == 0
    latencies = sorted(float(x) for x in out.split())
    survivors = [r for i, r in enumerate(results) if i not in cuts]
    assert all(r["status"] == 200 for r in results), {r.get("status") for r in results}
    for r in survivors:
        assert r.get("done") and r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == 16
    # Every client that left had its request aborted in the engine, and no other request was.
    wait_for(
        lambda: metric(url, "jaxserve:num_aborted_requests_total") - aborted_before >= len(cuts),
        30,  # (10 s ran out by 27 ms once on a loaded CI machine with a cold compile cache)
        "the aborts",
    )
    assert metric(url, "jaxserve:num_aborted_requests_total") - aborted_before == len(cuts)
    wait_for(lambda: metric(url, "jaxserve:kv_cache_usage_perc") == 0.0, 10, "KV usage 0")
    assert metric(url, "jaxserve:num_requests_running") == 0
    assert len(latencies) >= 40  # the load lasts seconds on the CI machine
    # NOTE: RELIABILITY.md's "/health p99 < 100 ms" is for a machine of the server's own; on a
    # shared one every latency stretches with its load (p99 108 ms on two busy cores). Both
    # sides here are measured in this run and stretch alike: /health must not wait for the
    # engine or the requests (which made its latency that of a request), so its p99 stays a
    # small part of the median client's time. Measured: 1.2-1.4%, a CPU hog beside it or not.
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    e2e_p50 = sorted(r["seconds"] for r in survivors)[len(survivors) // 2]
    assert p99 < 0.2 * e2e_p50, f"/health p99 {p99:.3f} s, a request's median {e2e_p50:.3f} s"


# -- scenario 4: a 100 MB body, declared and chunked ----------------------------------------


def upload(port: int, total: int, chunked: bool) -> tuple[bytes, int]:
    """POST up to ``total`` body bytes as fast as the server takes them; stop at its answer.

    Returns the response head and how many body bytes had been sent when it arrived.
    """
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % total
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + framing
        + b"\r\n\r\n"
    )
    piece = b"a" * 65536
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(head)
        sock.setblocking(False)
        num_sent, pending, reply = 0, b"", b""
        deadline = time.monotonic() + 60
        while num_sent < total and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                pending = pending or frame
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    break
                pending = pending[n:]
                num_sent += n
        sock.setblocking(True)
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in reply:
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except ConnectionResetError:
            pass
        return reply.split(b"\r\n\r\n")[0], num_sent
    finally:
        sock.close()


def test_huge_body_is_refused_after_at_most_the_limit(launched):
    url = launched.url
    body = {"model": MODEL, "prompt": "warm", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    rss_before = rss_bytes(launched.process.pid)
    other: dict = {}
    neighbour = threading.Thread(
        target=lambda: other.update(
            r=httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 32}, timeout=60)
        )
    )
    neighbour.start()
    total = 100 * 1024 * 1024
    declared, declared_sent = upload(launched.port, total, chunked=False)
    chunked, chunked_sent = upload(launched.port, total, chunked=True)
    neighbour.join(60)
    for head in (declared, chunked):
        assert head.startswith(b"HTTP/1.1 413"), head
        assert b"connection: close" in head.lower()
    # What the client got into the socket: what the server read (at most the limit) plus what
    # the two kernels buffered; nowhere near the 100 MB on offer.
    slack = 16 * 1024 * 1024
    assert declared_sent < slack
    assert chunked_sent < BODY_LIMIT + slack
    assert rss_bytes(launched.process.pid) - rss_before < 32 * 1024 * 1024
    assert other["r"].status_code == 200  # a neighbour is unaffected
    assert httpx.get(f"{url}/health").status_code == 200


# -- scenario 5: SIGTERM during many streams (runs last: it stops the server) ---------------


def read_stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    out["finish"], out["done"] = {}, False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    started.set()
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        if choice["finish_reason"]:
                            out["finish"][choice["index"]] = choice["finish_reason"]
    except Exception as exc:  # reported by the test, not lost in the thread
        out["error"] = repr(exc)
    finally:
        started.set()


def num_in_engine(url: str) -> float:
    """Requests the engine has seen: running, waiting or finished (by any reason)."""
    names = ("num_requests_running{", "num_requests_waiting{", "request_success_total{")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        if line.startswith(tuple(f"jaxserve:{name}" for name in names))
    )


@pytest.mark.slow
def test_sigterm_during_many_streams_drains(launched):
    """test_server_launch.py drains two streams; this one drains NUM_CLIENTS // 2 at once."""
    url = launched.url
    num_streams = NUM_CLIENTS // 2
    outs = [{} for _ in range(num_streams)]
    started = [threading.Event() for _ in range(num_streams)]
    num_before = num_in_engine(url)
    threads = []
    for i in range(num_streams):
        body = {
            "model": MODEL,
            "prompt": f"stream {i}",
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "max_tokens": 240 if i % 2 else 6,
        }
        thread = threading.Thread(target=read_stream, args=(url, body, outs[i], started[i]))
        thread.start()
        threads.append(thread)
    wait_for(lambda: num_in_engine(url) - num_before >= num_streams, 30, "every stream to start")
    launched.process.send_signal(signal.SIGTERM)
    # Not a sleep: on a busy machine the signal may be handled later than any fixed wait.
    wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 30, "the drain")
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and health.headers["retry-after"]
    refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=5)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert launched.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30) == 0
    for thread in threads:
        thread.join(30)
    reasons = [out["finish"].get(0) for out in outs]
    for out in outs:
        assert "error" not in out, out
        assert out["status"] == 200 and out["done"], out
        assert out["finish"][0] in ("length", "abort"), out
    assert "length" in reasons and "abort" in reasons
    log = launched.log_path.read_text()
    assert "Traceback" not in log, log[-4000:]


# -- scenarios 2 and 3, and determinism: a KV pool far too small for the batch --------------

TINY_BLOCKS = 24  # x 16 tokens: 384 slots for MAX_SEQS sequences of up to 256 tokens
MAX_SEQS = 16


@pytest.fixture(scope="module")
def tiny_pool():
    with tiny_server(
        MODEL,
        max_model_len=256,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=TINY_BLOCKS,
    ) as server:
        yield server


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))


def texts(responses: list[httpx.Response]) -> list[str]:
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in responses]


def divergences(expected: list[httpx.Response], actual: list[httpx.Response]) -> list[str]:
    """Where each pair of greedy completions (requested with ``logprobs``: 2) first differs,
    with the expected run's margin between its top two tokens there."""
    found = []
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        la, lb = a.json()["choices"][0]["logprobs"], b.json()["choices"][0]["logprobs"]
        for t, (ta, tb) in enumerate(zip(la["tokens"], lb["tokens"], strict=False)):  # any length
            if ta != tb:
                top = sorted(la["top_logprobs"][t].values(), reverse=True)
                margin = top[0] - top[1] if len(top) > 1 else float("inf")
                found.append(f"request {i} token {t}: {ta!r} vs {tb!r}, top-2 margin {margin:.2e}")
                break
    return found


@pytest.mark.slow
def test_cache_exhaustion_preempts_and_keeps_greedy_output(tiny_pool):
    rng = random.Random(2)
    num_requests = 2 * MAX_SEQS if IS_FULL_SCALE else MAX_SEQS
    bodies = [
        {
            "model": MODEL,
            "prompt": [rng.randrange(5, 300) for _ in range(rng.randint(8, 24))],
            "max_tokens": 96,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,  # a mismatch reports how close the top two tokens were
        }
        for _ in range(num_requests)
    ]
    # Unpressured: one at a time, each fits the pool alone.
    alone = [asyncio.run(post_all(tiny_pool.url, [b]))[0] for b in bodies]
    preemptions_before = metric(tiny_pool.url, "jaxserve:num_preemptions_total")
    pressured = asyncio.run(post_all(tiny_pool.url, bodies))
    assert metric(tiny_pool.url, "jaxserve:num_preemptions_total") > preemptions_before
    # Every request finished and its greedy output is unchanged.
    assert texts(pressured) == texts(alone), divergences(alone, pressured)
    wait_idle(tiny_pool.engine)


def test_n64_shares_prompt_blocks_and_n_above_cap_is_400(tiny_pool):
    pool = tiny_pool.engine.core.kv.pool
    prompt = list(range(10, 90))  # 80 tokens: 5 blocks; 64 unshared copies would need 320+
    most_refs = 0
    running = threading.Event()
    running.set()

    def watch_refs() -> None:
        nonlocal most_refs
        while running.is_set():
            most_refs = max(most_refs, max(pool.ref_counts))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch_refs)
    watcher.start()
    body = {"model": MODEL, "prompt": prompt, "n": 64, "max_tokens": 4, "temperature": 1.0}
    try:
        response = httpx.post(f"{tiny_pool.url}/v1/completions", json=body, timeout=120)
    finally:
        running.clear()
        watcher.join()
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(64))
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)
    assert most_refs >= MAX_SEQS  # a prompt block held by a batch of samples (copy-on-write)
    too_many = httpx.post(f"{tiny_pool.url}/v1/completions", json={**body, "n": MAX_N + 1})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "n"
    wait_idle(tiny_pool.engine)


def seeded(prompt: str, seed: int) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": seed,
        "logprobs": 3,
        "ignore_eos": True,
    }


def tokens_and_logprobs(response: httpx.Response) -> tuple[list[str], list[float]]:
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def test_same_seed_and_cache_state_over_http_is_bitwise_identical(tiny_pool):
    body = seeded("the river and the stone", 42)
    first = tokens_and_logprobs(httpx.post(f"{tiny_pool.url}/v1/completions", json=body))
    second = tokens_and_logprobs(httpx.post(f"{tiny_pool.url}/v1/completions", json=body))
    assert first == second  # tokens and logprobs, bit for bit, on an idle server
    other = tokens_and_logprobs(
        httpx.post(f"{tiny_pool.url}/v1/completions", json={**body, "seed": 43})
    )
    assert other[0] != first[0]
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the river and the stone"}],
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 42,
        "logprobs": True,
        "top_logprobs": 2,
    }

    def reply(cache_salt: str) -> tuple[dict, int]:
        response = httpx.post(
            f"{tiny_pool.url}/v1/chat/completions", json={**chat, "cache_salt": cache_salt}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        return body["choices"][0], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    # The chat prompt (30 tokens) fills a KV block, so a plain repeat reuses it from the prefix
    # cache and computes fewer prompt tokens: another step shape. Own salts: two misses.
    (miss, cached), (other_miss, other_cached) = reply("replay-1"), reply("replay-2")
    assert cached == other_cached == 0
    assert miss == other_miss
    (hit, cached), (other_hit, other_cached) = reply("replay-1"), reply("replay-1")
    assert cached == other_cached > 0
    assert hit == other_hit
    # A hit against a miss: promised only up to rounding (on an H200 logprobs moved by 7e-7).
    hit_logprobs, miss_logprobs = hit["logprobs"]["content"], miss["logprobs"]["content"]
    assert [t["token"] for t in hit_logprobs] == [t["token"] for t in miss_logprobs]
    pairs = zip(hit_logprobs, miss_logprobs, strict=True)
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in pairs) < 1e-4


def test_same_seed_alone_and_in_a_concurrent_batch(tiny_pool):
    prompts = [f"the {w} said" for w in ("quokka", "maple", "orbit", "delta", "lamp", "cloud")]
    bodies = [seeded(p, 100 + i) for i, p in enumerate(prompts)]
    alone = [
        tokens_and_logprobs(httpx.post(f"{tiny_pool.url}/v1/completions", json=b)) for b in bodies
    ]
    batch = [tokens_and_logprobs(r) for r in asyncio.run(post_all(tiny_pool.url, bodies))]
    for (alone_tokens, alone_lp), (batch_tokens, batch_lp) in zip(alone, batch, strict=True):
        assert batch_tokens == alone_tokens
        # Not promised bit for bit: other batch shapes may round the last float bits apart.
        assert max(abs(a - b) for a, b in zip(alone_lp, batch_lp, strict=True)) < 1e-4
    wait_idle(tiny_pool.engine)


def test_seeded_output_independent_of_batchmates_for_one_shape():
    """With every step's shape fixed (prompts of one length, all added at once), a seeded
    request's tokens and logprobs are bitwise the same whatever its batchmates and slot."""
    llm = jaxserve.LLM(
        str(FIXTURE), dtype="float32", max_model_len=64, max_num_seqs=4,
        max_num_batched_tokens=32, num_gpu_blocks_override=32, enable_prefix_caching=False,
    )  # fmt: skip
    rng = random.Random(3)
    target = {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(6)]}
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=2, ignore_eos=True)

    def mates() -> list[tuple[dict, SamplingParams]]:
        kinds = [
            {"temperature": 0.0},
            {"temperature": 1.2, "top_k": 5, "seed": rng.randrange(1000)},
            {"temperature": 0.7, "top_p": 0.5, "min_p": 0.1},
        ]
        return [
            (
                {"prompt_token_ids": [rng.randrange(5, 300) for _ in range(6)]},
                SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, **kind),
            )
            for kind in kinds
        ]

    def run(slot: int) -> tuple[list[int], list[float]]:
        batch = mates()
        batch.insert(slot, (target, params))
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
        out = outputs[slot].outputs[0]
        chosen = zip(out.token_ids, out.logprobs, strict=True)
        return out.token_ids, [entry[token].logprob for token, entry in chosen]

    first = run(0)
    for slot in (0, 1, 3):
        assert run(slot) == first
