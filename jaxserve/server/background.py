"""BackgroundServer: the app served by uvicorn in a background thread (notebooks, tests).

The socket is bound before the thread starts (port 0 picks a free port), so ``url`` is valid
as soon as ``start`` returns. Signals stay with the main thread: ``stop`` ends the server.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from jaxserve.server.settings import DEFAULT_MAX_HEADER_BYTES


class BackgroundServer:
    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app,
            http="h11",
            h11_max_incomplete_event_size=max_header_bytes,
            lifespan="on",
            log_config=None,
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
