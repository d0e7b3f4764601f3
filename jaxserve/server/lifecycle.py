"""Lifecycle: admission, draining on SIGTERM, and the engine watchdog.

``ServerState`` is shared by the routes (``admit`` before any work; ``begin`` / ``end`` around each
``Generation``), ``launch/serve.py`` (``drain`` on SIGTERM) and the watchdog task that the app
starts: when the engine loop dies, ``/health`` turns 503, new requests get 503, and
``on_engine_dead`` (the launcher's hook) makes the process exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from jaxserve.engine.interfaces import EngineClient
from jaxserve.server.api.errors import unavailable
from jaxserve.server.generation import Generation

_LOG = logging.getLogger(__name__)

# After the drain timeout, how long aborted requests get to send their last chunk.
ABORT_GRACE_S = 5.0


class ServerState:
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.is_draining = False
        self.active: set[Generation] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def is_ready(self) -> bool:
        return not self.is_draining and self.engine.is_alive

    def admit(self) -> None:
        """Raise 503 (with Retry-After) when no new work may start."""
        if self.is_draining:
            raise unavailable("The server is shutting down.")
        if not self.engine.is_alive:
            raise unavailable("The engine is not running.")
        if self.engine.is_sleeping:
            raise unavailable("The model is asleep (POST /wake_up wakes it).")

    def begin(self, generation: Generation) -> None:
        self.active.add(generation)
        self._idle.clear()

    def end(self, generation: Generation) -> None:
        self.active.discard(generation)
        if not self.active:
            self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, let in-flight requests finish for ``timeout_s``, abort the rest.

        Returns how many requests were aborted.
        """
        self.is_draining = True
        _LOG.info(
            "Draining: %d requests in flight, waiting up to %.1fs", len(self.active), timeout_s
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        aborted = len(self.active)
        if aborted:
            _LOG.info("Shutdown timeout reached: aborting %d requests", aborted)
            await self.abort_all()
        return aborted

    async def abort_all(self) -> None:
        """Stop admitting and end every request in flight now: each unfinished sample ends
        with ``"abort"`` (a stream sends its last chunk and ``[DONE]``)."""
        self.is_draining = True
        for generation in list(self.active):
            generation.cancel(abort=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)


async def watch_engine(
    engine: EngineClient, interval_s: float, on_engine_dead: Callable[[], None] | None
) -> None:
    """Poll the engine loop; when it dies, log once and call ``on_engine_dead``."""
    while engine.is_alive:
        await asyncio.sleep(interval_s)
    error = engine.dead_error
    _LOG.error("Engine loop is not running (%r); health turns 503", error)
    if on_engine_dead is not None:
        on_engine_dead()


async def log_stats_periodically(stats_logger: Any, interval_s: float) -> None:
    next_time = time.monotonic() + interval_s
    while True:
        await asyncio.sleep(max(0.0, next_time - time.monotonic()))
        next_time += interval_s
        try:
            stats_logger.log()
        except Exception:  # a stats hiccup must not stop the server
            _LOG.exception("stats logging failed")
