"""Hostile input, round two, against the HTTP server: no request may hold, starve or flood it.

Each section is one finding of an attacker's run against ``jaxserve launch`` with the demo model:
- 2: a 10 KB request for 32,768 sequences;
- 3: a 5 KB request for a 65 MB response;
- 4: heavy host work (900,000 ``stop_token_ids``, huge ``/detokenize`` bodies) that held
  the event loop;
- 6: integers too long to convert, and ``logit_bias`` keys ``int()`` refuses, answered 500;
- 7: a ``top_p`` so small it underflowed float32 to "no top_p".

One real engine on the tiny Llama fixture and real servers on loopback ports (the default
limits, or small ones to test a limit without running a large request); after every case the
server must still be healthy and serve a normal request.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cli import build_parser
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.runner.sampling import apply_top_k_top_p
from jaxserve.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams, SamplingParamsError
from jaxserve.server.api.errors import APIError
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.launch.flags import settings_from_args
from jaxserve.server.settings import ServerSettings
from tests.conftest import assert_bad_request, tiny_engine_config, tiny_server

MODEL = "tiny"
VOCAB = 320
MAX_MODEL_LEN = 2048  # room for a 1,000-token prompt
NUM_BLOCKS = 160  # a whole 2,048-token context fits
PROMPT = "the river"
LONG = "1" * 5000  # past Python's 4,300-digit limit on int("...")
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine():
    config = tiny_engine_config(
        MODEL,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=NUM_BLOCKS,
    )
    with pytest.MonkeyPatch.context() as env:  # past the fixture's 256 positions, on purpose
        env.setenv("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
        engine = AsyncEngine.from_config(config)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with tiny_server(MODEL, engine=engine) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    # The client lets an idle connection go after 1 s, before the server's keep-alive (uvicorn's
    # 5 s, httpx's own default too) closes it: a request sent on a connection the server was
    # closing at that moment read "Connection reset by peer" once, after the heavy requests
    # below kept this client idle for about 5 s.
    limits = httpx.Limits(keepalive_expiry=1.0)
    with httpx.Client(base_url=server.url, timeout=60, limits=limits) as c:
        yield c


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}


def post_raw(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers=JSON)


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=completion(max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# -- finding 2: sequences and tokens per request ---------------------------------------------


def test_256_prompts_with_n_128_are_refused_before_anything_runs(http, server) -> None:
    body = completion(prompt=[PROMPT] * 256, n=128, max_tokens=8, temperature=1.0)
    before = server.engine.core.stats.prompt_tokens
    r = http.post("/v1/completions", json=body, timeout=60)
    message = assert_bad_request(r, "n", "32768", "256", "--max-seqs-per-request")
    assert "n=128" in message
    assert server.engine.core.stats.prompt_tokens == before  # nothing reached the engine
    assert_still_serving(http)


def test_sequences_per_request_count_prompts_n_and_best_of(engine) -> None:
    with (
        tiny_server(MODEL, {"max_seqs_per_request": 8}, engine=engine) as background,
        httpx.Client(base_url=background.url, timeout=60) as http,
    ):
        ok = http.post("/v1/completions", json=completion(prompt=[PROMPT] * 2, n=4))
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8, ok.text
        r = http.post("/v1/completions", json=completion(prompt=[PROMPT] * 3, n=3))
        assert_bad_request(r, "n", "9 sequences", "at most 8", "--max-seqs-per-request")
        r = http.post("/v1/completions", json=completion(prompt=[PROMPT] * 3, best_of=3))
        assert_bad_request(r, "best_of", "best_of=3", "--max-seqs-per-request")
        r = http.post("/v1/completions", json=completion(prompt=[PROMPT] * 9))
        assert_bad_request(r, "prompt", "9 sequences", "--max-seqs-per-request")
        r = http.post("/v1/chat/completions", json=chat(n=9, max_tokens=2))
        assert_bad_request(r, "n", "--max-seqs-per-request")
        assert_still_serving(http)


def test_tokens_per_request_count_n_times_the_resolved_max_tokens(engine) -> None:
    with (
        tiny_server(MODEL, {"max_tokens_per_request": 64}, engine=engine) as background,
        httpx.Client(base_url=background.url, timeout=60) as http,
    ):
        body = completion(prompt=[PROMPT] * 2, n=2, max_tokens=16)
        assert http.post("/v1/completions", json=body).status_code == 200
        r = http.post("/v1/completions", json={**body, "max_tokens": 17})
        assert_bad_request(r, "max_tokens", "68 tokens", "at most 64", "--max-tokens-per-request")
        r = http.post("/v1/completions", json=completion(best_of=5, max_tokens=16))
        assert_bad_request(r, "max_tokens", "80 tokens", "--max-tokens-per-request")
        # Without max_tokens a chat sample may use the whole context left: that is what counts.
        r = http.post("/v1/chat/completions", json=chat())
        assert_bad_request(r, "max_tokens", "--max-tokens-per-request")
        r = http.post("/v1/chat/completions", json=chat(max_completion_tokens=65))
        assert_bad_request(r, "max_completion_tokens", "65 tokens", "--max-tokens-per-request")
        assert http.post("/v1/chat/completions", json=chat(max_tokens=64)).status_code == 200
        assert_still_serving(http)


def parse_launch(*flags: str) -> argparse.Namespace:
    argv = ["launch", *flags]
    return build_parser(argv).parse_args(argv)


def test_cost_limits_have_launch_flags_and_defaults() -> None:
    defaults = settings_from_args(parse_launch(), "m")
    assert defaults.max_seqs_per_request == 256
    assert defaults.max_tokens_per_request == defaults.max_response_entries == 2**20
    assert defaults == ServerSettings(served_model_names=("m",))
    args = parse_launch(
        "--max-seqs-per-request", "64", "--max-tokens-per-request", "2M",
        "--max-response-entries", "500k",
    )  # fmt: skip
    settings = settings_from_args(args, "m")
    assert settings.max_seqs_per_request == 64
    assert settings.max_tokens_per_request == 2 * 2**20
    assert settings.max_response_entries == 500_000
    with pytest.raises(ValueError, match="max_seqs_per_request"):
        ServerSettings(served_model_names=("m",), max_seqs_per_request=0)


# -- finding 3: response amplification -------------------------------------------------------


def long_prompt_ids(num_tokens: int) -> list[int]:
    return [5 + i % (VOCAB - 10) for i in range(num_tokens)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_n_128_on_a_long_prompt_is_refused_quickly(http, server, stream) -> None:
    body = completion(
        prompt=long_prompt_ids(1000), echo=True, logprobs=20, n=128, max_tokens=16, stream=stream
    )
    raw = json.dumps(body).encode()
    assert len(raw) < 6000  # a 5 KB request ...
    before = server.engine.core.stats.prompt_tokens
    r = http.post("/v1/completions", content=raw, headers=JSON, timeout=60)
    # Quickly: before anything reached the engine (timing it measured the machine).
    assert server.engine.core.stats.prompt_tokens == before
    # ... that asked for 128 x (1,000 + 16) x (1 + 20) entries, about 65 MB of JSON.
    assert_bad_request(r, "logprobs", str(128 * 1016 * 21), "--max-response-entries")
    assert_still_serving(http)


def test_other_amplifiers_are_counted(http) -> None:
    prompt_logprobs = completion(prompt=long_prompt_ids(1000), prompt_logprobs=20, n=64)
    r = http.post("/v1/completions", json=prompt_logprobs, timeout=10)
    assert_bad_request(r, "prompt_logprobs", "--max-response-entries")
    top = chat(n=128, max_tokens=400, logprobs=True, top_logprobs=20)
    r = http.post("/v1/chat/completions", json=top, timeout=10)
    assert_bad_request(r, "top_logprobs", str(128 * 400 * 21), "--max-response-entries")
    assert_still_serving(http)


def test_ordinary_logprobs_requests_still_work(http) -> None:
    body = completion(echo=True, logprobs=5, n=2, max_tokens=4, ignore_eos=True)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) > 4
        assert logprobs["top_logprobs"][0] is None and all(logprobs["top_logprobs"][1:])
    body = chat(max_tokens=4, logprobs=True, top_logprobs=20, ignore_eos=True)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(entry["top_logprobs"]) == 20 for entry in content)


def test_response_budget_is_configurable(engine) -> None:
    with (
        tiny_server(MODEL, {"max_response_entries": 100}, engine=engine) as background,
        httpx.Client(base_url=background.url, timeout=60) as http,
    ):
        body = completion(logprobs=1, max_tokens=50)
        assert http.post("/v1/completions", json=body).status_code == 200
        r = http.post("/v1/completions", json={**body, "max_tokens": 51})
        assert_bad_request(r, "logprobs", "102", "at most 100", "--max-response-entries")
        # Echo without logprobs still copies the prompt into every choice.
        r = http.post("/v1/completions", json=completion(prompt=long_prompt_ids(120), echo=True))
        assert_bad_request(r, "echo", "--max-response-entries")


# -- finding 4: heavy host work must not hold the event loop ---------------------------------


def test_stop_token_ids_are_capped(http) -> None:
    r = http.post("/v1/completions", json=completion(stop_token_ids=[7] * MAX_STOP_TOKEN_IDS))
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json=completion(stop_token_ids=[7] * 1025))
    assert_bad_request(r, "stop_token_ids", "1025", str(MAX_STOP_TOKEN_IDS))
    r = http.post("/v1/chat/completions", json=chat(max_tokens=2, stop_token_ids=[7] * 1025))
    assert_bad_request(r, "stop_token_ids", str(MAX_STOP_TOKEN_IDS))
    # The attacker's body: 900,000 entries and n=32, 1.8 MB.
    raw = json.dumps(completion(stop_token_ids=[1] * 900_000, n=32), separators=(",", ":"))
    start = time.perf_counter()
    json.loads(raw)
    parse_s = time.perf_counter() - start  # what the server cannot avoid doing
    start = time.perf_counter()
    r = post_raw(http, "/v1/completions", raw.encode())
    # Refused in a small multiple of one parse of the body, measured here in the same run
    # (the check is linear in the ids); not "< 5 s" of a shared machine's clock.
    refused_s = time.perf_counter() - start
    assert refused_s < 50 * parse_s, (refused_s, parse_s)
    assert_bad_request(r, "stop_token_ids", "900000")
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))
    assert info.value.param == "stop_token_ids"
    assert_still_serving(http)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def heavy_body(kind: str) -> tuple[str, bytes]:
    """The attacker's request: ~0.3 s of host work each, and the server got eight at once."""
    if kind == "detokenize":  # 600,000 ids, 1.8 MB
        return "/detokenize", json.dumps({"tokens": [5] * 600_000}).encode()
    # 900,000 stop token ids and n=32, 1.8 MB
    body = completion(stop_token_ids=[1] * 900_000, n=32, max_tokens=4, ignore_eos=True)
    return "/v1/completions", json.dumps(body, separators=(",", ":")).encode()


class Probe:
    """Times one small call, over and over on its own connection, while it runs."""

    def __init__(self, url: str, path: str, body: dict | None = None) -> None:
        self.url, self.path, self.body = url, path, body
        self.seconds: list[float] = []
        self.errors: list[str] = []
        self.is_running = False

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while self.is_running:
                start = time.perf_counter()
                if self.body is None:
                    r = client.get(self.path)
                else:
                    r = client.post(self.path, json=self.body)
                self.seconds.append(time.perf_counter() - start)
                if r.status_code != 200:
                    self.errors.append(r.text)

    def __enter__(self) -> Probe:
        self.seconds, self.errors, self.is_running = [], [], True
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.is_running = False
        self.thread.join()


def probes(url: str) -> dict[str, Probe]:
    return {
        "health": Probe(url, "/health"),
        "small completion": Probe(url, "/v1/completions", completion(max_tokens=1)),
    }


def send_concurrently(num: int, path: str, raw: bytes, url: str) -> list[int]:
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            statuses.append(post_raw(client, path, raw).status_code)

    threads = [threading.Thread(target=send) for _ in range(num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


@contextlib.contextmanager
def frozen_heap():
    """The process's heap as ``jaxserve launch`` keeps it: collected once and frozen
    (``gc.freeze``, which the suite's engines skip: JAXSERVE_GC_FREEZE=0), so that a collection
    does not walk the heap the test process has gathered by then. The server here runs in the
    test process: in a full suite, one such collection stalled health and the small completion
    alike for 2.0 s, a pause of the test process, not of the server's work."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(("kind", "status"), [("detokenize", 200), ("stop_token_ids", 400)])
def test_eight_heavy_requests_leave_health_and_small_requests_their_latency(
    server, http, kind, status
) -> None:
    with frozen_heap():
        _heavy_requests_leave_the_probes_their_latency(server, http, kind, status)


def _heavy_requests_leave_the_probes_their_latency(
    server, http: httpx.Client, kind: str, status: int
) -> None:
    idle = {}
    for name, probe in probes(server.url).items():
        with probe:
            time.sleep(0.5)
        idle[name] = max(probe.seconds[2:])  # the first calls open the connection
    path, raw = heavy_body(kind)
    running = probes(server.url)
    with running["health"], running["small completion"]:
        statuses = send_concurrently(8, path, raw, server.url)
    assert statuses == [status] * 8
    assert not any(probe.errors for probe in running.values())
    busy = {name: max(probe.seconds) for name, probe in running.items()}
    # Measured against one parse of the same body in this process, now: what is left of the
    # wait is the GIL (json.loads of one 1.8 MB body holds it for 40-90 ms on a 2-core machine,
    # and a health call needs it several times, in the server's loop and in the probe's own
    # thread), so it may wait for a few parses, whatever the machine's load. On a loaded 2-core
    # machine, at worst: before the fix 1.7-4.7 s (health) and 1.9-11 s (small completion), 20
    # parses and more; after, 0.1-0.6 s and 0.15-0.8 s, 2 to 10 parses.
    parse_s = min(timed(lambda: json.loads(raw)) for _ in range(3))
    assert busy["health"] < 2 * idle["health"] + 16 * parse_s, (idle, busy, parse_s)
    small = busy["small completion"]
    assert small < 2 * idle["small completion"] + 16 * parse_s, (idle, busy, parse_s)
    assert_still_serving(http)


# -- finding 6: numbers that answered 500 ----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", f'{{"prompt": "a", "max_tokens": {LONG}}}', "max_tokens"),
        ("/v1/completions", f'{{"prompt": "a", "max_tokens": {"9" * 4300}}}', "max_tokens"),
        ("/v1/completions", f'{{"prompt": "a", "priority": -{LONG}}}', "priority"),
        ("/v1/completions", f'{{"prompt": [[5, {LONG}]]}}', "prompt[0][1]"),
        ("/v1/chat/completions", f'{{"messages": [], "metadata": {{"x": {LONG}}}}}', "metadata.x"),
        ("/v1/chat/completions", f'{{"messages": [], "n": {LONG}}}', "n"),
        ("/detokenize", f'{{"tokens": [1, {LONG}]}}', "tokens[1]"),
        ("/v1/completions", '{"prompt": "a", "logit_bias": {"\\u00b2": 1}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "a", "logit_bias": {"²": 1}}', "logit_bias"),
        ("/v1/completions", f'{{"prompt": "a", "logit_bias": {{"{LONG}": 1}}}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "a", "logit_bias": {"١٢": 1}}', "logit_bias"),
    ],
    ids=[
        "max_tokens",
        "max_tokens-4300-nines",
        "negative-priority",
        "prompt-token-id",
        "metadata",
        "chat-n",
        "detokenize-token-id",
        "logit_bias-escaped-superscript",
        "logit_bias-superscript",
        "logit_bias-long-key",
        "logit_bias-arabic-digits",
    ],
)
def test_unreadable_numbers_are_400s_naming_the_field(http, path, raw, param) -> None:
    message = assert_bad_request(post_raw(http, path, raw.encode()), param)
    assert len(message) < 300  # a 5,000-digit value is not echoed back
    assert_still_serving(http)


def test_integers_that_mean_something_still_parse(http) -> None:
    body = completion(seed=2**64 - 1, top_k=10**30, logit_bias={"00000000000000000005": 1})
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_parse_json_object_names_a_nested_long_integer() -> None:
    with pytest.raises(APIError) as info:
        parse_json_object(f'{{"a": [1, {{"b": {LONG}}}]}}'.encode())
    assert info.value.status == 400 and info.value.param == "a[1].b"
    assert "5000 digits" in info.value.message
    assert parse_json_object(b'{"a": [1, 2]}') == {"a": [1, 2]}


# -- finding 7: a top_p that underflows float32 ----------------------------------------------


def test_top_p_below_float32_keeps_only_the_top_token() -> None:
    assert np.float32(1e-300) == 0  # what the sampler's rows hold
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)), jnp.float32)
    top_p = jnp.asarray([1e-300, 1e-30, 0.0, 1.0], jnp.float32)
    top_k = jnp.zeros(4, jnp.int32)
    masked = np.asarray(apply_top_k_top_p(logits, top_k, top_p))
    kept = np.isfinite(masked)
    best = np.argmax(np.asarray(logits), axis=-1)
    for row in range(3):
        assert kept[row].sum() == 1 and kept[row, best[row]], row
    assert kept[3].all()


def test_tiny_top_p_samples_like_greedy_over_http(http) -> None:
    def text(**extra) -> str:
        body = completion(max_tokens=8, ignore_eos=True, **extra)
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text()
    for top_p in (1e-300, 1e-30):
        texts = {text(temperature=1.0, top_p=top_p, seed=seed) for seed in range(6)}
        assert texts == {greedy}, (top_p, texts)
