"""Generation: the engine requests behind one HTTP request, started, fanned in and ended together.

Made by ``api/completions.py`` / ``chat/completions.py`` from tokenized prompts; reads
``AsyncEngine.generate`` (one async iterator of ``RequestOutput`` deltas per prompt) and yields
``(prompt_index, delta)`` pairs. It ends in one of three ways: every engine request finishes; the
client disconnects (``cancel``: the iterators are closed, which aborts them in the engine); or the
server gives up on it while draining (``cancel(abort=True)``: the same, and unfinished samples end
with ``finish_reason="abort"``). Each finished engine request is reported to ``on_finish`` (metrics,
request log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.interfaces import EngineClient, EngineDeadError, QueueFullError
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server.api.errors import (
    APIError,
    bad_request,
    internal_error,
    rate_limited,
    unavailable,
)


@dataclasses.dataclass
class EngineRequest:
    """One prompt of an HTTP request, as the engine will see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, for echo and the request log
    # A pooling request (``/v1/embeddings``): ``params`` is unused, the engine's ``encode`` runs
    pooling: PoolingParams | None = None
    # An encoder text pair's token type ids (``/v1/score``, ``/v1/rerank``); None: all 0.
    token_type_ids: list[int] | None = None


@dataclasses.dataclass
class RequestRecord:
    """What the server saw of one engine request; handed to metrics and the request log."""

    request: EngineRequest
    start_time: float  # when the server handed it to the engine (time.time())
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    output_texts: dict[int, list[str]] | None = None  # kept only when prompts are logged
    engine_metrics: Any = None  # RequestMetrics of the final delta

    def observe(self, delta: RequestOutput, now: float) -> None:
        num_new = sum(len(o.token_ids) for o in delta.outputs)
        if num_new:
            if self.last_token_time is not None:
                self.inter_token_latencies.append(now - self.last_token_time)
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        self.num_generation_tokens += num_new
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        for out in delta.outputs:
            if out.finish_reason is not None:
                self.finish_reasons[out.index] = out.finish_reason
            if self.output_texts is not None:
                self.output_texts.setdefault(out.index, []).append(out.text)
        if delta.metrics is not None:
            self.engine_metrics = delta.metrics


class _Cancel:
    def __init__(self, abort: bool) -> None:
        self.abort = abort


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        requests: list[EngineRequest],
        priority: int = 0,
        cache_salt: str | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
        keep_texts: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.engine = engine
        self.lora_request = lora_request  # the adapter its prompts run with, if any
        self.requests = requests
        self.priority = priority
        self.cache_salt = cache_salt
        self.on_finish = on_finish
        self.records = [
            RequestRecord(r, 0.0, output_texts={} if keep_texts else None) for r in requests
        ]
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open: set[int] = set()  # prompt indices whose engine request has not finished
        self._pending: list[tuple[int, Any]] = []  # primed deltas (or a cancel), not yet yielded
        self.is_closed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Submit every prompt and wait for each one's first delta (or its error).

        Errors the engine raises on admission (queue full, invalid request, dead engine) are
        raised here as ``APIError``, before a streaming response has started.
        """
        now = time.time()
        for i, request in enumerate(self.requests):
            self.records[i].start_time = now
            self._open.add(i)
            self._pumps.append(asyncio.create_task(self._pump(i, request)))
        primed: set[int] = set()
        while len(primed) < len(self.requests):
            index, item = await self._queue.get()
            if isinstance(item, _Cancel):
                self._pending.append((index, item))
                return
            if isinstance(item, BaseException):
                await self.close()
                raise _to_api_error(item, at_start=True)
            self._pending.append((index, item))
            primed.add(index)

    async def _pump(self, index: int, request: EngineRequest) -> None:
        group_id = self.requests[0].request_id  # one admission turn for all its prompts
        if request.pooling is not None:
            stream = self.engine.encode(
                request.prompt_token_ids,
                request.pooling,
                request.request_id,
                prompt=request.prompt,
                priority=self.priority,
                group_id=group_id,
                token_type_ids=request.token_type_ids,
            )
        else:
            stream = self.engine.generate(
                request.prompt_token_ids,
                request.params,
                request.request_id,
                prompt=request.prompt,
                priority=self.priority,
                cache_salt=self.cache_salt,
                group_id=group_id,
                **({"lora_request": self.lora_request} if self.lora_request is not None else {}),
            )
        try:
            async for delta in stream:
                self._queue.put_nowait((index, delta))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            await stream.aclose()

    def cancel(self, abort: bool = False) -> None:
        """Stop early: on client disconnect (``abort=False``) or when the server gives up."""
        self._queue.put_nowait((-1, _Cancel(abort)))

    async def close(self) -> None:
        """Close every engine iterator (aborting unfinished requests in the engine)."""
        if self.is_closed:
            return
        self.is_closed = True
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    # -- deltas ----------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt_index, delta)`` until every prompt finished or the stream is cut.

        A cut by ``cancel(abort=True)`` yields one last delta per unfinished prompt whose
        unfinished samples end with ``"abort"``; an engine error raises ``APIError`` (500).
        """
        try:
            while self._open:
                if self._pending:
                    index, item = self._pending.pop(0)
                else:
                    index, item = await self._queue.get()
                if isinstance(item, _Cancel):
                    await self.close()
                    for i in sorted(self._open):
                        delta = self._abort_delta(i)
                        if item.abort:  # a disconnected client is sent nothing
                            yield i, delta
                    return
                if isinstance(item, BaseException):
                    raise _to_api_error(item, at_start=False)
                record = self.records[index]
                record.observe(item, time.time())
                if item.finished:
                    self._open.discard(index)
                    self._finish(record)
                yield index, item
        finally:
            await self.close()

    def _abort_delta(self, index: int) -> RequestOutput:
        record = self.records[index]
        request = record.request
        outputs = [
            CompletionOutput(index=i, finish_reason="abort")
            for i in range(request.params.n)
            if i not in record.finish_reasons
        ]
        delta = RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, finished=True
        )
        record.observe(delta, time.time())
        self._open.discard(index)
        self._finish(record)
        return delta

    def _finish(self, record: RequestRecord) -> None:
        if self.on_finish is not None:
            self.on_finish(record)


def _to_api_error(exc: BaseException, at_start: bool) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return rate_limited(str(exc))
    if isinstance(exc, EngineDeadError):
        return unavailable("The engine is not running.") if at_start else internal_error()
    if isinstance(exc, SamplingParamsError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, ValueError):
        # The engine's own request checks (``RequestError`` carries param and code).
        return bad_request(str(exc), getattr(exc, "param", None), getattr(exc, "code", None))
    return internal_error()
