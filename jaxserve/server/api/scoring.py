"""The bodies of ``/v1/score`` and ``/v1/rerank`` (vLLM's, which follow Jina's and Cohere's rerank
APIs): the request parsed into (query, document) pairs, and the scores shaped into the answer.

``/v1/score`` pairs its two sides as vLLM does: one text against each of N (1:N), or N texts
pairwise (N:N, the same length), under any of vLLM's spellings of the two sides (``queries`` with
``documents`` or ``items``, ``text_1`` with ``text_2``, ``data_1`` with ``data_2``).
``/v1/rerank`` scores one ``query`` against each of ``documents`` (texts, or objects with a
``text``, as Cohere and Jina send them) and answers the best ``top_n`` first (every one when
``top_n`` is 0 or absent). A problem is a 400 naming the field. The route that runs the pairs
through the engine is the scoring handler; this module does no I/O.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jaxserve.server.api.errors import bad_request
from jaxserve.server.api.fields import check_fields, integer, json_type, optional

# The names vLLM accepts for the two sides of /v1/score, first side then second.
SCORE_SIDES = (
    ("queries", "documents"),
    ("queries", "items"),
    ("text_1", "text_2"),
    ("data_1", "data_2"),
)
COMMON_FIELDS = frozenset(
    ("model", "user", "truncate_prompt_tokens", "priority", "use_activation", "activation")
)
SCORE_FIELDS = COMMON_FIELDS | {name for pair in SCORE_SIDES for name in pair}
RERANK_FIELDS = COMMON_FIELDS | {"query", "documents", "top_n", "return_documents", "instruction"}


@dataclasses.dataclass(frozen=True)
class ScoringRequest:
    model: str | None
    pairs: list[tuple[str, str]]  # (query, document), in the order of the answer's indices
    use_activation: bool  # False: the raw logit instead of sigmoid / softmax
    truncate_prompt_tokens: int | None
    priority: int
    top_n: int = 0  # rerank: how many results (0: all)
    return_documents: bool = True  # rerank: each result carries its document's text
    instruction: str | None = None  # rerank: what a decoder reranker's prompt is told


def parse_score_request(body: dict[str, Any]) -> ScoringRequest:
    check_fields(body, frozenset(SCORE_FIELDS))
    given = [pair for pair in SCORE_SIDES if pair[0] in body and pair[1] in body]
    if not given:
        raise bad_request(
            "send the two sides to score as queries and documents (or text_1 and text_2)",
            param="documents" if "queries" in body else "queries",
        )
    first_name, second_name = given[0]
    first = _texts(body[first_name], first_name)
    second = _texts(body[second_name], second_name)
    if len(first) == 1:
        pairs = [(first[0], text) for text in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second, strict=True))
    else:
        raise bad_request(
            f"{first_name} has {len(first)} texts and {second_name} {len(second)}: send one "
            f"{first_name} text to score against each, or as many as {second_name} to pair",
            param=second_name,
        )
    return ScoringRequest(body.get("model"), pairs, *_common(body))


def parse_rerank_request(body: dict[str, Any]) -> ScoringRequest:
    check_fields(body, frozenset(RERANK_FIELDS))
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request(f"query must be a string, got {json_type(query)}", param="query")
    if "documents" not in body:
        raise bad_request("documents is required: the texts to rank", param="documents")
    documents = _texts(body["documents"], "documents")
    top_n = integer(body, "top_n") or 0
    if top_n < 0:
        raise bad_request(f"top_n must be 0 (all) or more, got {top_n}", param="top_n")
    return_documents = optional(body, "return_documents", bool, "a boolean")
    return ScoringRequest(
        body.get("model"),
        [(query, document) for document in documents],
        *_common(body),
        top_n=top_n,
        return_documents=True if return_documents is None else return_documents,
        instruction=optional(body, "instruction", str, "a string"),
    )


def _common(body: dict[str, Any]) -> tuple[bool, int | None, int]:
    """(use_activation, truncate_prompt_tokens, priority)."""
    use_activation = optional(body, "use_activation", bool, "a boolean")
    if use_activation is None:  # vLLM's older name
        use_activation = optional(body, "activation", bool, "a boolean")
    truncate = integer(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < -1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the model's limit) or more, got {truncate}",
            param="truncate_prompt_tokens",
        )
    return use_activation is not False, truncate, integer(body, "priority") or 0


def _texts(value: Any, name: str) -> list[str]:
    """A text, a list of texts, or a list of ``{"text": ...}`` objects, as a list of texts."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise bad_request(f"{name} must not be empty", param=name)
    texts = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            item = item.get("text")
        if not isinstance(item, str):
            where = name if not isinstance(value, list) else f"{name}[{i}]"
            raise bad_request(
                f'{where} must be a string or {{"text": string}}, got {json_type(item)}', where
            )
        texts.append(item)
    return texts


def score_response(model: str, scores: list[float], num_prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {
            "prompt_tokens": num_prompt_tokens,
            "total_tokens": num_prompt_tokens,
            "completion_tokens": 0,
        },
    }


def rerank_response(
    model: str, req: ScoringRequest, scores: list[float], num_prompt_tokens: int
) -> dict[str, Any]:
    """The results best first (ties in the documents' order), the first ``top_n`` of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.pairs[i][1]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
        "results": results,
    }
