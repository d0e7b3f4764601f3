"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes ``prompt`` (text) or ``messages`` (rendered with the chat template) and
answers ``{"count", "max_model_len", "tokens"}`` (plus ``token_strs`` when asked);
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. Both are plain host work from the
body bytes to the response; ``app.py`` runs them on the host-work thread when the body is large.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from jaxserve.server.api.errors import json_response
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.protocol import (
    check_token_ids,
    parse_detokenize_request,
    parse_tokenize_request,
)
from jaxserve.server.context import ServingContext


def tokenize(ctx: ServingContext, raw: bytes) -> Response:
    req = parse_tokenize_request(parse_json_object(raw))
    ctx.check_model(req.model)
    if req.messages is not None:
        text = ctx.render_chat(req.messages, req.add_generation_prompt, None, req.template_kwargs)
    else:
        text = req.prompt or ""
    tokens = ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    result: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": ctx.max_model_len,
        "tokens": tokens,
    }
    if req.return_token_strs:
        result["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(tokens)
    return json_response(result)


def detokenize(ctx: ServingContext, raw: bytes) -> Response:
    req = parse_detokenize_request(parse_json_object(raw))
    ctx.check_model(req.model)
    check_token_ids(req.tokens, ctx.vocab_size, "tokens")
    text = ctx.tokenizer.decode(list(req.tokens), skip_special_tokens=False)
    return json_response({"prompt": text})
