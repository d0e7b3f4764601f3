"""``POST /v1/chat/completions``: messages -> chat template (sandboxed) -> one engine request.

Parsed by ``api/protocol.parse_chat_request`` and held to the per-request limits of
``guard/cost.py`` before anything reaches the engine; ``output.py`` adds what the tool choice and
reasoning parser need to the sampling parameters and parses each choice's text into ``content``,
``reasoning_content`` and ``tool_calls``. Streams ``chat.completion.chunk`` events: one ``{"role":
"assistant"}`` chunk per choice first, then message deltas (tool calls as OpenAI streams them: id
and name first, then argument fragments), the finish reason on the last delta of each choice, and
the usage chunk when ``stream_options.include_usage`` is set.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.server.api.errors import internal_error, json_response
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.logprobs import prompt_logprobs_json
from jaxserve.server.api.protocol import ChatRequest, parse_chat_request
from jaxserve.server.chat.output import delta_json, finish_reason, message_json
from jaxserve.server.chat.tool_calls import MessageDelta
from jaxserve.server.context import (
    ENGINE_FAILURE,
    OFFLOAD_BYTES,
    OFFLOAD_ENTRIES,
    ServingContext,
    new_id,
    usage,
)
from jaxserve.server.generation import EngineRequest, Generation
from jaxserve.server.guard.cost import (
    check_num_seqs,
    check_num_tokens,
    check_response_size,
    num_response_entries,
)


async def create_chat_completion(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    chat_id = new_id("chatcmpl")
    req, engine_request, num_entries = await ctx.offload(
        len(raw) >= OFFLOAD_BYTES, _prepare, ctx, raw, chat_id
    )
    # A forced tool choice's grammar comes from the tools' parameter schemas.
    param = "tools" if req.tool_choice.is_forced else req.structured_outputs_param
    await ctx.compile_grammars([engine_request], param, request)
    generation = ctx.new_generation([engine_request], req.priority, req.cache_salt, req.model)
    writer = _ChatWriter(ctx, req, chat_id, engine_request.prompt or "")
    if req.stream:
        return await ctx.stream(generation, request, writer.events)
    (output,) = await ctx.collect(generation, request)
    return await ctx.offload(
        num_entries >= OFFLOAD_ENTRIES, lambda: json_response(writer.response(output))
    )


def _prepare(
    ctx: ServingContext, raw: bytes, chat_id: str
) -> tuple[ChatRequest, EngineRequest, int]:
    """Body -> the request, its engine request (rendered, tokenized, budgeted) and the
    response's estimated size; pure host work, run off the event loop for large bodies."""
    req = parse_chat_request(parse_json_object(raw))
    ctx.check_model(req.model)
    ctx.chat_output.check(req)
    check_num_seqs(1, req.params, ctx.settings)
    prompt = ctx.render_chat(
        req.messages, req.add_generation_prompt, req.tools, req.template_kwargs
    )
    token_ids = ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    params = ctx.check_request(
        token_ids,
        ctx.chat_output.params_for(req, req.params, prompt),
        req.max_tokens,
        None,
        "messages",
        req.max_tokens_param,
    )
    engine_request = EngineRequest(f"{chat_id}-0", token_ids, params, prompt)
    check_num_tokens([engine_request], ctx.settings, req.max_tokens_param)
    return req, engine_request, _check_response_size(ctx, req, engine_request)


def _check_response_size(ctx: ServingContext, req: ChatRequest, request: EngineRequest) -> int:
    """The response's estimated entries (``cost.num_response_entries``), within the limit."""
    # The prompt logprobs come once per response, not per choice.
    num_entries = num_response_entries(request, echo=False, num_prompt_logprobs_copies=1)
    if req.top_logprobs:
        param = "top_logprobs"
    elif req.params.prompt_logprobs is not None:
        param = "prompt_logprobs"
    else:
        param = req.max_tokens_param
    levers = f"n, {req.max_tokens_param}, top_logprobs or prompt_logprobs"
    check_response_size(num_entries, ctx.settings, param, levers)
    return num_entries


class _ChatWriter:
    def __init__(self, ctx: ServingContext, req: ChatRequest, chat_id: str, prompt: str) -> None:
        self.ctx = ctx
        self.req = req
        self.id = chat_id
        self.created = int(time.time())
        self.prompt = prompt  # the rendered chat, for the reasoning parser

    def _head(self, obj: str) -> dict[str, Any]:
        model = self.ctx.response_model(self.req.model)
        return {"id": self.id, "object": obj, "created": self.created, "model": model}

    def _logprobs(self, out: CompletionOutput) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        entries = out.logprobs or []
        return {"content": self.ctx.logprobs.chat(out.token_ids, entries, self.req.top_logprobs)}

    def _choice(self, out: CompletionOutput) -> dict[str, Any]:
        parser = self.ctx.chat_output.parser(self.req, self.prompt)
        message = parser.parse_all(out.text)
        return {
            "index": out.index,
            "message": message_json(message, self.ctx.chat_output.reasoning_parser is not None),
            "logprobs": self._logprobs(out),
            "finish_reason": finish_reason(out.finish_reason, parser),
            "stop_reason": out.stop_reason,
        }

    def response(self, output: RequestOutput | None) -> dict[str, Any]:
        if output is None:  # the client left before anything was generated
            return self._head("chat.completion")
        if output.error is not None:
            raise internal_error(ENGINE_FAILURE)
        num_completion = sum(len(out.token_ids) for out in output.outputs)
        result = {
            **self._head("chat.completion"),
            "choices": [self._choice(out) for out in output.outputs],
            "usage": usage(len(output.prompt_token_ids), num_completion, output.num_cached_tokens),
        }
        if self.req.params.prompt_logprobs is not None:
            num_prompt = len(output.prompt_token_ids)
            entries = output.prompt_logprobs
            result["prompt_logprobs"] = prompt_logprobs_json(entries and entries[:num_prompt])
        return result

    async def events(self, generation: Generation) -> AsyncGenerator[dict[str, Any]]:
        head = self._head("chat.completion.chunk")
        include_usage = self.req.include_usage

        def chunk(choice: dict[str, Any]) -> dict[str, Any]:
            event = {**head, "choices": [choice]}
            if include_usage:
                event["usage"] = None
            return event

        parsers = {}
        for index in range(self.req.params.n):
            parsers[index] = self.ctx.chat_output.parser(self.req, self.prompt)
            role = {"role": "assistant", "content": ""}
            yield chunk({"index": index, "delta": role, "logprobs": None, "finish_reason": None})
        num_completion = num_cached = 0
        async for _, delta in generation.deltas():
            num_cached = max(num_cached, delta.num_cached_tokens)
            if delta.error is not None:
                raise internal_error(ENGINE_FAILURE)
            for out in delta.outputs:
                num_completion += len(out.token_ids)
                parser = parsers[out.index]
                message = parser.feed(out.text) if out.text else MessageDelta()
                if out.finish_reason is not None:
                    message.extend(parser.finish())
                if message.is_empty and out.finish_reason is None and not out.token_ids:
                    continue
                yield chunk(
                    {
                        "index": out.index,
                        "delta": delta_json(message),
                        "logprobs": self._logprobs(out),
                        "finish_reason": finish_reason(out.finish_reason, parser),
                        "stop_reason": out.stop_reason,
                    }
                )
        if include_usage:
            num_prompt = len(generation.requests[0].prompt_token_ids)
            yield {**head, "choices": [], "usage": usage(num_prompt, num_completion, num_cached)}
