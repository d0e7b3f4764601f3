"""Hostile input, round two: one request must never kill, starve or flood the server.

Each test is one finding of an attacker's run against ``jaxserve launch``: the request that
took the engine down (``top_k`` of 2**31), integers too long to parse, and the rest of the
list as they are fixed. One real engine on the tiny Llama fixture, one real server on a
loopback port; after every case the server must still be healthy and serve a normal request.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import httpx
import jax
import pytest
from jax._src import monitoring  # the public module has no unregister in jax 0.11.2
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from jaxserve.sampling_params import SamplingParams
from tests.conftest import tiny_server, wait_for

MODEL = "tiny"
VOCAB = 320
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def server():
    # Steps of at least 3 ms: a large request is still generating while its neighbour is
    # timed, however fast the device.
    with tiny_server(
        MODEL,
        min_step_s=0.003,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=NUM_BLOCKS,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "the river", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# -- finding 1: top_k past int32 took the engine thread down ----------------------------------


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_huge_top_k_is_clamped_to_the_vocabulary_and_the_engine_lives(
    http, route, stream, top_k
) -> None:
    body: dict = {"model": MODEL, "max_tokens": 4, "top_k": top_k, "seed": 7, "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "the river"
    r = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text
    assert_still_serving(http)


def test_top_k_at_or_past_the_vocabulary_samples_like_no_top_k(http) -> None:
    def text(**extra) -> str:
        body = {"model": MODEL, "prompt": "the river", "max_tokens": 8, "seed": 3, **extra}
        r = http.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(top_k=VOCAB) == text(top_k=2**40) == text()


def test_for_vocab_clamps_top_k_and_keeps_smaller_values() -> None:
    assert SamplingParams(top_k=2**63).for_vocab(VOCAB).top_k == -1
    assert SamplingParams(top_k=VOCAB).for_vocab(VOCAB).top_k == -1
    assert SamplingParams(top_k=VOCAB - 1).for_vocab(VOCAB).top_k == VOCAB - 1
    assert SamplingParams().for_vocab(VOCAB).top_k == -1


# -- finding 5: every program is compiled at start-up; none on the serving path ---------------


def mixed_parameter_bodies() -> list[dict]:
    """Requests that between them reach every sampler feature (constraints included), at
    several prompt lengths."""
    rng = random.Random(5)
    bodies = []
    for i in range(40):
        body: dict = {
            "model": MODEL,
            "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.choice((1, 7, 40, 130)))],
            "max_tokens": rng.choice((2, 5, 17)),
            "temperature": rng.choice((0, 0.7, 1.3)),
            "seed": i,
        }
        extra = [
            {"top_k": rng.randrange(1, 50)},
            {"top_p": rng.choice((0.3, 0.9))},
            {"min_p": 0.2},
            {"presence_penalty": 0.5, "frequency_penalty": -0.3},
            {"repetition_penalty": 1.3},
            {"logit_bias": {str(t): 5.0 for t in range(3, 3 + rng.choice((1, 9, 300)))}},
            {"min_tokens": 2, "stop_token_ids": list(range(10, 10 + rng.choice((1, 20))))},
            {"logprobs": rng.choice((0, 3, 20))},
            {"prompt_logprobs": 2},
            {"n": 3},
            {"best_of": 3, "n": 2},
            {"stop": ["ab", "x"]},
            rng.choice(  # one constraint at most
                [
                    {"structured_outputs": {"regex": "[a-z]{1,8}"}},
                    {"response_format": {"type": "json_object"}},
                    {"guided_choice": ["yes", "no"]},
                ]
            ),
        ]
        for choice in rng.sample(extra, rng.choice((0, 1, 2, 4))):
            body.update(choice)
        bodies.append(body)
    return bodies


def test_a_mixed_parameter_load_compiles_nothing_after_warm_up(http) -> None:
    compiles: list[float] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(
                pool.map(
                    lambda body: http.post("/v1/completions", json=body), mixed_parameter_bodies()
                )
            )
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert [r.status_code for r in replies] == [200] * len(replies), [
        r.text for r in replies if r.status_code != 200
    ]
    assert not compiles, f"{len(compiles)} programs compiled on the serving path"
    assert_still_serving(http)


# -- finding 2 (scheduling half): a large request within the limits must not starve others ----


def test_a_neighbour_keeps_its_latency_while_a_large_request_fills_the_batch(server, http) -> None:
    def neighbour_seconds() -> float:
        start = time.perf_counter()
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "the sea", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return time.perf_counter() - start

    idle = min(neighbour_seconds() for _ in range(3))
    large = {"model": MODEL, "prompt": ["a b", "c d", "e f", "g h"], "n": 4, "max_tokens": 240,
             "ignore_eos": True, "temperature": 0.8, "seed": 1}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        large_start = time.perf_counter()
        running = pool.submit(http.post, "/v1/completions", json=large)
        wait_for(lambda: server.engine.stats().num_running >= 7, 30, "the large request to run")
        loaded = neighbour_seconds()
        assert not running.done(), "the large request must still be running"
        assert server.engine.stats().num_waiting > 0  # 16 samples, 8 slots: some still wait
        assert running.result().status_code == 200
        large_seconds = time.perf_counter() - large_start
    # Without round-robin admission and a kept slot the neighbour waited for 16 samples of
    # 240 tokens to finish: about the large request's whole time. Its 4 tokens now take a
    # small part of it, measured in the same run (the old bound, "2x idle or idle + 0.5 s",
    # was a shared machine's clock).
    assert loaded < 0.25 * large_seconds, (
        f"idle {idle:.3f} s, loaded {loaded:.3f} s, large {large_seconds:.3f} s"
    )
    assert_still_serving(http)


# -- found at full scale on the H200: prompt logprobs of a long step ran out of memory -----------


class OutOfDeviceMemory:
    """Stands for a device array whose program failed: reading it raises, as XLA's does."""

    def __array__(self, dtype=None, copy=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (fake)")


def test_a_step_whose_prompt_logprobs_fail_fails_only_their_request(server, http) -> None:
    programs = server.engine.core.runner.programs
    real = programs.prompt_logprobs
    programs.prompt_logprobs = lambda hidden, next_ids: (OutOfDeviceMemory(),) * 4
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(
                http.post,
                "/v1/completions",
                json={"model": MODEL, "prompt": "the sea", "max_tokens": 24, "temperature": 0},
            )
            echo = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "the river bank", "max_tokens": 2,
                      "echo": True, "logprobs": 5},
            )  # fmt: skip
            assert echo.status_code == 500, echo.text
            assert plain.result().status_code == 200, plain.result().text
    finally:
        programs.prompt_logprobs = real
    assert_still_serving(http)
    lp = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "the river", "max_tokens": 1, "echo": True, "logprobs": 1},
    )
    assert lp.status_code == 200 and lp.json()["choices"][0]["logprobs"]["token_logprobs"][1] < 0
