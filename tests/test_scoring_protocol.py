"""The bodies of /v1/score and /v1/rerank (server/api/scoring.py): pairing, the spellings vLLM
accepts, the 400s, and the answers' shapes and order."""

from __future__ import annotations

import pytest

from jaxserve.server.api.errors import APIError
from jaxserve.server.api.scoring import (
    parse_rerank_request,
    parse_score_request,
    rerank_response,
    score_response,
)


@pytest.mark.parametrize(
    "sides",
    [("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2")],
)
def test_score_pairs_one_against_many_under_each_spelling(sides):
    req = parse_score_request({"model": "m", sides[0]: "q", sides[1]: ["a", {"text": "b"}]})
    assert req.pairs == [("q", "a"), ("q", "b")]
    assert req.use_activation and req.model == "m"


def test_score_pairs_n_texts_pairwise():
    req = parse_score_request({"text_1": ["q1", "q2"], "text_2": ["a", "b"]})
    assert req.pairs == [("q1", "a"), ("q2", "b")]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text_1": ["q1", "q2"], "text_2": ["a", "b", "c"]}, "text_2"),
        ({"queries": "q"}, "documents"),
        ({"text_1": [], "text_2": "a"}, "text_1"),
        ({"text_1": "q", "text_2": [1]}, "text_2[0]"),
        ({"text_1": "q", "text_2": "a", "nope": 1}, "nope"),
        ({"text_1": "q", "text_2": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"text_1": "q", "text_2": "a", "use_activation": "yes"}, "use_activation"),
    ],
)
def test_score_bad_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_score_request(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_rerank_orders_best_first_and_cuts_at_top_n():
    req = parse_rerank_request({"query": "q", "documents": ["a", {"text": "b"}, "c"], "top_n": 2})
    assert req.pairs == [("q", "a"), ("q", "b"), ("q", "c")]
    body = rerank_response("m", req, [0.1, 0.9, 0.5], 30)
    assert [r["index"] for r in body["results"]] == [1, 2]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    assert body["usage"] == {"prompt_tokens": 30, "total_tokens": 30}
    assert body["id"].startswith("rerank-") and body["model"] == "m"
    everything = parse_rerank_request(
        {"query": "q", "documents": ["a", "b"], "return_documents": False}
    )
    results = rerank_response("m", everything, [0.5, 0.5], 4)["results"]
    assert [r["index"] for r in results] == [0, 1] and "document" not in results[0]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": []}, "documents"),
    ],
)
def test_rerank_bad_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_rerank_request(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_score_answer_shape():
    body = score_response("m", [0.25, 0.75], 12)
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert body["data"] == [
        {"index": 0, "object": "score", "score": 0.25},
        {"index": 1, "object": "score", "score": 0.75},
    ]
    assert body["usage"]["prompt_tokens"] == 12
