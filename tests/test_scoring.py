"""Encoders served by the pooling runner, and scoring: embeddings of BERT / XLM-RoBERTa equal
sentence-transformers' (``scripts/make_encoder_golden.py``); cross-encoder scores and rerank
order equal ``CrossEncoder.predict``'s; a Qwen3-Reranker-style decoder's score equals its model
card's (``scripts/make_reranker_golden.py``); ``/v1/score`` (1:N, N:N) and ``/v1/rerank``
(``top_n``, ``return_documents``, the other paths vLLM serves), usage, run-batch lines; the
refusals (a generation model, an embedding model, ``--runner generate`` on an encoder, a token
budget below ``max_model_len``, unknown ``--hf-overrides`` keys)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import jaxserve
from jaxserve.engine.core import EngineCore
from jaxserve.engine_config import EngineConfig
from jaxserve.models.scoring import ScoringConfigError
from jaxserve.server.launch.flags import add_launch_arguments, engine_config_from_args
from tests.conftest import SMALL_ENGINE, tiny_server, wait_idle
from tests.test_embeddings_api import run_batch

FIXTURES = Path(__file__).parent / "fixtures"
ENCODERS = FIXTURES / "encoders"
RERANKER = FIXTURES / "rerankers" / "qwen3_reranker"
TOLERANCE = 1e-4
# Encoders: one token bucket per step size up to 64 (XLM-R holds 62 tokens a sequence).
ENCODER_ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, warmup=False)
OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# The reranker's prompts (220-300 tokens) run in chunks of 128 tokens, like any prefill.
RERANKER_ENGINE = dict(
    dtype="float32",
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    block_size=16,
    num_gpu_blocks_override=128,
    warmup=False,
    hf_overrides=OVERRIDES,
)


def golden(path: Path) -> dict[str, np.ndarray]:
    return dict(np.load(path / "golden.npz"))


def ranked(scores) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


# -- the engine (LLM) -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert_embed", "xlmr_embed"])
def test_encoder_embeddings_equal_sentence_transformers(name):
    g = golden(ENCODERS / name)
    texts = [str(t) for t in g["texts"]]
    # six copies in one step of up to 512 tokens: the attention's tiled path (T > 2 x 64)
    wide = {**ENCODER_ENGINE, "max_num_batched_tokens": 512, "max_num_seqs": 32}
    llm = jaxserve.LLM(str(ENCODERS / name), **wide)
    assert llm.engine.config.runner == "pooling"  # --runner auto pools an encoder
    outputs = llm.embed(texts * 6, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, np.tile(g["embeddings"], (6, 1)), atol=TOLERANCE)
    lens = np.diff(g["cu_seq_lens"]).tolist()
    assert [o.num_prompt_tokens for o in outputs[:4]] == lens
    assert llm.engine.num_steps == 1  # every prompt whole, in one step


def test_cross_encoder_scores_logits_and_order_equal_the_golden():
    g = golden(ENCODERS / "xlmr_cross_encoder")
    llm = jaxserve.LLM(str(ENCODERS / "xlmr_cross_encoder"), **ENCODER_ENGINE)
    documents = [str(d) for d in g["documents"]]
    scores = [o.outputs.score for o in llm.score(str(g["query"]), documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, g["scores"], atol=TOLERANCE)
    assert ranked(scores) == ranked(g["scores"])
    raw = llm.score([str(g["query"])] * 4, documents, use_activation=False, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in raw], g["logits"], atol=TOLERANCE)
    # the pairs as the tokenizer encodes them: <s> q </s></s> d </s>
    flat = [t for o in raw for t in o.prompt_token_ids]
    assert flat == g["input_ids"].tolist()
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 4"):
        llm.score(["a", "b"], documents)


def test_decoder_reranker_scores_equal_the_model_card(tmp_path: Path):
    g = golden(RERANKER)
    documents = [str(d) for d in g["documents"]]
    # config.json naming the classifier itself, without --hf-overrides
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(RERANKER / name)
    (tmp_path / "config.json").unlink()
    raw = json.loads((RERANKER / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **OVERRIDES}))
    llm = jaxserve.LLM(str(tmp_path), **{**RERANKER_ENGINE, "hf_overrides": None})
    outputs = llm.score(str(g["query"]), documents, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outputs], g["default_scores"], atol=1e-5)
    for row, output in enumerate(outputs):  # Qwen3-Reranker's prompt, token for token
        expected = g["default_token_ids"][row, : g["default_num_tokens"][row]].tolist()
        assert output.prompt_token_ids == expected


# -- refusals at start ------------------------------------------------------------------------


def test_an_encoder_refuses_the_generate_runner():
    config = EngineConfig(model=str(ENCODERS / "bert_embed"), runner="generate", warmup=False)
    with pytest.raises(ValueError, match="--runner generate.*encoder.*--runner pooling"):
        EngineCore(config)


def test_an_encoder_needs_a_token_budget_of_max_model_len():
    config = EngineConfig(
        model=str(ENCODERS / "bert_embed"), max_model_len=64, max_num_batched_tokens=32
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 is less than max_model_len=64"):
        EngineCore(config)
    too_long = EngineConfig(model=str(ENCODERS / "bert_embed"), max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len=128 is longer than the 64 positions"):
        EngineCore(too_long)


def test_hf_overrides_serve_the_reranker_keys_only():
    config = EngineConfig(model=str(RERANKER), hf_overrides={"rope_theta": 1.0})
    with pytest.raises(ScoringConfigError, match="rope_theta not served"):
        EngineCore(config)
    half = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no"]}
    with pytest.raises(ScoringConfigError, match="two token strings"):
        EngineCore(EngineConfig(model=str(RERANKER), hf_overrides=half))


def test_the_flags_spell_the_reranker_as_vllm_does():
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(
        [str(RERANKER), "--task", "score", "--hf-overrides", json.dumps(OVERRIDES)]
    )
    config = engine_config_from_args(args)
    assert config.runner == "pooling" and config.hf_overrides == OVERRIDES
    with pytest.raises(SystemExit):
        parser.parse_args([str(RERANKER), "--hf-overrides", "[1]"])


# -- HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder():
    config = {**ENCODER_ENGINE, "model": str(ENCODERS / "bert_cross_encoder")}
    with tiny_server("ce", **config) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield server, c


def test_rerank_orders_by_the_cross_encoder_golden(cross_encoder):
    server, http = cross_encoder
    g = golden(ENCODERS / "bert_cross_encoder")
    documents = [str(d) for d in g["documents"]]
    body = {"model": "ce", "query": str(g["query"]), "documents": documents}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == ranked(g["scores"])
        scores = {x["index"]: x["relevance_score"] for x in results}
        np.testing.assert_allclose([scores[i] for i in range(4)], g["scores"], atol=TOLERANCE)
        assert results[0]["document"] == {"text": documents[results[0]["index"]]}
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == usage["total_tokens"] == len(g["input_ids"])
    top = http.post("/v1/rerank", json={**body, "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == ranked(g["scores"])[:2]
    assert all("document" not in x for x in top["results"])
    objects = [{"text": d} for d in documents]  # Cohere's and Jina's documents
    raw = http.post("/v1/rerank", json={**body, "documents": objects, "use_activation": False})
    logits = {x["index"]: x["relevance_score"] for x in raw.json()["results"]}
    np.testing.assert_allclose([logits[i] for i in range(4)], g["logits"], atol=TOLERANCE)
    wait_idle(server.engine)


def test_score_pairs_one_to_many_and_pairwise(cross_encoder):
    _, http = cross_encoder
    g = golden(ENCODERS / "bert_cross_encoder")
    query, documents = str(g["query"]), [str(d) for d in g["documents"]]
    for path in ("/v1/score", "/score"):
        r = http.post(path, json={"text_1": query, "text_2": documents})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2, 3]
        np.testing.assert_allclose([d["score"] for d in data], g["scores"], atol=TOLERANCE)
    pairwise = http.post(
        "/v1/score", json={"queries": [query, documents[0]], "documents": documents[2:]}
    ).json()
    np.testing.assert_allclose(pairwise["data"][0]["score"], g["scores"][2], atol=TOLERANCE)
    assert len(pairwise["data"]) == 2 and pairwise["usage"]["prompt_tokens"] > 0
    r = http.post("/v1/score", json={"text_1": [query] * 2, "text_2": documents})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"


def test_run_batch_takes_score_and_rerank_lines(cross_encoder):
    server, _ = cross_encoder
    g = golden(ENCODERS / "bert_cross_encoder")
    query, documents = str(g["query"]), [str(d) for d in g["documents"]]

    def line(custom_id: str, url: str, **body) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    results = run_batch(
        server,
        [
            line("score", "/v1/score", text_1=query, text_2=documents[:2]),
            line("rerank", "/v1/rerank", query=query, documents=documents, top_n=1),
        ],
    )
    by_id = {r["custom_id"]: r["response"] for r in results}
    assert by_id["score"]["status_code"] == 200 and by_id["rerank"]["status_code"] == 200
    scores = [d["score"] for d in by_id["score"]["body"]["data"]]
    np.testing.assert_allclose(scores, g["scores"][:2], atol=TOLERANCE)
    assert by_id["rerank"]["body"]["results"][0]["index"] == ranked(g["scores"])[0]


def test_an_embedding_encoder_serves_embeddings_and_cannot_score():
    g = golden(ENCODERS / "bert_embed")
    config = {**ENCODER_ENGINE, "model": str(ENCODERS / "bert_embed")}
    with tiny_server("be", **config) as server, httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/embeddings", json={"input": [str(t) for t in g["texts"]]})
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        np.testing.assert_allclose(got, g["embeddings"], atol=TOLERANCE)
        for path, body in [
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "cannot score pairs" in r.json()["error"]["message"]


def test_a_generation_model_refuses_scores_naming_the_runner():
    with tiny_server("gen", **SMALL_ENGINE) as server, httpx.Client(base_url=server.url) as http:
        for path, body in [
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "--runner pooling" in r.json()["error"]["message"]


def test_reranker_over_http_with_an_instruction():
    g = golden(RERANKER)
    documents = [str(d) for d in g["documents"]]
    config = {**RERANKER_ENGINE, "model": str(RERANKER)}
    with tiny_server("rr", **config) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"query": str(g["query"]), "documents": documents}
        r = c.post("/v1/rerank", json={**body, "instruction": str(g["instruction"])})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == ranked(g["custom_scores"])
        scores = {x["index"]: x["relevance_score"] for x in results}
        np.testing.assert_allclose([scores[i] for i in range(4)], g["custom_scores"], atol=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == int(g["custom_num_tokens"].sum())
        wait_idle(server.engine)
