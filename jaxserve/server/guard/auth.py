"""API-key middleware: ``Authorization: Bearer <key>``, compared in constant time.

Every path is guarded except the explicit public list in ``ServerSettings.public_paths``; the
check runs before routing, so unknown routes answer 401 (not 404) without a key.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server.api.errors import APIError


def client_key(request: Request, uses_api_key: bool) -> str:
    """Who sent a request, for per-client limits and fair shares: the API key (hashed: never
    kept) when keys are checked, else the address (as uvicorn reports it)."""
    if uses_api_key:
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:32]
    return "addr:" + (request.client.host if request.client else "unknown")


def unauthorized(is_missing: bool = False) -> APIError:
    """401 ``invalid_api_key``; a request that sent no Authorization header is told so, not
    that its key is wrong."""
    what = "No API key provided" if is_missing else "Incorrect API key provided"
    return APIError(
        401,
        f"{what}. Send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, public_paths: frozenset[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        given: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = (given or b"").partition(b" ")
        # NOTE: compare_digest runs whatever the scheme, so timing says nothing about the key.
        is_valid = hmac.compare_digest(token.strip(), self.key)
        if not (is_valid and scheme.lower() == b"bearer"):
            await unauthorized(is_missing=given is None).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
