"""The routes a training loop drives.

``POST /update_weights_from_disk`` (SGLang's name and shape; ``--enable-weight-updates``) loads a
checkpoint of the served model from the server's disk (safetensors, or one ``jaxserve convert``
wrote with orbax: told apart by the directory's content) and serves it from the next step. Running
sequences finish on the old weights first and waiting requests start on the new ones
(``AsyncEngine``); a checkpoint that does not fit is a 400 naming the tensor or file, and nothing
changes.

``POST /pause?mode=wait|abort|keep``, ``POST /resume`` and ``GET /is_paused`` (also with
``--enable-weight-updates``): generation stops between rollout batches, the running sequences
finished, aborted or kept in place; requests sent meanwhile wait.

``POST /sleep?level=1|2``, ``POST /wake_up[?tags=weights&tags=kv_cache]`` and ``GET
/is_sleeping`` (vLLM's; ``--enable-sleep-mode``): the model gives its device memory up once the
running sequences finish (``runner/sleep.py``), requests get 503 until it wakes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.json_limits import JsonLimitError, load_json
from jaxserve.server.context import ServingContext


def sleep_routes(ctx: ServingContext) -> list[Route]:
    engine = ctx.engine

    async def sleep(request: Request) -> Response:
        try:
            await engine.sleep(int(request.query_params.get("level", "1")))
        except (RuntimeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = tuple(request.query_params.getlist("tags")) or ("weights", "kv_cache")
        try:
            await engine.wake_up(tags)
        except (RuntimeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    return [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
    ]


def training_routes(ctx: ServingContext) -> list[Route]:
    async def update_weights_from_disk(request: Request) -> Response:
        ctx.state.admit()
        try:
            body = load_json((await request.body()).decode("utf-8", "replace"), "body")
        except (JsonLimitError, ValueError) as exc:
            return _refused(f"the body is not a JSON object: {exc}")
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            return _refused("model_path must be the path of a model directory on the server")
        try:
            seconds = await ctx.engine.update_weights_from_disk(path)
        except (OSError, ValueError, RuntimeError) as exc:
            return _refused(f"{path}: {exc}")
        message = f"Loaded the weights of {path} in {seconds:.2f} s"
        return JSONResponse({"success": True, "message": message, "load_seconds": seconds})

    async def pause(request: Request) -> Response:
        try:
            await ctx.engine.pause(request.query_params.get("mode", "wait"))
        except ValueError as exc:
            return _refused(str(exc))
        return JSONResponse({"success": True, "message": "paused"})

    async def resume(request: Request) -> Response:
        await ctx.engine.resume()
        return JSONResponse({"success": True, "message": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": ctx.engine.is_paused})

    return [
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
    ]


def _refused(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)
