"""The Starlette app: routes, middleware and error handlers around one ``AsyncEngine``.

``build_app(engine, settings)`` is called by ``launch/serve.py`` (and by tests) with an engine that
is already started; the app never starts or stops the engine. Its lifespan runs the engine watchdog
and the periodic stats line. Middleware, outermost first: header count (431), slow reader (send
timeout), API key (401), body size (413) and body time (408); then routing, where every error
becomes OpenAI's error shape. Generation routes are rate limited when ``--rate-limit-rpm`` /
``--rate-limit-tpm`` are set (``guard/ratelimit.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import metadata

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.engine.interfaces import EngineClient
from jaxserve.json_limits import JsonLimitError
from jaxserve.sampling_params import SamplingParamsError
from jaxserve.server.api.classify import create_classification
from jaxserve.server.api.completions import create_completion
from jaxserve.server.api.embeddings import create_embedding
from jaxserve.server.api.errors import APIError, internal_error, json_response, unavailable
from jaxserve.server.api.openapi import openapi_spec
from jaxserve.server.api.score_handler import create_rerank, create_score
from jaxserve.server.api.tokenization import detokenize, tokenize
from jaxserve.server.chat.completions import create_chat_completion
from jaxserve.server.context import OFFLOAD_BYTES, ServingContext
from jaxserve.server.guard.auth import APIKeyMiddleware
from jaxserve.server.guard.limits import (
    BodyLimitMiddleware,
    HeaderLimitMiddleware,
    SendTimeoutMiddleware,
)
from jaxserve.server.guard.ratelimit import RateLimitedContext, RateLimiter
from jaxserve.server.lifecycle import log_stats_periodically, watch_engine
from jaxserve.server.lora import is_runtime_updating_allowed, lora_routes, model_cards
from jaxserve.server.metrics import StatsLogger
from jaxserve.server.responses.serving import ResponsesAPI
from jaxserve.server.settings import ServerSettings
from jaxserve.server.training import sleep_routes, training_routes

_LOG = logging.getLogger(__name__)


def server_version() -> str:
    try:
        return metadata.version("jaxserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_app(
    engine: EngineClient,
    settings: ServerSettings,
    on_engine_dead: Callable[[], None] | None = None,
) -> Starlette:
    """The app for a started engine; ``on_engine_dead`` runs once if its loop dies."""
    limiter = RateLimiter.from_settings(settings)
    ctx = (
        ServingContext(engine, settings)
        if limiter is None
        else RateLimitedContext(engine, settings, limiter)
    )
    responses = ResponsesAPI(ctx)
    app = Starlette(
        routes=[
            *_generation_routes(ctx, limiter, responses),
            *_stored_response_routes(responses),
            *_info_routes(ctx, server_version()),
            *(training_routes(ctx) if settings.enable_weight_updates else []),
            *(sleep_routes(ctx) if engine.config.enable_sleep_mode else []),
            *(lora_routes(engine, ctx.loras) if _serves_lora_updates(engine) else []),
        ],
        middleware=_middleware(settings),
        exception_handlers={
            APIError: _api_error,
            SamplingParamsError: _sampling_error,
            JsonLimitError: _json_limit_error,
            HTTPException: _http_error,
            Exception: _unexpected_error,
        },
        lifespan=_lifespan(ctx, on_engine_dead),
    )
    app.state.ctx = ctx
    return app


def _serves_lora_updates(engine: EngineClient) -> bool:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter: with LoRA on and the
    environment switch vLLM uses (server/lora.py)."""
    return engine.config.enable_lora and is_runtime_updating_allowed()


def _generation_routes(
    ctx: ServingContext, limiter: RateLimiter | None, api: ResponsesAPI
) -> list[Route]:
    """The routes that read a body: the generation routes (rate limited) and tokenizing."""

    async def read_body(request: Request, is_generation: bool = False) -> bytes:
        """The body's bytes; each route parses them (off the event loop when they are large)."""
        ctx.state.admit()
        if is_generation and limiter is not None:
            limiter.charge_request(request)
        return await request.body()

    async def generation_body(request: Request) -> bytes:
        """A generation route's body; a pooling model (--runner pooling) answers 400 first."""
        ctx.refuse_generation_if_pooling()
        return await read_body(request, True)

    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request, await generation_body(request))

    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request, await generation_body(request))

    async def responses(request: Request) -> Response:
        return await api.create(request, await generation_body(request))

    async def embeddings(request: Request) -> Response:
        return await create_embedding(ctx, request, await read_body(request, True))

    async def score(request: Request) -> Response:
        return await create_score(ctx, request, await read_body(request, True))

    async def rerank(request: Request) -> Response:
        return await create_rerank(ctx, request, await read_body(request, True))

    async def tokenize_route(request: Request) -> Response:
        raw = await read_body(request)
        return await ctx.offload(len(raw) >= OFFLOAD_BYTES, tokenize, ctx, raw)

    async def detokenize_route(request: Request) -> Response:
        raw = await read_body(request)
        return await ctx.offload(len(raw) >= OFFLOAD_BYTES, detokenize, ctx, raw)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        # vLLM serves scoring and reranking under all of these paths
        *(Route(path, score, methods=["POST"]) for path in ("/v1/score", "/score")),
        *(
            Route(path, rerank, methods=["POST"])
            for path in ("/v1/rerank", "/rerank", "/v2/rerank")
        ),
        *_classify_routes(ctx, read_body),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
    ]


def _classify_routes(
    ctx: ServingContext, read_body: Callable[[Request, bool], Awaitable[bytes]]
) -> list[Route]:
    """``/v1/classify`` and ``/classify`` (vLLM serves both): a sequence classifier's labels;
    ``read_body`` is the generation routes' (admission and rate limits as theirs)."""

    async def classify(request: Request) -> Response:
        return await create_classification(ctx, request, await read_body(request, True))

    return [Route(path, classify, methods=["POST"]) for path in ("/v1/classify", "/classify")]


def _stored_response_routes(api: ResponsesAPI) -> list[Route]:
    """Stored responses of ``/v1/responses``: retrieve, delete, cancel and list the input items
    (``responses/``)."""

    async def stored(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return await api.delete(response_id)
        return await api.retrieve(response_id)

    async def cancel(request: Request) -> Response:
        return await api.cancel(request.path_params["response_id"])

    async def input_items(request: Request) -> Response:
        return await api.list_input_items(request.path_params["response_id"], request.query_params)

    return [
        Route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
    ]


def _info_routes(ctx: ServingContext, version: str) -> list[Route]:
    """The routes that only answer: models, health, metrics, version and the OpenAPI spec."""
    engine, settings = ctx.engine, ctx.settings
    created = int(time.time())
    spec = openapi_spec(
        settings.served_model_names,
        ctx.max_model_len,
        ctx.vocab_size,
        version,
        public_paths=settings.public_paths if settings.api_key is not None else None,
    )

    async def models(request: Request) -> Response:
        common = {
            "object": "model",
            "created": created,
            "owned_by": "jaxserve",
            "root": engine.config.model or settings.model_name,
            "parent": None,
            "max_model_len": ctx.max_model_len,
            "permission": [model_permission(created)],
        }
        data = [common | {"id": name} for name in settings.served_model_names]
        data += model_cards(ctx.loras, settings.model_name, common)
        return json_response({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        if ctx.state.is_ready:
            return Response(status_code=200)
        reason = "The server is shutting down." if ctx.state.is_draining else "Engine not running."
        return unavailable(reason).response()

    async def metrics(request: Request) -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def version_route(request: Request) -> Response:
        return json_response({"version": version})

    async def openapi(request: Request) -> Response:
        return json_response(spec)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]


def _middleware(settings: ServerSettings) -> list[Middleware]:
    """Outermost first: unexpected errors, header limits, send timeout, API key, body limits."""
    middleware = [
        Middleware(UnexpectedErrorMiddleware),
        Middleware(
            HeaderLimitMiddleware,
            max_header_count=settings.max_header_count,
            max_header_bytes=settings.max_header_bytes,
        ),
        Middleware(SendTimeoutMiddleware, send_timeout_s=settings.send_timeout_s),
    ]
    if settings.api_key is not None:
        middleware.append(
            Middleware(
                APIKeyMiddleware, api_key=settings.api_key, public_paths=settings.public_paths
            )
        )
    middleware.append(
        Middleware(
            BodyLimitMiddleware,
            max_body_bytes=settings.max_request_body_bytes,
            body_timeout_s=settings.request_body_timeout_s,
        )
    )
    return middleware


def _lifespan(
    ctx: ServingContext, on_engine_dead: Callable[[], None] | None
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """The engine watchdog and the periodic stats line, for as long as the app serves."""
    engine, settings = ctx.engine, ctx.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(watch_engine(engine, settings.watchdog_interval_s, on_engine_dead))
        ]
        if settings.log_stats:
            stats = log_stats_periodically(StatsLogger(engine), settings.stats_log_interval_s)
            tasks.append(asyncio.create_task(stats))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.close()

    return lifespan


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status == 429:  # a rate limit names its reason; else the engine's queue was full
        request.app.state.ctx.metrics.count_rate_limited(getattr(exc, "reason", "queue_full"))
    return exc.response()


async def _sampling_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SamplingParamsError)
    return APIError(400, str(exc), param=exc.param).response()


async def _json_limit_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, JsonLimitError)
    return APIError(400, str(exc), param=exc.param).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"Route {request.method} {request.url.path} not found.", "not_found"
    elif exc.status_code == 405:
        message, code = f"Method {request.method} not allowed on {request.url.path}.", None
    else:
        message, code = str(exc.detail), None
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, message, code=code, headers=headers).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # Only reached once a response has started (UnexpectedErrorMiddleware passes those on):
    # uvicorn logs the error then, so it is not logged here a second time.
    return internal_error().response()


class UnexpectedErrorMiddleware:
    """An error no handler knows: logged once and answered 500 in OpenAI's shape.

    NOTE: Starlette hands such errors to its outermost middleware, which answers and then
    raises them again for the server to log: each was logged twice, and uvicorn closed the
    keep-alive connection, so the client's next request on it failed. Caught here, the
    connection stays usable. An error after the response has started (a stream) can only end
    it: that one goes on to uvicorn, which logs it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def send_and_track(message: Message) -> None:
            nonlocal is_started
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_track)
        except Exception as exc:
            if is_started:
                raise
            _LOG.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
            await internal_error().response()(scope, receive, send)


def model_permission(created: int) -> dict:
    """A ``/v1/models`` entry's permission, with vLLM's fields and values (clients written
    against vLLM read them)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
