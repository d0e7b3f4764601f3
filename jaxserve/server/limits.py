"""Size limits on what a client declares: headers (431) and body bytes (413).

Header count and total header bytes are checked before routing; uvicorn's h11 parser also
refuses (400) a header block that arrives in pieces larger than ``h11_max_incomplete_event_size``.
The body limit holds before anything is buffered: a declared ``Content-Length`` over the limit
is refused at once, and a chunked body is counted as it is read, failing as soon as it passes
the limit. Either way the connection is closed afterwards, so the rest is never read.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.errors import APIError

CLOSE = {"Connection": "close"}


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than the limit of {limit} bytes.",
        code="request_too_large",
        headers=CLOSE,
    )


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, max_header_count: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_header_count = max_header_count
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            num_bytes = sum(len(name) + len(value) for name, value in headers)
            problem = None
            if len(headers) > self.max_header_count:
                problem = f"{len(headers)} headers; at most {self.max_header_count} are allowed"
            elif num_bytes > self.max_header_bytes:
                problem = f"{num_bytes} bytes of headers; at most {self.max_header_bytes}"
            if problem is not None:
                error = APIError(
                    431,
                    f"The request has {problem}.",
                    code="request_header_fields_too_large",
                    headers=CLOSE,
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    error = APIError(400, "Content-Length is not a number.", headers=CLOSE)
                    await error.response()(scope, receive, send)
                    return
                if int(value) > limit:
                    await body_too_large(limit).response()(scope, receive, send)
                    return
        num_read = 0

        async def counting_receive() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > limit:
                    raise body_too_large(limit)  # answered by the app's APIError handler
            return message

        await self.app(scope, counting_receive, send)
