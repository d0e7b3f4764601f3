"""The OpenAI-compatible server end to end: a real engine on the tiny Llama fixture, a real
uvicorn server on a loopback port, driven by the ``openai`` SDK (and httpx for raw cases).

One server for the whole module (start-up compiles the model's shape buckets).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from openapi_spec_validator import validate

from tests.conftest import tiny_server, wait_idle

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
MODEL = "tiny-llama"
API_KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 256
VOCAB = 320
BODY_LIMIT = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    settings = dict(
        served_model_names=(MODEL, "alias"),
        api_key=API_KEY,
        max_request_body_bytes=BODY_LIMIT,
        max_header_count=50,
        stats_log_interval_s=0.5,
    )
    # Steps of at least 2 ms: a 240-token stream is still running when its client disconnects,
    # however fast the device.
    with tiny_server(
        MODEL,
        settings,
        min_step_s=0.002,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=64,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def metric(http: httpx.Client, name: str) -> float:
    """Sum of every sample of a Prometheus series in /metrics."""
    total, found = 0.0, False
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def greedy(**kwargs):
    """Greedy sampling that runs to max_tokens (the random fixture model may emit EOS)."""
    return {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}, **kwargs}


# -- the happy paths -----------------------------------------------------------------------


def test_models_version_and_health(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    card = models.data[0].model_dump()
    assert card["max_model_len"] == MAX_MODEL_LEN
    # vLLM's model card: parent and permission too.
    assert card["parent"] is None
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    assert permission["id"].startswith("modelperm-") and permission["organization"] == "*"
    assert http.get("/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # public: no key


def test_openapi_is_valid_and_describes_request_bodies(http):
    spec = http.get("/openapi.json").json()
    validate(spec)
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        assert spec["components"]["schemas"][name]["additionalProperties"] is False
    completion = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["maximum"] == MAX_MODEL_LEN - 1
    assert completion["logprobs"]["maximum"] == 20


def test_completion_text_and_usage(client, http):
    prompt = "Hello world"
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    result = client.completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=5))
    (choice,) = result.choices
    assert result.object == "text_completion" and result.model == MODEL
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == num_prompt
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == num_prompt + 5


def test_token_prompt_equals_text_prompt(client, http):
    tokens = http.post("/tokenize", json={"prompt": "The cat"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="The cat", **greedy())
    by_ids = client.completions.create(model=MODEL, prompt=tokens, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens


def test_completion_batch_and_n(client):
    result = client.completions.create(
        model=MODEL,
        prompt=["one", "two"],
        n=3,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == list(range(6))
    assert result.usage.completion_tokens == 6 * 4
    # Greedy samples of one prompt agree; each prompt is its own request.
    greedy_result = client.completions.create(
        model=MODEL, prompt=["one", "two"], n=2, **greedy(max_tokens=4)
    )
    texts = {c.index: c.text for c in greedy_result.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_completion_logprobs_shape_and_greedy_argmax(client):
    result = client.completions.create(model=MODEL, prompt="abc", logprobs=3, **greedy())
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 8
    # The text skips special tokens; the token list names them.
    assert re.sub(r"<\|\w+\|>", "", "".join(logprobs.tokens)) == result.choices[0].text
    columns = (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    for token, lp, top in zip(*columns, strict=True):
        assert lp <= 0 and 1 <= len(top) <= 3
        assert top.get(token) == pytest.approx(max(top.values()))  # greedy picks the argmax
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_completion_echo_with_logprobs(client, http):
    prompt = "echo me"
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    result = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, **greedy(max_tokens=3)
    )
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first token
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])


def test_prompt_logprobs(client, http):
    prompt = "score this prompt"
    num_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    result = client.completions.create(
        model=MODEL, prompt=prompt, **greedy(max_tokens=1, extra_body={"prompt_logprobs": 2})
    )
    entries = result.choices[0].model_dump()["prompt_logprobs"]
    assert len(entries) == num_prompt and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3  # the prompt token and the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        **greedy(max_tokens=1, extra_body={"prompt_logprobs": 0}),
    )
    assert len(chat.model_dump()["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_stop_string_and_stop_reason(client):
    base = client.completions.create(model=MODEL, prompt="Once", **greedy(max_tokens=24))
    text = base.choices[0].text
    pairs = (text[i : i + 2] for i in range(2, len(text) - 2))
    stop = next(p for p in pairs if p.isascii() and p.isalnum())
    cut = client.completions.create(
        model=MODEL, prompt="Once", stop=[stop], **greedy(max_tokens=24)
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_dump()["stop_reason"] == stop
    assert choice.text == text[: text.index(stop)]


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL, prompt="Seeds", max_tokens=12, temperature=1.0, seed=seed
        )
        return result.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_streaming_completion_matches_and_ends_with_done(client, http):
    full = client.completions.create(model=MODEL, prompt="Stream", **greedy(max_tokens=10))
    stream = client.completions.create(
        model=MODEL,
        prompt="Stream",
        stream=True,
        stream_options={"include_usage": True},
        **greedy(max_tokens=10),
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    body = {"model": MODEL, "prompt": "Stream", "stream": True, "max_tokens": 3}
    raw = http.post("/v1/completions", json=body)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_stream_events_stay_one_line_whatever_the_text(http):
    # U+0085, U+2028 and U+2029 end a line for str.splitlines, so for httpx's iter_lines too; a
    # model can generate them (byte tokens C2 85, E2 80 A8), and raw they split an event in two.
    prompt = "a\x85b\u2028c\u2029d"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "stream": True, "max_tokens": 2}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(prompt)


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **greedy())
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **greedy(),
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 8


def test_chat_logprobs_n_and_max_completion_tokens(client):
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hey"}]}],
        n=3,
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=4,
        temperature=0.8,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    for choice in result.choices:
        assert choice.finish_reason == "length"
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
        assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert result.usage.completion_tokens == 12


def test_tokenize_detokenize_roundtrip(client, http):
    text = "round trip \x00 text"
    tokenized = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "count me"}]
    count = http.post("/tokenize", json={"messages": messages}).json()["count"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, **greedy(max_tokens=1))
    assert chat.usage.prompt_tokens == count


def test_prefix_cache_hits_reported_as_cached_tokens(client, http):
    prompt = " ".join(f"w{i}" for i in range(40))  # several full blocks of 16 tokens
    hits_before = metric(http, "jaxserve:prefix_cache_hits_total")
    client.completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=1))
    again = client.completions.create(model=MODEL, prompt=prompt, **greedy(max_tokens=1))
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16
    assert metric(http, "jaxserve:prefix_cache_hits_total") >= hits_before + cached


def test_metrics_after_requests(server, client, http):
    before = metric(http, "jaxserve:request_success_total")
    client.completions.create(model=MODEL, prompt="metrics", **greedy(max_tokens=3))
    wait_idle(server.engine)
    text = http.get("/metrics").text
    assert metric(http, "jaxserve:request_success_total") == before + 1
    assert 'finished_reason="length"' in text
    for name in (
        "jaxserve:num_requests_running",
        "jaxserve:num_requests_waiting",
        "jaxserve:kv_cache_usage_perc",
        "jaxserve:prefix_cache_queries_total",
        "jaxserve:num_preemptions_total",
        "jaxserve:prompt_tokens_total",
        "jaxserve:generation_tokens_total",
        "jaxserve:num_aborted_requests_total",
        "jaxserve:time_to_first_token_seconds_count",
        "jaxserve:time_per_output_token_seconds_count",
        "jaxserve:inter_token_latency_seconds_count",
        "jaxserve:e2e_request_latency_seconds_count",
        "jaxserve:request_queue_time_seconds_count",
        "jaxserve:request_prompt_tokens_count",
        "jaxserve:request_generation_tokens_count",
    ):
        assert f'{name}{{model_name="{MODEL}"}} ' in text, name
    assert metric(http, "jaxserve:kv_cache_usage_perc") == 0.0
    assert metric(http, "jaxserve:generation_tokens_total") >= 3


def test_stream_disconnect_aborts_and_frees_blocks(server, http):
    aborted_before = metric(http, "jaxserve:num_aborted_requests_total")
    body = {
        "model": MODEL,
        "prompt": "Disconnect",
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "max_tokens": 240,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.engine.core.stats.kv_cache_usage > 0
    # Leaving the block closed the connection mid-stream.
    wait_idle(server.engine)
    deadline = time.monotonic() + 5
    while metric(http, "jaxserve:num_aborted_requests_total") == aborted_before:
        assert time.monotonic() < deadline, "the engine never saw the abort"
        time.sleep(0.02)
    assert 'finished_reason="abort"' in http.get("/metrics").text


# -- bad input (RELIABILITY.md rows 1-22) ------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOO_LONG = list(range(5, 5 + MAX_MODEL_LEN))


def completion(**changes):
    return ("/v1/completions", {**COMPLETION, **changes})


def chat(**changes):
    return ("/v1/chat/completions", {**CHAT, **changes})


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (route, body, status, param, code); body bytes are sent as they are.
BAD_REQUESTS = {
    "1-malformed-json": ("/v1/completions", b'{"prompt": "hi",', 400, None, None),
    "2-array-body": ("/v1/completions", b"[1, 2]", 400, "body", None),
    "2-string-body": ("/v1/chat/completions", b'"hello"', 400, "body", None),
    "2-null-body": ("/v1/completions", b"null", 400, "body", None),
    "3-unknown-model": (*completion(model="gpt-9"), 404, "model", "model_not_found"),
    "3-unknown-model-chat": (*chat(model="gpt-9"), 404, "model", "model_not_found"),
    "4-missing-prompt": ("/v1/completions", without(COMPLETION, "prompt"), 400, "prompt", None),
    "4-empty-prompt": (*completion(prompt=""), 400, "prompt", None),
    "4-empty-prompt-list": (*completion(prompt=[]), 400, "prompt", None),
    "4-missing-messages": (
        "/v1/chat/completions",
        without(CHAT, "messages"),
        400,
        "messages",
        None,
    ),
    "4-empty-messages": (*chat(messages=[]), 400, "messages", None),
    "5-bad-role": (
        *chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
        None,
    ),
    "5-content-number": (
        *chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        None,
    ),
    "5-image-content": (
        *chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        400,
        "messages[0].content[0].type",
        None,
    ),
    "5-bad-tool-calls": (
        *chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]),
        400,
        "messages[0].tool_calls[0]",
        None,
    ),
    "5-tool-without-id": (
        *chat(messages=[{"role": "tool", "content": "r"}]),
        400,
        "messages[0]",
        None,
    ),
    "6-prompt-too-long": (*completion(prompt=TOO_LONG), 400, "prompt", "context_length_exceeded"),
    "6-messages-too-long": (
        *chat(messages=[{"role": "user", "content": "a " * MAX_MODEL_LEN}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    "7-prompt-plus-max-tokens": (
        *completion(max_tokens=MAX_MODEL_LEN),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "7-chat-max-completion-tokens": (
        *chat(max_completion_tokens=MAX_MODEL_LEN),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "8-max-tokens-zero": (*completion(max_tokens=0), 400, "max_tokens", None),
    "8-max-tokens-negative": (*completion(max_tokens=-1), 400, "max_tokens", None),
    "8-max-tokens-float": (*completion(max_tokens=1.5), 400, "max_tokens", None),
    "8-max-tokens-huge": (
        *completion(max_tokens=10**9),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "9-temperature-negative": (*completion(temperature=-0.5), 400, "temperature", None),
    "9-temperature-huge": (*completion(temperature=1e9), 400, "temperature", None),
    "9-top-p-zero": (*completion(top_p=0), 400, "top_p", None),
    "9-top-p-above-one": (*chat(top_p=1.5), 400, "top_p", None),
    "9-top-k-zero": (*completion(top_k=0), 400, "top_k", None),
    "9-top-k-below-minus-one": (*chat(top_k=-2), 400, "top_k", None),
    "9-min-p-negative": (*completion(min_p=-0.1), 400, "min_p", None),
    "9-min-p-above-one": (*completion(min_p=1.1), 400, "min_p", None),
    "10-n-zero": (*completion(n=0), 400, "n", None),
    "10-n-over-cap": (*chat(n=129), 400, "n", None),
    "10-best-of-below-n": (*completion(n=3, best_of=2), 400, "best_of", None),
    "11-logprobs-over-cap": (*completion(logprobs=21), 400, "logprobs", None),
    "11-top-logprobs-over-cap": (*chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    "11-top-logprobs-without-logprobs": (*chat(top_logprobs=2), 400, "top_logprobs", None),
    "11-prompt-logprobs-minus-one": (*completion(prompt_logprobs=-1), 400, "prompt_logprobs", None),
    "12-logit-bias-out-of-vocab": (
        *completion(logit_bias={str(VOCAB): 1}),
        400,
        "logit_bias",
        None,
    ),
    "12-logit-bias-value": (*chat(logit_bias={"5": 101}), 400, "logit_bias", None),
    "12-logit-bias-key": (*chat(logit_bias={"five": 1}), 400, "logit_bias", None),
    "13-five-stops": (*completion(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    "13-empty-stop": (*chat(stop=[""]), 400, "stop", None),
    "13-stop-token-out-of-vocab": (
        *completion(stop_token_ids=[VOCAB]),
        400,
        "stop_token_ids",
        None,
    ),
    "14-negative-token": (*completion(prompt=[1, -1]), 400, "prompt", None),
    "14-token-out-of-vocab": (*completion(prompt=[[1, VOCAB]]), 400, "prompt", None),
    "15-seed-string": (*completion(seed="1"), 400, "seed", None),
    "15-seed-float": (*chat(seed=1.5), 400, "seed", None),
    "15-seed-too-big": (*completion(seed=2**64), 400, "seed", None),
    "16-json-object-extra-field": (
        *chat(response_format={"type": "json_object", "schema": {}}),
        400,
        "response_format",
        None,
    ),
    "16-json-schema-invalid": (
        *chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strng"}},
            }
        ),
        400,
        "response_format",
        None,
    ),
    "16-regex": (
        *chat(response_format={"type": "regex", "regex": "("}),
        400,
        "response_format",
        None,
    ),
    "16-tools": (
        *chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
        None,
    ),
    "16-functions": (*chat(functions=[{"name": "f"}]), 400, "functions", None),
    "16-guided-json": (*completion(guided_json={"type": "strng"}), 400, "guided_json", None),
    "17-chat-template": (*chat(chat_template="{{ 7 * 7 }}"), 400, "chat_template", None),
    "17-template-kwargs": (
        *chat(chat_template_kwargs={"tools_in_user": True}),
        400,
        "chat_template_kwargs",
        None,
    ),
    "18-lone-surrogate": ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", None),
    "18-invalid-utf8": ("/v1/completions", b'{"prompt": "a\xff\xfeb"}', 400, None, None),
    "18-surrogate-in-message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages[0].content",
        None,
    ),
    "unknown-field": (*completion(frobnicate=1), 400, "frobnicate", None),
    "min-tokens-over-default-budget": (
        "/v1/completions",
        without({**COMPLETION, "min_tokens": 20}, "max_tokens"),
        400,
        "min_tokens",
        None,
    ),
    "user-not-a-string": (*chat(user=5), 400, "user", None),
    "prompt-logprobs-with-stream": (
        *completion(prompt_logprobs=1, stream=True),
        400,
        "prompt_logprobs",
        None,
    ),
    "stream-options-without-stream": (
        *completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
    ),
    "deep-json": ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, None, None),
    "tokenize-both": (
        "/tokenize",
        {"prompt": "a", "messages": CHAT["messages"]},
        400,
        "prompt",
        None,
    ),
    "detokenize-out-of-vocab": ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens", None),
}


def assert_error_body(response: httpx.Response, status: int, param, code) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text and error["message"]
    return error


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request(server, http, case):
    route, body, status, param, code = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(route, content=content, headers={"content-type": "application/json"})
    error = assert_error_body(response, status, param, code)
    if code == "context_length_exceeded":
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    # The server is unharmed: healthy, no blocks held, and a normal request succeeds.
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_idle(server.engine)
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_sdk_raises_typed_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT["messages"],
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}},
        )


def test_accepted_neutral_values(client):
    """Fields that change nothing are accepted, not rejected (and not silently honoured)."""
    result = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "x"},
            {"role": "user", "content": "y", "name": "u"},
        ],
        tool_choice="none",
        response_format={"type": "text"},
        user="someone",
        parallel_tool_calls=False,
        store=False,
        max_tokens=1,
    )
    assert result.choices[0].finish_reason in ("length", "stop")


# -- limits and auth (rows 19-22) --------------------------------------------------------------


def test_body_over_limit_declared(http):
    response = http.post("/v1/completions", content=b"x" * (BODY_LIMIT + 1))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_body_over_limit_chunked_is_cut_off(server, http):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(256):  # 16 MB if the server read it all
            sent += 64 * 1024
            yield b" " * (64 * 1024)

    try:
        response = http.post("/v1/completions", content=chunks())
        assert response.status_code == 413
    except httpx.TransportError:
        pass  # the server closed the connection as soon as the limit was passed
    assert sent < 256 * 64 * 1024  # the client could not push the whole body
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_too_many_headers(http):
    headers = {f"x-h{i}": "v" for i in range(60)}
    response = http.get("/v1/models", headers=headers)
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"


def test_header_too_large(http):
    response = http.get("/v1/models", headers={"x-big": "a" * 40_000})
    assert response.status_code in (400, 431)
    assert http.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {API_KEY}x", f"Basic {API_KEY}", "Bearer", API_KEY, f"Bearer {API_KEY[:-1]}"],
)
def test_auth_rejected(server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/nowhere")):
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json=COMPLETION)
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"]
        # No key is not an incorrect one.
        said = "No API key provided" if authorization is None else "Incorrect API key provided"
        assert error["message"].startswith(said), error


def test_auth_scheme_case_insensitive_and_public_paths(server):
    ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_sdk_authentication_error(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as exc:
            bad.models.list()
    assert exc.value.code == "invalid_api_key"


def test_unknown_route_and_method(http):
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = http.get("/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert "POST" in wrong_method.headers["allow"]
