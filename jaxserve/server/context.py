"""ServingContext: what every route shares (engine, settings, state, metrics, logs) and the two
ways a generation is driven: collected for a JSON response, or streamed as server-sent events.

Built once by ``build_app``; used by the routes (``api/completions.py``, ``chat/completions.py``,
``api/tokenization.py``). Both drivers register the generation with ``ServerState`` (so a drain
waits for it) and watch the client: a disconnect cancels the generation, which aborts it in the
engine. A large request's host work (parsing, tokenizing, building the response) runs on the one
host-work thread (``offload``), so the event loop keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.engine.interfaces import EngineClient
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.request_checks import GENERATION_REFUSED, RequestError, check_request
from jaxserve.engine.tokenizer import TemplateError
from jaxserve.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server.api.errors import APIError, internal_error, json_dumps, model_not_found
from jaxserve.server.api.logprobs import LogprobFormatter
from jaxserve.server.chat.output import ChatOutputRules
from jaxserve.server.generation import EngineRequest, Generation, RequestRecord
from jaxserve.server.guard.auth import client_key
from jaxserve.server.lifecycle import ServerState
from jaxserve.server.lora import LoraModules
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.request_log import RequestLogger
from jaxserve.server.settings import ServerSettings

_LOG = logging.getLogger(__name__)

# Request bodies at least this large are parsed, tokenized and checked on the host-work thread.
OFFLOAD_BYTES = 16 * 1024
# Responses estimated at least this large (tokens and logprobs, ``cost.num_response_entries``)
# are built and serialized on the host-work thread.
OFFLOAD_ENTRIES = 16 * 1024
# The message of a 500 for a request the engine failed (details stay in the server log).
ENGINE_FAILURE = "The request failed in the engine; other requests are unaffected."


class ServingContext:
    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.state = ServerState(engine)
        self.loras = LoraModules(settings.lora_modules)  # adapters served by name
        self.metrics = ServerMetrics(
            engine, settings.model_name, self.max_model_len, settings.metrics_prefix
        )
        self.request_logger = (
            RequestLogger(settings.log_prompts) if settings.enable_log_requests else None
        )
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.chat_output = ChatOutputRules(settings, self.tokenizer)
        # NOTE: one thread, as vLLM's tokenizer executor: the event loop then waits for the GIL
        # behind one busy thread at most, however many large requests arrive together.
        self.host_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxserve-host")

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def response_model(self, model: str | None) -> str:
        """The ``model`` a generation's response names: the adapter's name where the request
        ran on one (as vLLM answers), else the served model's."""
        lora = self.loras.lora_for(model)
        return lora.lora_name if lora is not None else self.model_name

    def check_model(self, model: str | None) -> None:
        if model is None or model in self.settings.served_model_names or model in self.loras:
            return
        raise model_not_found(model)

    @property
    def keeps_prompt_text(self) -> bool:
        return self.request_logger is not None and self.settings.log_prompts

    async def offload[T](self, is_large: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``; on the host-work thread when ``is_large``, so a large request's host
        work (JSON, tokenizing, logprob formatting) does not hold up other requests."""
        if not is_large:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.host_executor, functools.partial(fn, *args))

    def close(self) -> None:
        self.host_executor.shutdown(wait=False, cancel_futures=True)

    # -- prompts ---------------------------------------------------------------------------

    def render_chat(
        self,
        messages: tuple[dict[str, Any], ...],
        add_generation_prompt: bool,
        tools: tuple[dict[str, Any], ...] | None,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The model's chat template over validated messages; a failure is the client's 400."""
        try:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                **template_kwargs,
            )
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            raise APIError(400, f"The chat template could not render: {exc}", "messages") from None

    def refuse_generation_if_pooling(self) -> None:
        """A model served for pooling (``--runner pooling``) generates nothing: 400."""
        if self.engine.config.runner == "pooling":
            raise APIError(400, GENERATION_REFUSED, code="pooling_model")

    def check_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None,
        default_max_tokens: int | None,
        noun: str,
        max_tokens_param: str,
    ) -> SamplingParams:
        """The engine's request checks (context length, vocabulary, the budget), as a 400 in
        OpenAI's words. ``max_tokens`` is what the client sent; without it the budget is
        ``default_max_tokens`` clamped to the room left, or all of the room left. ``noun`` is
        "prompt" or "messages". A pooling model (``--runner pooling``) generates nothing: 400."""
        self.refuse_generation_if_pooling()
        try:
            return check_request(
                token_ids,
                params.replace(max_tokens=max_tokens),
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                default_max_tokens=default_max_tokens,
                noun=noun,
                max_tokens_param=max_tokens_param,
            )
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        except SamplingParamsError as exc:  # e.g. min_tokens above max_tokens
            raise APIError(400, str(exc), param=exc.param) from None

    async def compile_grammars(
        self, requests: list[EngineRequest], param: str, http_request: Request
    ) -> None:
        """Compile the requests' structured-output constraints on the engine's compile workers,
        shared fairly between clients (the engine then takes them from its cache); an invalid,
        too large or too slow one is a 400 naming ``param``, the field the client sent it in."""
        specs = {r.params.structured_outputs: r.params for r in requests}
        specs.pop(None, None)
        address = http_request.client.host if http_request.client else "unknown"
        client = client_key(http_request, self.settings.api_key is not None) + "@" + address
        for params in specs.values():
            try:
                await self.engine.compile_grammar(params, client)
            except RequestError as exc:
                shown = exc.param if param == "structured_outputs" and exc.param else param
                raise APIError(400, str(exc), param=shown) from None

    # -- generations -----------------------------------------------------------------------

    def new_generation(
        self,
        requests: list[EngineRequest],
        priority: int,
        cache_salt: str | None,
        model: str | None = None,
    ) -> Generation:
        """``model``: the request's; an adapter's name runs its prompts with that adapter."""
        return Generation(
            self.engine,
            requests,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=self.loras.lora_for(model),
            on_finish=self._on_finish,
            keep_texts=self.keeps_prompt_text,
        )

    def _on_finish(self, record: RequestRecord) -> None:
        self.metrics.observe(record)
        if self.request_logger is not None:
            self.request_logger.log(record)

    async def collect(self, generation: Generation, request: Request) -> list[RequestOutput | None]:
        """Run to the end; one merged ``RequestOutput`` per prompt (None: never started)."""
        self.state.admit()
        self.state.begin(generation)
        watcher = asyncio.create_task(watch_disconnect(request.receive, generation.cancel))
        merged: list[RequestOutput | None] = [None] * len(generation.requests)
        try:
            await generation.start()
            async for index, delta in generation.deltas():
                so_far = merged[index]
                if so_far is None:
                    merged[index] = delta
                else:
                    so_far.merge(delta)
        finally:
            watcher.cancel()
            await generation.close()
            self.state.end(generation)
        return merged

    async def stream(
        self,
        generation: Generation,
        request: Request,
        events: Callable[[Generation], AsyncGenerator[dict[str, Any]]],
    ) -> EventStreamResponse:
        """Start the generation (admission errors are still plain HTTP errors), then stream."""
        self.state.admit()
        self.state.begin(generation)
        watcher = asyncio.create_task(watch_disconnect(request.receive, generation.cancel))
        try:
            await generation.start()
        except BaseException:
            await generation.close()
            self.state.end(generation)
            raise
        finally:
            watcher.cancel()

        async def on_close() -> None:
            await generation.close()
            self.state.end(generation)

        return EventStreamResponse(events(generation), generation.cancel, on_close)


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Wait for ``http.disconnect`` (the body has been read, so nothing else arrives)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else json_dumps(payload)
    return b"data: " + data + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events, ending with ``data: [DONE]``; stops as soon as the client leaves.

    An ``APIError`` raised by the events (an engine failure mid-stream) becomes one
    ``data: {"error": ...}`` event before ``[DONE]``, which the ``openai`` SDK raises as
    ``APIError``.
    """

    def __init__(
        self,
        events: AsyncGenerator[dict[str, Any]],
        on_disconnect: Callable[[], None],
        on_close: Callable[[], Any],
    ) -> None:
        super().__init__(
            [],  # the events are sent by __call__ below
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # NOTE: replaces StreamingResponse's loop: this one watches for the disconnect itself
        # (uvicorn's h11 send() is silent after one) and reports errors as an event.
        watcher = asyncio.create_task(watch_disconnect(receive, self.on_disconnect))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for event in self.events:
                    await send(
                        {"type": "http.response.body", "body": sse(event), "more_body": True}
                    )
            except APIError as exc:
                await send(
                    {"type": "http.response.body", "body": sse(exc.body()), "more_body": True}
                )
            except Exception:
                _LOG.exception("stream failed")
                error = sse(internal_error().body())
                await send({"type": "http.response.body", "body": error, "more_body": True})
            await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": False})
        finally:
            watcher.cancel()
            with contextlib.suppress(Exception):
                await self.events.aclose()
            await self.on_close()
