"""``POST /v1/embeddings``: texts or token ids -> one embedding each, in OpenAI's shape; or, as
vLLM takes it, chat ``messages`` rendered with the model's chat template -> one embedding.

Served by a model started with ``--runner pooling`` (docs/embeddings.md); a generation model
answers 400 naming the flag. The body (``input``: a text, token ids, or a list of either;
``encoding_format`` ``float`` or ``base64``; ``dimensions``; ``user``; vLLM's ``normalize``,
``add_special_tokens``, ``priority``; or ``messages`` with ``add_generation_prompt``, default
false) is checked here; each input becomes one pooling engine
request (``EngineClient.encode``), run together as one ``Generation`` (admission, disconnects,
draining and metrics as for completions). ``base64`` is the little-endian float32 bytes, as the
OpenAI SDK decodes them.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.request_checks import POOLING_REFUSED, RequestError, check_pooling_request
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server.api.errors import APIError, bad_request, internal_error, json_response
from jaxserve.server.api.fields import (
    boolean,
    check_fields,
    integer,
    json_type,
    optional,
    parse_json_object,
)
from jaxserve.server.chat.messages import parse_messages
from jaxserve.server.context import ENGINE_FAILURE, OFFLOAD_BYTES, ServingContext, new_id
from jaxserve.server.generation import EngineRequest

MAX_EMBEDDING_INPUTS = 2048  # inputs in one request: OpenAI's limit
ENCODING_FORMATS = ("float", "base64")
EMBEDDING_FIELDS = frozenset(
    (
        "model",
        "input",
        "encoding_format",
        "dimensions",
        "user",
        "normalize",
        "add_special_tokens",
        "priority",
        "messages",
        "add_generation_prompt",
    )
)
NO_CHAT_TEMPLATE = (
    "messages needs a chat template and this model's tokenizer has none; send the text as "
    "input (or start the server with --chat-template)"
)
# A pooling request samples nothing; the engine request's params are a placeholder.
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str
    params: PoolingParams
    add_special_tokens: bool
    priority: int
    # Chat-style input (vLLM's): messages rendered with the chat template, instead of inputs
    messages: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = False


def parse_embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    check_fields(body, EMBEDDING_FIELDS)
    has_messages = body.get("messages") is not None
    if has_messages == (body.get("input") is not None):
        raise bad_request(
            "send exactly one of input (texts or token ids) or messages (a chat to render with "
            "the model's chat template)",
            param="input" if not has_messages else "messages",
        )
    optional(body, "user", str, "a string")
    encoding_format = optional(body, "encoding_format", str, "a string") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise bad_request(
            f"encoding_format={encoding_format!r} must be one of {', '.join(ENCODING_FORMATS)}",
            param="encoding_format",
        )
    try:
        params = PoolingParams(
            dimensions=integer(body, "dimensions"),
            normalize=optional(body, "normalize", bool, "a boolean"),
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return EmbeddingRequest(
        model=optional(body, "model", str, "a string"),
        inputs=() if has_messages else input_items(body.get("input")),
        encoding_format=encoding_format,
        params=params,
        # the chat template writes the special tokens itself
        add_special_tokens=boolean(body, "add_special_tokens", not has_messages),
        priority=integer(body, "priority") or 0,
        messages=parse_messages(body["messages"]) if has_messages else None,
        add_generation_prompt=boolean(body, "add_generation_prompt", False),
    )


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def input_items(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """``input`` as OpenAI accepts it: a text, token ids, or a list of either (not empty)."""
    if value is None:
        raise bad_request("you must provide an input", param="input")
    if isinstance(value, str) or (isinstance(value, list) and value and _is_token_list(value)):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise bad_request("input must not be empty", param="input")
    else:
        raise bad_request(
            "input must be a string, an array of token ids, or an array of either; "
            f"got {json_type(value)}",
            param="input",
        )
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"input has {len(items)} entries; at most {MAX_EMBEDDING_INPUTS} are allowed",
            param="input",
        )
    result: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            result.append(item)
        elif isinstance(item, list) and item and _is_token_list(item):
            result.append(tuple(item))
        elif item == "" or item == []:
            raise bad_request(f"input[{i}] is empty", param="input")
        else:
            raise bad_request(
                f"input[{i}] must be a string or an array of integer token ids", param="input"
            )
    return tuple(result)


async def create_embedding(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    embedding_id = new_id("embd")
    req, engine_requests = await ctx.offload(
        len(raw) >= OFFLOAD_BYTES, _prepare, ctx, raw, embedding_id
    )
    generation = ctx.new_generation(engine_requests, req.priority, None)
    outputs = await ctx.collect(generation, request)
    return json_response(_response(ctx, req, embedding_id, outputs))


def _prepare(
    ctx: ServingContext, raw: bytes, embedding_id: str
) -> tuple[EmbeddingRequest, list[EngineRequest]]:
    """Body -> the request and one checked pooling engine request per input; a generation
    model answers 400 naming --runner pooling whatever the body holds."""
    if ctx.engine.config.runner != "pooling":
        raise APIError(400, POOLING_REFUSED, code="generation_model")
    req = parse_embedding_request(parse_json_object(raw))
    ctx.check_model(req.model)
    inputs = _rendered_inputs(ctx, req)
    return req, pooling_requests(ctx, inputs, req.add_special_tokens, embedding_id, req.params)


def pooling_requests(
    ctx: ServingContext,
    inputs: Sequence[str | Sequence[int]],  # texts or token ids
    add_special_tokens: bool,
    request_id: str,
    params: PoolingParams,
) -> list[EngineRequest]:
    """One engine request per input (``{request_id}-{i}``), tokenized and checked against the
    vocabulary and the model's length; a failed check is a 400 naming ``input[i]``."""
    engine_requests = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            token_ids = ctx.tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            token_ids = list(item)
        try:
            check_pooling_request(
                token_ids, vocab_size=ctx.vocab_size, max_model_len=ctx.max_model_len
            )
        except RequestError as exc:
            raise APIError(400, f"input[{i}]: {exc}", param=exc.param, code=exc.code) from None
        text = item if isinstance(item, str) and ctx.keeps_prompt_text else None
        engine_requests.append(
            EngineRequest(f"{request_id}-{i}", token_ids, _NO_SAMPLING, text, params)
        )
    return engine_requests


def _rendered_inputs(
    ctx: ServingContext, req: EmbeddingRequest
) -> tuple[str | tuple[int, ...], ...]:
    """The inputs to embed: ``input``'s, or the one text the chat template makes of
    ``messages`` (a model without a chat template: 400)."""
    if req.messages is None:
        return req.inputs
    if ctx.tokenizer.chat_template is None:
        raise bad_request(NO_CHAT_TEMPLATE, param="messages")
    return (ctx.render_chat(req.messages, req.add_generation_prompt, None, {}),)


def _response(
    ctx: ServingContext,
    req: EmbeddingRequest,
    embedding_id: str,
    outputs: list[RequestOutput | None],
) -> dict[str, Any]:
    data = []
    num_prompt = 0
    for i, output in enumerate(outputs):
        if output is None or output.error is not None or output.embedding is None:
            raise internal_error(ENGINE_FAILURE)
        num_prompt += len(output.prompt_token_ids)
        data.append({"object": "embedding", "index": i, "embedding": encode(output.embedding, req)})
    return {
        "id": embedding_id,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt},
    }


def encode(embedding: np.ndarray, req: EmbeddingRequest) -> list[float] | str:
    """A vector as ``encoding_format`` says: floats, or base64 of little-endian float32."""
    if req.encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in embedding]
