"""Limits on what a client declares and on how slowly it talks: headers (431), body bytes
(413), body time (408) and a client that stops reading a response.

Header count and total header bytes are checked before routing; uvicorn's h11 parser also
refuses (400) a header block that arrives in pieces larger than ``h11_max_incomplete_event_size``.
The body limit holds before anything is buffered: a declared ``Content-Length`` over the limit
is refused at once, and a chunked body is counted as it is read, failing as soon as it passes
the limit. The whole body must also arrive within ``request_body_timeout_s`` of the headers, so
a slowloris body is answered 408. Either way the connection is closed afterwards, so the rest is
never read. A response write waits for the client only while uvicorn's transport buffer is
above its high-water mark (64 KiB), so what a slow reader holds is bounded; a write blocked for
``send_timeout_s`` ends the response as if the client had left, which aborts its request in the
engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxserve.server.api.errors import APIError

_LOG = logging.getLogger(__name__)
CLOSE = {"Connection": "close"}
DISCONNECT: Message = {"type": "http.disconnect"}
# Set in the connection's task once SendTimeoutMiddleware has ended its response on purpose.
_IS_CUT = contextvars.ContextVar("jaxserve_response_cut", default=False)
_UNFINISHED = "ASGI callable returned without completing response"


class _CutIsNotAnError(logging.Filter):
    """Drops uvicorn's ERROR about a response the app left unfinished when the send timeout
    ended it on purpose (the middleware's own warning says so); any other stays an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_IS_CUT.get() and record.getMessage().startswith(_UNFINISHED))


_CUT_FILTER = _CutIsNotAnError()


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


def body_too_slow(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {timeout_s:g} seconds.",
        code="request_timeout",
        headers=CLOSE,
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

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
        is_body_read = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counting_receive() -> Message:
            nonlocal num_read, is_body_read
            if is_body_read:  # only a disconnect can come now: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(
                    receive(), deadline - asyncio.get_running_loop().time()
                )
            except TimeoutError:
                raise body_too_slow(self.body_timeout_s) from None
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > limit:
                    raise body_too_large(limit)  # answered by the app's APIError handler
                is_body_read = not message.get("more_body", False)
            return message

        await self.app(scope, counting_receive, send)


class SendTimeoutMiddleware:
    """Ends a response whose client has not read for ``send_timeout_s`` (a slow reader).

    After the timeout every later write is dropped and the app's next ``receive`` reports a
    disconnect, so a stream is cancelled (its engine request aborted) exactly as if the client
    had closed the connection; uvicorn then closes it, as the response never completed.
    """

    def __init__(self, app: ASGIApp, send_timeout_s: float) -> None:
        self.app = app
        self.send_timeout_s = send_timeout_s
        logging.getLogger("uvicorn.error").addFilter(_CUT_FILTER)  # once: the same object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = asyncio.Event()

        async def timed_send(message: Message) -> None:
            if gone.is_set():
                return
            try:
                # NOTE: uvicorn waits for the buffer to drain before it writes anything, so a
                # write cancelled here has sent nothing.
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except TimeoutError:
                _LOG.warning(
                    "%s %s: the client read nothing for %gs; ending the response",
                    scope["method"],
                    scope["path"],
                    self.send_timeout_s,
                )
                gone.set()

        async def receive_or_gone() -> Message:
            if gone.is_set():
                return DISCONNECT
            received = asyncio.ensure_future(receive())
            timed_out = asyncio.ensure_future(gone.wait())
            try:
                await asyncio.wait((received, timed_out), return_when=asyncio.FIRST_COMPLETED)
            finally:
                received.cancel()
                timed_out.cancel()
            if received.done() and not received.cancelled():
                return received.result()
            return DISCONNECT

        await self.app(scope, receive_or_gone, timed_send)
        # NOTE: here, not in timed_send, which may run in a task of the response's own: this
        # is the connection's task, where uvicorn logs once the app has returned.
        if gone.is_set():
            _IS_CUT.set(True)
