"""``POST /v1/score`` and ``POST /v1/rerank`` (also ``/score``, ``/rerank``, ``/v2/rerank``, as
vLLM serves them): (query, document) pairs -> one score each, through the engine.

The body is parsed by ``scoring.py`` into pairs; each pair is tokenized as the served model
scores it (``EngineClient.scoring``, ``engine/scoring.py``: a text pair with token type ids
for a cross-encoder, Qwen3-Reranker's prompt for a decoder reranker) and becomes one pooling
engine request with ``PoolingParams(task="score")``, all run together as one ``Generation``
(admission, disconnects, draining and metrics as for embeddings). The answer's usage counts
the prompt tokens. A model that cannot score answers 400 first, whatever the body holds: a
generation model naming ``--runner pooling``, an embedding model saying it cannot score pairs.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.request_checks import RequestError, check_pooling_request
from jaxserve.engine.scoring import SCORE_NEEDS_POOLING
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.api.errors import APIError, bad_request, internal_error, json_response
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.scoring import (
    ScoringRequest,
    parse_rerank_request,
    parse_score_request,
    rerank_response,
    score_response,
)
from jaxserve.server.context import ENGINE_FAILURE, OFFLOAD_BYTES, ServingContext, new_id
from jaxserve.server.generation import EngineRequest

# A pooling request samples nothing; the engine request's params are a placeholder.
_NO_SAMPLING = SamplingParams(max_tokens=1)


async def create_score(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    req, outputs = await _run(ctx, request, raw, parse_score_request, "score")
    scores, num_prompt = _scores(outputs)
    return json_response(score_response(ctx.model_name, scores, num_prompt))


async def create_rerank(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    req, outputs = await _run(ctx, request, raw, parse_rerank_request, "rerank")
    scores, num_prompt = _scores(outputs)
    return json_response(rerank_response(ctx.model_name, req, scores, num_prompt))


async def _run(
    ctx: ServingContext, request: Request, raw: bytes, parse: Any, kind: str
) -> tuple[ScoringRequest, list[RequestOutput | None]]:
    request_id = new_id(kind)
    req, engine_requests = await ctx.offload(
        len(raw) >= OFFLOAD_BYTES, _prepare, ctx, raw, parse, request_id
    )
    generation = ctx.new_generation(engine_requests, req.priority, None)
    return req, await ctx.collect(generation, request)


def refuse_if_cannot_score(ctx: ServingContext) -> None:
    """A 400 saying why, for a model that does not score pairs."""
    if ctx.engine.config.runner != "pooling":
        raise APIError(400, SCORE_NEEDS_POOLING, code="generation_model")
    scoring = getattr(ctx.engine, "scoring", None)
    if scoring is None or not scoring.can_score:
        message = scoring.refusal if scoring is not None else SCORE_NEEDS_POOLING
        raise APIError(400, message, code="model_cannot_score")


def _prepare(
    ctx: ServingContext, raw: bytes, parse: Any, request_id: str
) -> tuple[ScoringRequest, list[EngineRequest]]:
    """Body -> the request and one checked pooling engine request per pair."""
    refuse_if_cannot_score(ctx)
    req = parse(parse_json_object(raw))
    ctx.check_model(req.model)
    scoring = ctx.engine.scoring  # type: ignore[attr-defined]
    params = PoolingParams(task="score", use_activation=req.use_activation)
    truncate = req.truncate_prompt_tokens
    if truncate == -1:
        truncate = ctx.max_model_len
    engine_requests = []
    for i, (query, document) in enumerate(req.pairs):
        try:
            ids, types = scoring.tokenize_pair(
                ctx.tokenizer, query, document, req.instruction, truncate
            )
            check_pooling_request(ids, vocab_size=ctx.vocab_size, max_model_len=ctx.max_model_len)
        except RequestError as exc:
            raise APIError(400, f"pair {i}: {exc}", param=exc.param, code=exc.code) from None
        except ValueError as exc:  # the tokenizer's (a truncation that cannot be made)
            raise bad_request(f"pair {i}: {exc}", param="truncate_prompt_tokens") from None
        text = f"{query}\n{document}" if ctx.keeps_prompt_text else None
        engine_requests.append(
            EngineRequest(f"{request_id}-{i}", ids, _NO_SAMPLING, text, params, types)
        )
    return req, engine_requests


def _scores(outputs: list[RequestOutput | None]) -> tuple[list[float], int]:
    """(the score of each pair, in order; the prompt tokens of all)."""
    scores, num_prompt = [], 0
    for output in outputs:
        if output is None or output.error is not None or output.score is None:
            raise internal_error(ENGINE_FAILURE)
        scores.append(float(output.score))
        num_prompt += len(output.prompt_token_ids)
    return scores, num_prompt
