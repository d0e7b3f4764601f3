"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes ``prompt`` (text) or ``messages`` (rendered with the chat template) and
answers ``{"count", "max_model_len", "tokens"}`` (plus ``token_strs`` when asked);
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.context import ServingContext
from jaxserve.server.protocol import (
    check_token_ids,
    parse_detokenize_request,
    parse_tokenize_request,
)


async def tokenize(ctx: ServingContext, body: dict[str, Any]) -> dict[str, Any]:
    req = parse_tokenize_request(body)
    ctx.check_model(req.model)
    if req.messages is not None:
        text = ctx.render_chat(req.messages, req.add_generation_prompt, None, req.template_kwargs)
    else:
        text = req.prompt or ""
    tokens = await ctx.encode(text, req.add_special_tokens)
    result: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": ctx.max_model_len,
        "tokens": tokens,
    }
    if req.return_token_strs:
        result["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(tokens)
    return result


def detokenize(ctx: ServingContext, body: dict[str, Any]) -> dict[str, Any]:
    req = parse_detokenize_request(body)
    ctx.check_model(req.model)
    check_token_ids(req.tokens, ctx.vocab_size, "tokens")
    return {"prompt": ctx.tokenizer.decode(list(req.tokens), skip_special_tokens=False)}
