"""The routes a training loop drives (``--enable-weight-updates``): ``POST
/update_weights_from_disk`` (SGLang's name and shape) loads a safetensors checkpoint of the
served model from the server's disk and serves it from the next step. Running sequences finish
on the old weights first and waiting requests start on the new ones (``AsyncEngine``); a
checkpoint that does not fit is a 400 naming the tensor or file, and nothing changes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.json_limits import JsonLimitError, load_json
from jaxserve.server.context import ServingContext


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
        except (OSError, ValueError) as exc:
            return _refused(f"{path}: {exc}")
        message = f"Loaded the weights of {path} in {seconds:.2f} s"
        return JSONResponse({"success": True, "message": message, "load_seconds": seconds})

    return [Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"])]


def _refused(message: str) -> Response:
    return JSONResponse({"success": False, "message": message}, status_code=400)
