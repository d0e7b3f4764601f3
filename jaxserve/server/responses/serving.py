"""``/v1/responses``: create (JSON, server-sent events, or in the background), retrieve, delete
and cancel.

``app.py`` routes here. A create request is parsed by ``protocol.py`` into a chat request over
the conversation (a chained one's earlier turns from ``store.py``), then served as chat serves
one: the chat template, the per-request limits of ``guard/cost.py``, the grammar of a forced
tool choice or of ``text.format``, one engine request through ``ServingContext``, and the
chat output parser (reasoning, tool calls) whose deltas ``output.py`` turns into output items
and events. A background response runs in a task of its own, detached from its HTTP
connection; ``cancel`` aborts its engine request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.outputs import RequestOutput
from jaxserve.server.api.errors import APIError, bad_request, internal_error, json_response
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.protocol import ChatRequest
from jaxserve.server.chat.tool_calls import MessageDelta
from jaxserve.server.context import ENGINE_FAILURE, OFFLOAD_BYTES, ServingContext
from jaxserve.server.generation import EngineRequest, Generation
from jaxserve.server.guard.cost import (
    check_num_seqs,
    check_num_tokens,
    check_response_size,
    num_response_entries,
)
from jaxserve.server.responses.items import input_items, input_messages
from jaxserve.server.responses.output import Event, OutputItems
from jaxserve.server.responses.protocol import (
    ResponsesRequest,
    chat_request,
    parse_responses_request,
    renamed,
)
from jaxserve.server.responses.store import ResponseStore, StoredResponse, input_items_page

_LOG = logging.getLogger(__name__)
# How long a cancel waits for the background task to wind up before it answers.
CANCEL_WAIT_S = 10.0
FINISHED = ("completed", "incomplete", "failed")
# The last streamed event, by the response's status (a stream cut short sends nothing).
END_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.failed",
}


class ResponsesAPI:
    """The routes' handlers, around one ``ServingContext`` and the store."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.store = ResponseStore(ctx.settings.max_stored_responses)
        self.running: dict[str, asyncio.Task] = {}  # background tasks by response id

    async def create(self, request: Request, raw: bytes) -> Response:
        ctx = self.ctx
        response_id = f"resp_{uuid.uuid4().hex}"
        is_large = len(raw) >= OFFLOAD_BYTES
        req = await ctx.offload(is_large, lambda: parse_responses_request(parse_json_object(raw)))
        history = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, "previous_response_id")
            history = previous.messages
        chat, engine_request = await ctx.offload(is_large, self._prepare, req, history, response_id)
        if chat.tool_choice.is_forced:
            param = "tools"
        elif chat.structured_outputs_param == "response_format":
            param = "text.format"
        else:
            param = chat.structured_outputs_param
        await ctx.compile_grammars([engine_request], param, request)
        generation = ctx.new_generation(
            [engine_request], chat.priority, chat.cache_salt, chat.model
        )
        writer = ResponseWriter(ctx, req, chat, response_id, engine_request, history)
        if req.background:
            return self._start_background(generation, request, writer)
        if req.stream:
            return await ctx.stream(generation, request, lambda g: writer.events(g, self._save))
        (output,) = await ctx.collect(generation, request)
        response = writer.collected(output)
        self._save(writer, response)
        return json_response(response)

    def _prepare(
        self, req: ResponsesRequest, history: list[dict[str, Any]], response_id: str
    ) -> tuple[ChatRequest, EngineRequest]:
        """The chat request and its engine request (rendered, tokenized, budgeted)."""
        ctx = self.ctx
        chat = chat_request(req, history)
        ctx.check_model(chat.model)
        try:
            ctx.chat_output.check(chat)
        except APIError as exc:
            exc.message = renamed(exc.message)
            raise
        check_num_seqs(1, chat.params, ctx.settings)
        prompt = ctx.render_chat(chat.messages, True, chat.tools, chat.template_kwargs)
        token_ids = ctx.tokenizer.encode(prompt, add_special_tokens=chat.add_special_tokens)
        params = ctx.check_request(
            token_ids,
            ctx.chat_output.params_for(chat, chat.params, prompt),
            chat.max_tokens,
            None,
            "input",
            "max_output_tokens",
        )
        engine_request = EngineRequest(response_id, token_ids, params, prompt)
        check_num_tokens([engine_request], ctx.settings, "max_output_tokens")
        num_entries = num_response_entries(engine_request, echo=False, num_prompt_logprobs_copies=1)
        check_response_size(num_entries, ctx.settings, "max_output_tokens", "max_output_tokens")
        return chat, engine_request

    def _save(self, writer: ResponseWriter, response: dict[str, Any]) -> None:
        if writer.req.store:
            entry = StoredResponse(response, writer.conversation(response), None, writer.items)
            self.store.put(writer.id, entry)

    # -- background ------------------------------------------------------------------------

    def _start_background(
        self, generation: Generation, request: Request, writer: ResponseWriter
    ) -> Response:
        entry = StoredResponse(writer.snapshot("queued"), [], generation, writer.items)
        self.store.put(writer.id, entry)
        task = asyncio.create_task(self._run_background(entry, generation, request, writer))
        self.running[writer.id] = task
        task.add_done_callback(lambda _: self.running.pop(writer.id, None))
        return json_response(entry.response)

    async def _run_background(
        self,
        entry: StoredResponse,
        generation: Generation,
        request: Request,
        writer: ResponseWriter,
    ) -> None:
        entry.response = writer.snapshot("in_progress")
        try:
            (output,) = await self.ctx.collect(generation, cast(Request, _Detached(request)))
            response = writer.collected(output)
        except Exception as exc:
            if not isinstance(exc, APIError):
                _LOG.exception("background response %s failed", writer.id)
                exc = internal_error()
            code = exc.code if exc.code == "rate_limit_exceeded" else "server_error"
            response = writer.snapshot("failed", error={"code": code, "message": exc.message})
        if entry.is_cancelled:
            response["status"] = "cancelled"
            response["incomplete_details"] = None
        entry.response, entry.generation = response, None
        entry.messages = writer.conversation(response)

    async def cancel(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        status = entry.response["status"]
        if not entry.response["background"]:
            raise bad_request("Only responses created with background can be cancelled.")
        if status in FINISHED:
            raise bad_request(f"Cannot cancel a response whose status is {status}.")
        if status != "cancelled":
            entry.is_cancelled = True
            entry.response = {**entry.response, "status": "cancelled"}
            if entry.generation is not None:
                entry.generation.cancel(abort=True)
            task = self.running.get(response_id)
            if task is not None:
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        return json_response(entry.response)

    # -- retrieve and delete ---------------------------------------------------------------

    async def retrieve(self, response_id: str) -> Response:
        return json_response(self.store.get(response_id).response)

    async def list_input_items(self, response_id: str, query: Mapping[str, str]) -> Response:
        """A stored response's input items, a cursor page as OpenAI lists them: ``order``
        (``desc``, the default, or ``asc``), ``limit`` (1 to 100, 20 by default) and ``after``
        (an item id of the previous page)."""
        items = self.store.get(response_id).input_items
        page = input_items_page(items, query)
        return json_response(page)

    async def delete(self, response_id: str) -> Response:
        self.store.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})


class _Detached:
    """A background response's HTTP request without its connection: the generation outlives
    the response that announced it, so no disconnect cancels it."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # never: nothing arrives
        return {}


class ResponseWriter:
    """One response's object: its snapshots while it runs, and its end, collected or streamed."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ResponsesRequest,
        chat: ChatRequest,
        response_id: str,
        engine_request: EngineRequest,
        history: list[dict[str, Any]],
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.chat = chat
        self.id = response_id
        self.items = input_items(req.body["input"])  # what GET .../input_items lists
        self.created_at = int(time.time())
        self.prompt = engine_request.prompt or ""  # the rendered chat, for the reasoning parser
        self.num_prompt = len(engine_request.prompt_token_ids)
        self.history = history

    def snapshot(self, status: str, **fields: Any) -> dict[str, Any]:
        """The response object with ``status``; ``fields`` replace the defaults."""
        req, params = self.req, self.chat.params
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": req.background,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.body.get("max_output_tokens"),
            "max_tool_calls": None,
            "metadata": req.metadata,
            "model": self.ctx.response_model(self.chat.model),
            "output": [],
            "parallel_tool_calls": self.chat.tool_choice.parallel,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": req.store,
            "temperature": params.temperature,
            "text": req.text,
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.body.get("user"),
        }
        response.update(fields)
        return response

    def conversation(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages a request chained to this response continues from."""
        output = input_messages(response["output"], "output")
        return [*self.history, *self.req.input_messages, *output]

    def finished(
        self, finish_reason: str | None, items: OutputItems, num_output: int, num_cached: int
    ) -> dict[str, Any]:
        """The response at its end; its open output item is closed first."""
        status = status_of(finish_reason)
        items.close(item_status(status))
        reasoning = items.reasoning_text
        num_reasoning = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False))
        usage = {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": min(num_reasoning, num_output)},
            "total_tokens": self.num_prompt + num_output,
        }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return self.snapshot(
            status,
            output=items.items,
            usage=usage,
            incomplete_details=incomplete,
            completed_at=int(time.time()) if status == "completed" else None,
        )

    def collected(self, output: RequestOutput | None) -> dict[str, Any]:
        """The response of a collected generation (None: it never started)."""
        items = OutputItems()
        if output is None:
            return self.finished(None, items, 0, 0)
        if output.error is not None:
            raise internal_error(ENGINE_FAILURE)
        (out,) = output.outputs
        parser = self.ctx.chat_output.parser(self.chat, self.prompt)
        items.add(parser.parse_all(out.text))
        return self.finished(out.finish_reason, items, len(out.token_ids), output.num_cached_tokens)

    async def events(
        self,
        generation: Generation,
        on_done: Callable[[ResponseWriter, dict[str, Any]], None],
    ) -> AsyncGenerator[Event]:
        """The streamed events, numbered from 0; ``on_done`` gets the final response."""
        counter = itertools.count()

        def numbered(event: Event) -> Event:
            return {**event, "sequence_number": next(counter)}

        for kind in ("response.created", "response.in_progress"):
            yield numbered({"type": kind, "response": self.snapshot("in_progress")})
        parser = self.ctx.chat_output.parser(self.chat, self.prompt)
        items = OutputItems()
        finish_reason, num_output, num_cached = None, 0, 0
        async for _, delta in generation.deltas():
            if delta.error is not None:
                raise internal_error(ENGINE_FAILURE)
            num_cached = max(num_cached, delta.num_cached_tokens)
            for out in delta.outputs:
                num_output += len(out.token_ids)
                message = parser.feed(out.text) if out.text else MessageDelta()
                if out.finish_reason is not None:
                    message.extend(parser.finish())
                    finish_reason = out.finish_reason
                for event in items.add(message):
                    yield numbered(event)
        closing = items.close(item_status(status_of(finish_reason)))
        response = self.finished(finish_reason, items, num_output, num_cached)
        on_done(self, response)
        for event in closing:
            yield numbered(event)
        yield numbered({"type": END_EVENTS[response["status"]], "response": response})


def status_of(finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "incomplete"
    if finish_reason in (None, "abort"):
        return "cancelled"
    return "completed"


def item_status(status: str) -> str:
    """An output item's status in a response of ``status``."""
    return "incomplete" if status == "incomplete" else "completed"
