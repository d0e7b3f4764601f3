"""The adapters the server serves by name, and the routes that load and unload them.

A request picks an adapter by its ``model`` name (``LoraModules.lora_for``); ``/v1/models`` lists
each adapter beside the base model, with ``parent`` the base model and ``root`` its path, as
vLLM does. The adapters come from ``--lora-modules`` (``parse_lora_module``, each checked by the
engine at start-up) and, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or
``JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING``) true, from ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (behind the API key like every ``/v1`` route). A load reads and checks
the adapter on a worker thread (a bad one is a 400, and nothing changes); a load under a name
that exists replaces it with a new id: requests sent from then on run the new weights, those
already running finish on the old. The engine keeps the weights (``runner/lora_slots.py``); this
module keeps only names, ids and paths.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.json_limits import JsonLimitError, load_json
from jaxserve.lora_request import LoRARequest
from jaxserve.server.api.errors import APIError

RUNTIME_UPDATING = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING")


def is_runtime_updating_allowed() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
        for name in RUNTIME_UPDATING
    )


def parse_lora_module(text: str, lora_int_id: int) -> LoRARequest:
    """One ``--lora-modules`` value: ``name=path`` or the JSON form ``{"name": ..., "path":
    ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({exc})") from None
        name, path = spec.get("name"), spec.get("path")
        base = spec.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs a name and a path")
        return LoRARequest(name, lora_int_id, path, base if isinstance(base, str) else None)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} must be name=path or a JSON object")
    return LoRARequest(name, lora_int_id, path)


class LoraModules:
    """Adapter name -> its ``LoRARequest``; ids count up so a replacement never reuses one."""

    def __init__(self, modules: tuple[LoRARequest, ...] = ()) -> None:
        self._by_name = {m.lora_name: m for m in modules}
        self._ids = itertools.count(max((m.lora_int_id for m in modules), default=0) + 1)
        self._lock = threading.Lock()

    def lora_for(self, model: str | None) -> LoRARequest | None:
        return None if model is None else self._by_name.get(model)

    def __contains__(self, model: str) -> bool:
        return model in self._by_name

    def modules(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def new_request(self, name: str, path: str) -> LoRARequest:
        with self._lock:
            return LoRARequest(name, next(self._ids), path)

    def put(self, request: LoRARequest) -> LoRARequest | None:
        """Serve ``request`` under its name; the adapter it replaces, if any."""
        with self._lock:
            old = self._by_name.get(request.lora_name)
            self._by_name[request.lora_name] = request
            return old

    def pop(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.pop(name, None)


def model_cards(modules: LoraModules, base_name: str, common: dict[str, Any]) -> list[dict]:
    """``/v1/models`` entries of the adapters (``common``: the base model's other fields)."""
    return [
        common | {"id": m.lora_name, "root": m.lora_path, "parent": m.base_model_name or base_name}
        for m in modules.modules()
    ]


def lora_routes(engine: Any, modules: LoraModules) -> list[Route]:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's)."""

    async def load(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "lora_name and lora_path must be non-empty strings", "lora_path")
        lora = modules.new_request(name, path)
        try:
            await engine.add_lora(lora)
        except (OSError, ValueError, RuntimeError) as exc:
            return _error(400, f"adapter {name!r} could not be loaded: {exc}", "lora_path")
        old = modules.put(lora)
        if old is not None:  # its running requests finish on it
            await engine.remove_lora(old.lora_int_id)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    async def unload(request: Request) -> Response:
        body = await _body(request)
        if isinstance(body, Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return _error(400, "lora_name must be a non-empty string", "lora_name")
        old = modules.pop(name)
        if old is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await engine.remove_lora(old.lora_int_id)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]


async def _body(request: Request) -> dict[str, Any] | Response:
    try:
        body = load_json((await request.body()).decode("utf-8", "replace"), "body")
    except (JsonLimitError, ValueError) as exc:
        return _error(400, f"the body is not a JSON object: {exc}")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def _error(status: int, message: str, param: str | None = None) -> Response:
    return APIError(status, message, param=param).response()
