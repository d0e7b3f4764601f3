"""``POST /classify`` and ``/v1/classify`` (vLLM's classification API): texts -> each label's
probability from a sequence classifier, with the likeliest label's name.

Served by a ``*ForSequenceClassification`` encoder started for pooling (docs/embeddings.md); a
generation model, and a pooling model without a classifier, answer 400 first, whatever the body
holds. The body (``input``: a text, token ids, or a list of either, as ``/v1/embeddings`` takes
it; ``add_special_tokens``, ``use_activation`` (vLLM's older ``activation``), ``priority``,
``user``) is checked here; each input becomes one pooling engine request with
``PoolingParams(task="classify")``, all run together as one ``Generation``. The probabilities
come from the engine (``RequestOutput.probs``); the label names from the model's config.json
``id2label`` (``ScoringModel.labels``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.scoring import CLASSIFY_NEEDS_POOLING
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.api.embeddings import input_items, pooling_requests
from jaxserve.server.api.errors import APIError, internal_error, json_response
from jaxserve.server.api.fields import boolean, check_fields, integer, optional, parse_json_object
from jaxserve.server.context import ENGINE_FAILURE, OFFLOAD_BYTES, ServingContext, new_id
from jaxserve.server.generation import EngineRequest

CLASSIFY_FIELDS = frozenset(
    ("model", "input", "user", "priority", "add_special_tokens", "use_activation", "activation")
)
# A pooling request samples nothing; the engine request's params are a placeholder.
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclasses.dataclass(frozen=True)
class ClassificationRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    use_activation: bool  # False: the raw logits instead of probabilities
    add_special_tokens: bool
    priority: int


def parse_classification_request(body: dict[str, Any]) -> ClassificationRequest:
    check_fields(body, CLASSIFY_FIELDS)
    optional(body, "user", str, "a string")
    use_activation = optional(body, "use_activation", bool, "a boolean")
    if use_activation is None:  # vLLM's older name
        use_activation = optional(body, "activation", bool, "a boolean")
    return ClassificationRequest(
        model=optional(body, "model", str, "a string"),
        inputs=input_items(body.get("input")),
        use_activation=use_activation is not False,
        add_special_tokens=boolean(body, "add_special_tokens", True),
        priority=integer(body, "priority") or 0,
    )


def refuse_if_cannot_classify(ctx: ServingContext) -> tuple[str, ...]:
    """The model's label names; a 400 saying why for a model that does not classify."""
    if ctx.engine.config.runner != "pooling":
        raise APIError(400, CLASSIFY_NEEDS_POOLING, code="generation_model")
    scoring = getattr(ctx.engine, "scoring", None)
    if scoring is None or not scoring.can_classify:
        message = scoring.classify_refusal if scoring is not None else CLASSIFY_NEEDS_POOLING
        raise APIError(400, message, code="model_cannot_classify")
    return tuple(scoring.labels)


async def create_classification(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    request_id = new_id("classify")
    req, labels, engine_requests = await ctx.offload(
        len(raw) >= OFFLOAD_BYTES, _prepare, ctx, raw, request_id
    )
    generation = ctx.new_generation(engine_requests, req.priority, None)
    outputs = await ctx.collect(generation, request)
    return json_response(classification_response(ctx.model_name, request_id, labels, outputs))


def _prepare(
    ctx: ServingContext, raw: bytes, request_id: str
) -> tuple[ClassificationRequest, tuple[str, ...], list[EngineRequest]]:
    """Body -> the request, the label names and one checked pooling request per input."""
    labels = refuse_if_cannot_classify(ctx)
    req = parse_classification_request(parse_json_object(raw))
    ctx.check_model(req.model)
    params = PoolingParams(task="classify", use_activation=req.use_activation)
    engine_requests = pooling_requests(ctx, req.inputs, req.add_special_tokens, request_id, params)
    return req, labels, engine_requests


def classification_response(
    model: str,
    request_id: str,
    labels: tuple[str, ...],
    outputs: list[RequestOutput | None],
) -> dict[str, Any]:
    """vLLM's ``ClassificationResponse``: per input its probabilities, in label id order, and
    the name of the likeliest label."""
    data = []
    num_prompt = 0
    for i, output in enumerate(outputs):
        if output is None or output.error is not None or output.probs is None:
            raise internal_error(ENGINE_FAILURE)
        num_prompt += len(output.prompt_token_ids)
        probs = [float(p) for p in output.probs]
        best = max(range(len(probs)), key=probs.__getitem__)
        label = labels[best] if best < len(labels) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt, "completion_tokens": 0},
    }
