"""Classification (``POST /classify`` and ``/v1/classify``, ``LLM.classify``) with a 3-label
``BertForSequenceClassification`` against transformers' golden probabilities; chat-style
``messages`` for ``/v1/embeddings``; and the 400s of both (docs/embeddings.md)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

import jaxserve
from tests.conftest import SMALL_ENGINE, tiny_server, wait_idle
from tests.test_embeddings import EMBEDDINGS
from tests.test_embeddings import ENGINE as DECODER_ENGINE
from tests.test_embeddings_api import run_batch
from tests.test_scoring import ENCODER_ENGINE, ENCODERS, golden

CLASSIFIER = ENCODERS / "bert_classifier"
TOLERANCE = 1e-5
# A chat template that writes each turn on a line of its own (the fixture's tokenizer has none).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def texts() -> list[str]:
    return [str(t) for t in golden(CLASSIFIER)["texts"]]


# -- the engine (LLM) -------------------------------------------------------------------------


def test_llm_classify_equals_the_golden_probabilities():
    g = golden(CLASSIFIER)
    llm = jaxserve.LLM(str(CLASSIFIER), **ENCODER_ENGINE)
    assert llm.labels == ("negative", "neutral", "positive")  # config.json's id2label
    outputs = llm.classify(texts(), use_tqdm=False)
    got = np.array([o.outputs.probs for o in outputs])
    np.testing.assert_allclose(got, g["probs"], atol=TOLERANCE)
    assert all(o.outputs.num_classes == 3 for o in outputs)
    assert [len(o.prompt_token_ids) for o in outputs] == np.diff(g["cu_seq_lens"]).tolist()
    raw = llm.classify(texts()[0], use_activation=False, use_tqdm=False)
    np.testing.assert_allclose(raw[0].outputs.probs, g["logits"][0], atol=TOLERANCE)
    with pytest.raises(ValueError, match="cannot score pairs: its classifier has 3 labels"):
        llm.score("a", "b")


def test_llm_classify_refuses_a_model_without_a_classifier():
    llm = jaxserve.LLM(str(ENCODERS / "bert_embed"), **ENCODER_ENGINE)
    with pytest.raises(ValueError, match="cannot classify: it has no sequence-classification"):
        llm.classify("a text")


# -- HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier():
    config = {**ENCODER_ENGINE, "model": str(CLASSIFIER)}
    with tiny_server("cls", **config) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield server, c


def test_classify_answers_vllms_shape_with_the_golden_probabilities(classifier):
    server, http = classifier
    g = golden(CLASSIFIER)
    for path in ("/classify", "/v1/classify"):
        r = http.post(path, json={"model": "cls", "input": texts()})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        assert body["model"] == "cls" and isinstance(body["created"], int)
        data = body["data"]
        assert [d["index"] for d in data] == [0, 1, 2, 3]
        np.testing.assert_allclose([d["probs"] for d in data], g["probs"], atol=TOLERANCE)
        labels = ["negative", "neutral", "positive"]
        assert [d["label"] for d in data] == [labels[i] for i in g["probs"].argmax(axis=1)]
        assert all(d["num_classes"] == 3 for d in data)
        tokens = int(g["cu_seq_lens"][-1])
        assert body["usage"] == {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
        }
    one = http.post("/v1/classify", json={"input": texts()[1]}).json()
    np.testing.assert_allclose(one["data"][0]["probs"], g["probs"][1], atol=TOLERANCE)
    raw = http.post("/v1/classify", json={"input": texts()[2], "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["probs"], g["logits"][2], atol=TOLERANCE)
    wait_idle(server.engine)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "a", "dimensions": 3}, "dimensions"),
        ({"input": "a", "model": "other"}, "model"),
    ],
)
def test_bad_classify_requests_are_400s_naming_the_field(classifier, body, param):
    _, http = classifier
    r = http.post("/v1/classify", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_run_batch_takes_classify_lines(classifier):
    server, _ = classifier
    g = golden(CLASSIFIER)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/classify", "body": {"input": texts()}}
    (result,) = run_batch(server, [json.dumps(line)])
    assert result["response"]["status_code"] == 200
    probs = [d["probs"] for d in result["response"]["body"]["data"]]
    np.testing.assert_allclose(probs, g["probs"], atol=TOLERANCE)


def test_embedding_messages_need_a_chat_template(classifier):
    _, http = classifier
    r = http.post("/v1/embeddings", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert "chat template" in r.json()["error"]["message"]


def test_an_embedding_model_and_a_generation_model_refuse_classify():
    config = {**ENCODER_ENGINE, "model": str(ENCODERS / "bert_embed")}
    with tiny_server("be", **config) as server, httpx.Client(base_url=server.url) as http:
        r = http.post("/classify", json={"input": "a"})
        assert r.status_code == 400, r.text
        assert "cannot classify" in r.json()["error"]["message"]
    with tiny_server("gen", **SMALL_ENGINE) as server, httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/classify", json={"input": "a"})
        assert r.status_code == 400, r.text
        assert "--runner pooling" in r.json()["error"]["message"]


# -- chat-style input for /v1/embeddings ------------------------------------------------------


def test_embedding_messages_are_rendered_with_the_chat_template():
    config = {
        **DECODER_ENGINE,
        "model": str(EMBEDDINGS / "qwen3_last"),
        "runner": "pooling",
        "chat_template": TEMPLATE,
    }
    messages = [
        {"role": "system", "content": "Embed the question."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    rendered = "system: Embed the question.\nuser: What is the capital of France?\n"
    with tiny_server("emb", **config) as server, httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/embeddings", json={"messages": messages})
        assert r.status_code == 200, r.text
        # the template writes the text; no special tokens are added (vLLM's default for chat)
        text = http.post("/v1/embeddings", json={"input": rendered, "add_special_tokens": False})
        np.testing.assert_allclose(
            r.json()["data"][0]["embedding"], text.json()["data"][0]["embedding"], atol=1e-6
        )
        assert r.json()["usage"] == text.json()["usage"]
        prompted = http.post(
            "/v1/embeddings", json={"messages": messages, "add_generation_prompt": True}
        )
        with_prompt = http.post(
            "/v1/embeddings", json={"input": rendered + "assistant:", "add_special_tokens": False}
        )
        np.testing.assert_allclose(
            prompted.json()["data"][0]["embedding"],
            with_prompt.json()["data"][0]["embedding"],
            atol=1e-6,
        )
        for body, param in [
            ({"messages": messages, "input": "a"}, "messages"),
            ({"model": "emb"}, "input"),
            ({"messages": []}, "messages"),
        ]:
            r = http.post("/v1/embeddings", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        wait_idle(server.engine)


def test_the_openapi_spec_lists_classify_and_embedding_messages(classifier):
    _, http = classifier
    spec = http.get("/openapi.json").json()
    for path in ("/v1/classify", "/classify"):
        assert path in spec["paths"]
    schemas = spec["components"]["schemas"]
    assert set(schemas["ClassificationResponse"]["properties"]["data"]["items"]["required"]) == {
        "index",
        "label",
        "probs",
        "num_classes",
    }
    assert "messages" in schemas["EmbeddingRequest"]["properties"]
