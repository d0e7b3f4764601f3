"""``POST /v1/completions``: prompts (text, token ids, or a batch of either) -> text_completion.

Parsed by ``protocol.parse_completion_request`` and held to the per-request limits of
``guard/cost.py`` before anything reaches the engine; each prompt becomes one engine request, and
choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's order). Streams as
``text_completion`` chunks; ``echo`` puts the prompt (and, with ``logprobs``, its logprobs)
before the first chunk of each choice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import RequestOutput
from jaxserve.server.api.errors import internal_error, json_response
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.logprobs import prompt_logprobs_json
from jaxserve.server.api.protocol import CompletionRequest, parse_completion_request
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


async def create_completion(ctx: ServingContext, request: Request, raw: bytes) -> Response:
    completion_id = new_id("cmpl")
    req, engine_requests, num_entries = await ctx.offload(
        len(raw) >= OFFLOAD_BYTES, _prepare, ctx, raw, completion_id
    )
    await ctx.compile_grammars(engine_requests, req.structured_outputs_param, request)
    generation = ctx.new_generation(engine_requests, req.priority, req.cache_salt, req.model)
    writer = _CompletionWriter(ctx, req, completion_id)
    if req.stream:
        return await ctx.stream(generation, request, writer.events)
    outputs = await ctx.collect(generation, request)
    return await ctx.offload(
        num_entries >= OFFLOAD_ENTRIES,
        lambda: json_response(writer.response(engine_requests, outputs)),
    )


def _prepare(
    ctx: ServingContext, raw: bytes, completion_id: str
) -> tuple[CompletionRequest, list[EngineRequest], int]:
    """Body -> the request, one engine request per prompt (tokenized, checked, budgeted), and
    the response's estimated size; pure host work, run off the event loop for large bodies."""
    req = parse_completion_request(parse_json_object(raw))
    ctx.check_model(req.model)
    check_num_seqs(len(req.prompts), req.params, ctx.settings)
    engine_requests = []
    for i, prompt in enumerate(req.prompts):
        text: str | None = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            token_ids = ctx.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        else:
            token_ids = list(prompt)
        params = ctx.check_request(
            token_ids, req.params, req.max_tokens, req.default_max_tokens, "prompt", "max_tokens"
        )
        if text is None and (req.echo or ctx.keeps_prompt_text):
            text = ctx.tokenizer.decode(token_ids, skip_special_tokens=False)
        engine_requests.append(EngineRequest(f"{completion_id}-{i}", token_ids, params, text))
    check_num_tokens(engine_requests, ctx.settings, "max_tokens")
    return req, engine_requests, _check_response_size(ctx, req, engine_requests)


def _check_response_size(
    ctx: ServingContext, req: CompletionRequest, requests: list[EngineRequest]
) -> int:
    """The response's estimated entries (``cost.num_response_entries``), within the limit."""
    # Each choice carries its own copy of the echoed prompt and of the prompt logprobs.
    copies = req.params.n if req.return_prompt_logprobs else 0
    num_entries = sum(num_response_entries(r, req.echo, copies) for r in requests)
    if req.params.logprobs:
        param = "logprobs"
    elif req.return_prompt_logprobs:
        param = "prompt_logprobs"
    else:
        param = "echo" if req.echo else "max_tokens"
    levers = "n, max_tokens, logprobs or prompt_logprobs, or turn echo off"
    check_response_size(num_entries, ctx.settings, param, levers)
    return num_entries


class _CompletionWriter:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, completion_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.id = completion_id
        self.created = int(time.time())
        self.num_top = req.params.logprobs

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.response_model(self.req.model),
        }

    def _echo_entries(self, request: EngineRequest) -> int:
        """The echoed prompt's share of ``cost.num_response_entries``, for one choice."""
        return len(request.prompt_token_ids) * (1 + (self.num_top or 0))

    def _echo(self, request: EngineRequest, prompt_logprobs: Any) -> tuple[str, Any, int]:
        """The echoed prompt: its text, its logprobs (or None), and the offset after it."""
        text = request.prompt or ""
        if self.num_top is None:
            return text, None, len(text)
        num_prompt = len(request.prompt_token_ids)
        # NOTE: sliced, as the engine may keep appending to the list it delivered.
        entries = list(prompt_logprobs[:num_prompt]) if prompt_logprobs else [None] * num_prompt
        logprobs, offset = self.ctx.logprobs.completion(
            request.prompt_token_ids, entries, self.num_top, 0
        )
        return text, logprobs, offset

    # -- one JSON response -----------------------------------------------------------------

    def response(
        self, requests: list[EngineRequest], outputs: list[RequestOutput | None]
    ) -> dict[str, Any]:
        n = self.req.params.n
        choices = []
        num_prompt = num_completion = num_cached = 0
        for i, (request, output) in enumerate(zip(requests, outputs, strict=True)):
            if output is None:  # the client left before this prompt started
                continue
            if output.error is not None:
                raise internal_error(ENGINE_FAILURE)
            num_prompt += len(output.prompt_token_ids)
            num_cached += output.num_cached_tokens
            for out in output.outputs:
                num_completion += len(out.token_ids)
                text, logprobs, offset = "", None, 0
                if self.req.echo:
                    text, logprobs, offset = self._echo(request, output.prompt_logprobs)
                if self.num_top is not None:
                    generated, _ = self.ctx.logprobs.completion(
                        out.token_ids, out.logprobs or [], self.num_top, offset
                    )
                    if logprobs is None:
                        logprobs = generated
                    else:
                        for key in logprobs:
                            logprobs[key].extend(generated[key])
                choice = {
                    "index": i * n + out.index,
                    "text": text + out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
                if self.req.return_prompt_logprobs:
                    entries = output.prompt_logprobs
                    num_prompt_tokens = len(output.prompt_token_ids)
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        entries and entries[:num_prompt_tokens]
                    )
                choices.append(choice)
        return {
            **self._head(),
            "choices": choices,
            "usage": usage(num_prompt, num_completion, num_cached),
        }

    # -- server-sent events ----------------------------------------------------------------

    async def events(self, generation: Generation) -> AsyncGenerator[dict[str, Any]]:
        n = self.req.params.n
        include_usage = self.req.include_usage
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        prompt_logprobs: dict[int, Any] = {}
        num_completion = 0
        num_cached: dict[int, int] = {}
        async for i, delta in generation.deltas():
            request = generation.requests[i]
            num_cached[i] = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                prompt_logprobs[i] = delta.prompt_logprobs
            if delta.error is not None:
                raise internal_error(ENGINE_FAILURE)
            for out in delta.outputs:
                index = i * n + out.index
                num_completion += len(out.token_ids)
                text, logprobs = out.text, None
                offset = offsets.get(index, 0)
                if self.req.echo and index not in echoed:
                    echoed.add(index)
                    prompt_text, logprobs, offset = await self.ctx.offload(
                        self._echo_entries(request) >= OFFLOAD_ENTRIES,
                        self._echo,
                        request,
                        prompt_logprobs.get(i),
                    )
                    text = prompt_text + text
                if self.num_top is not None:
                    generated, offset = self.ctx.logprobs.completion(
                        out.token_ids, out.logprobs or [], self.num_top, offset
                    )
                    if logprobs is None:
                        logprobs = generated
                    else:
                        for key in logprobs:
                            logprobs[key].extend(generated[key])
                offsets[index] = offset
                if not text and out.finish_reason is None and not out.token_ids:
                    continue
                chunk = {
                    **self._head(),
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason,
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = None
                yield chunk
        if include_usage:
            num_prompt = sum(len(r.prompt_token_ids) for r in generation.requests)
            total = usage(num_prompt, num_completion, sum(num_cached.values()))
            yield {**self._head(), "choices": [], "usage": total}
