"""``POST /v1/embeddings`` through the OpenAI SDK against a pooling server (``--runner pooling``):
float and base64 vectors equal to sentence-transformers', ``dimensions``, ``usage``, the 400s in
OpenAI's error shape, the generation routes refused, and run-batch's embeddings lines."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest

from jaxserve.server.launch.run_batch import run_batch_lines
from tests.conftest import assert_bad_request, metric, tiny_server, wait_idle
from tests.test_embeddings import EMBEDDINGS, ENGINE, TOLERANCE, golden, golden_ids, unit

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def server():
    config = {**ENGINE, "model": str(EMBEDDINGS / "qwen3_last"), "runner": "pooling"}
    with tiny_server(MODEL, **config) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_float_embeddings_of_a_list_of_texts_equal_sentence_transformers(client, server):
    g = golden("qwen3_last")
    before = metric(server.url, "jaxserve:prompt_tokens_total")
    result = client.embeddings.create(model=MODEL, input=[str(t) for t in g["texts"]], user="u")
    assert result.object == "list" and result.model == MODEL
    assert [d.index for d in result.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in result.data)
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, g["embeddings"], atol=TOLERANCE)
    num_tokens = int(g["num_tokens"].sum())
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (num_tokens, num_tokens)
    assert metric(server.url, "jaxserve:prompt_tokens_total") - before == num_tokens
    wait_idle(server.engine)


def test_base64_is_little_endian_float32_as_the_sdk_decodes_it(client, http):
    g = golden("qwen3_last")
    text = str(g["texts"][2])
    # The SDK asks for base64 when the caller does not say, and decodes it to floats.
    decoded = client.embeddings.create(model=MODEL, input=text)
    np.testing.assert_allclose(decoded.data[0].embedding, g["embeddings"][2], atol=TOLERANCE)
    raw = http.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, g["embeddings"][2], atol=TOLERANCE)
    floats = http.post("/v1/embeddings", json={"input": text}).json()  # float by default
    np.testing.assert_allclose(floats["data"][0]["embedding"], vector, atol=1e-7)


def test_token_id_inputs_and_dimensions(client):
    g = golden("qwen3_last")
    ids = golden_ids(g)
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, g["embeddings"][1], atol=TOLERANCE)
    many = client.embeddings.create(model=MODEL, input=ids, dimensions=16)
    expected = np.array([unit(p[:16]) for p in g["pooled"]])
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=TOLERANCE)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", ["input[0] is empty"]),
        ({"input": []}, "input", ["must not be empty"]),
        ({"input": ["a", 3]}, "input", ["input[1] must be a string or an array"]),
        ({"input": ["a"] * 2049}, "input", ["2049 entries", "at most 2048"]),
        ({"input": [7] * 257}, "input", ["maximum context length is 256", "257"]),
        ({"input": [999]}, "input", ["out of vocabulary (size 320)"]),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", ["float, base64"]),
        ({"input": "a", "dimensions": 20}, "dimensions", ["[16, 32]"]),
        ({"input": "a", "dimensions": 0}, "dimensions", ["at least 1"]),
        ({"input": "a", "stream": True}, "stream", ["Unrecognized"]),
    ],
)
def test_bad_requests_are_400s_naming_the_field(http, body, param, words):
    assert_bad_request(http.post("/v1/embeddings", json=body), param, *words)


def test_a_pooling_server_refuses_generation(http):
    for path, body in [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"input": "Hi"}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "served for pooling" in r.json()["error"]["message"]


def run_batch(server, lines: list[str]) -> list[dict]:
    """``lines`` through an app of the server's engine, in this process, as run-batch does."""
    from jaxserve.server.app import build_app
    from jaxserve.server.settings import ServerSettings

    batch_app = build_app(server.engine, ServerSettings(served_model_names=(MODEL,)))
    out = io.StringIO()
    asyncio.run(run_batch_lines(batch_app, lines, out, window=4))
    return [json.loads(text) for text in out.getvalue().splitlines()]


def test_run_batch_answers_good_and_bad_embeddings_lines(server):
    g = golden("qwen3_last")

    def line(custom_id: str, url: str = "/v1/embeddings", **body) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    results = run_batch(
        server,
        [
            line("good", input=[str(g["texts"][0]), str(g["texts"][1])], model=MODEL),
            line("bad", input=[]),
            line("generate", url="/v1/completions", prompt="Hi"),
        ],
    )
    by_id = {r["custom_id"]: r for r in results}
    good = by_id["good"]["response"]
    assert good["status_code"] == 200 and good["request_id"] == good["body"]["id"]
    got = [d["embedding"] for d in good["body"]["data"]]
    np.testing.assert_allclose(got, g["embeddings"][:2], atol=TOLERANCE)
    assert by_id["bad"]["response"]["status_code"] == 400
    assert by_id["bad"]["response"]["body"]["error"]["param"] == "input"
    refused = by_id["generate"]["response"]
    assert refused["status_code"] == 400 and "served for pooling" in json.dumps(refused["body"])
