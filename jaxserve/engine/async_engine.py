"""AsyncEngine: the asyncio face of the engine, used by the HTTP server.

The step loop (``EngineCore``) runs in one dedicated thread. ``generate`` submits a request and
yields ``RequestOutput`` deltas from a per-request ``asyncio.Queue`` that the engine thread
fills through ``loop.call_soon_threadsafe``, one call a step for all of them; leaving the
iterator early (client disconnect, cancellation) aborts the request, which frees its blocks
within one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from jaxserve.engine.core import EngineCore
from jaxserve.engine.interfaces import EngineDeadError, EngineStats, QueueFullError
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.scoring import ScoringModel
from jaxserve.engine_config import EngineConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
PAUSE_MODES = ("wait", "abort", "keep")


class AsyncEngine:
    def __init__(self, core: EngineCore, max_queued_requests: int | None = None) -> None:
        self.core = core
        self.config: EngineConfig = core.config
        self.model_config = core.model_config
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.max_queued_requests = max_queued_requests
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.dead_error: BaseException | None = None
        # Weight updates waiting for the engine to be quiet (``_between_steps``).
        self._jobs: list[tuple[Callable[[], Any], concurrent.futures.Future[Any], bool]] = []
        self._paused: str | None = None  # a mode of PAUSE_MODES while paused
        self._jobs_lock = threading.Lock()

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_queued_requests: int | None = None
    ) -> AsyncEngine:
        return cls(EngineCore(config), max_queued_requests)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.core.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    @property
    def scoring(self) -> ScoringModel:
        """Whether and how the model scores pairs (``/v1/score``, ``/v1/rerank``)."""
        return self.core.scoring

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    def num_unfinished(self) -> int:
        return self.core.num_unfinished()

    def stats(self) -> EngineStats:
        return self.core.stats

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """Yield deltas until one with ``finished=True``; validation errors raise ValueError."""
        # (an engine double without adapters takes no such argument)
        adapter: dict[str, Any] = {} if lora_request is None else {"lora_request": lora_request}
        add = functools.partial(
            self.core.add_request,
            request_id,
            list(prompt_token_ids),
            params,
            prompt=prompt,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=time.time(),
            group_id=group_id,
            **adapter,
        )
        async for output in self._outputs(request_id, params.num_samples, add):
            yield output

    async def encode(
        self,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        group_id: str | None = None,
        token_type_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """A pooling request (``--runner pooling``): yields its one finished output, whose
        ``embedding`` (or with ``task="score"``, ``score``) is set; validation errors raise
        ValueError (``RequestError``). ``token_type_ids``: an encoder pair's."""
        add = functools.partial(
            self.core.add_pooling_request,
            request_id,
            list(prompt_token_ids),
            params,
            prompt=prompt,
            priority=priority,
            arrival_time=time.time(),
            group_id=group_id,
            token_type_ids=list(token_type_ids) if token_type_ids is not None else None,
        )
        async for output in self._outputs(request_id, 1, add):
            yield output

    async def _outputs(
        self, request_id: str, num_seqs: int, add: Callable[[], None]
    ) -> AsyncGenerator[RequestOutput]:
        """Queue a request (``add``) and yield its outputs until the finished one; leaving
        early aborts it."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine loop died: {self.dead_error!r}")
        if (
            self.max_queued_requests is not None
            and self.core.num_waiting() + num_seqs > self.max_queued_requests
        ):
            raise QueueFullError(
                f"waiting queue is full ({self.max_queued_requests} requests); retry later"
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        try:
            add()
        except Exception:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.core.abort_request(request_id)
                self._wake.set()

    async def compile_grammar(self, params: SamplingParams, client: str = "") -> None:
        if params.structured_outputs is not None:
            await self.core.grammar_compiler.compile_async(params.structured_outputs, client)

    async def update_weights_from_disk(self, model_path: str | Path) -> float:
        """Serve the checkpoint in ``model_path`` (this model's tensors and shapes; safetensors
        or converted with orbax); the load's seconds. No waiting request starts meanwhile: the
        running ones finish on the old weights, the weights change, and the waiting ones start
        on the new.
        A checkpoint that does not fit raises before anything changes."""
        load = functools.partial(self.core.runner.load_weights_from, model_path)
        return await self._between_steps(functools.partial(self.core.swap_weights, load))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter on a worker thread (``AdapterError`` if it does not fit);
        requests may then name it."""
        await asyncio.get_running_loop().run_in_executor(None, self.core.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    @property
    def is_sleeping(self) -> bool:
        return self.core.is_sleeping

    async def sleep(self, level: int) -> None:
        """Give the model's device memory up once the running sequences finish (sleep mode:
        ``runner/sleep.py``); requests wait until it wakes."""
        await self._between_steps(functools.partial(self.core.sleep, level))

    async def wake_up(self, tags: tuple[str, ...]) -> None:
        await self._between_steps(functools.partial(self.core.wake_up, tags))

    @property
    def is_paused(self) -> bool:
        return self._paused is not None

    async def pause(self, mode: str = "wait") -> None:
        """Stop generating until ``resume``, as a training loop does between rollout batches:
        ``"wait"`` lets the running sequences finish first, ``"abort"`` aborts every request
        (each ends with finish_reason "abort"), ``"keep"`` freezes the running ones in place
        (their KV cache kept) after the step on the device. New requests wait meanwhile."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r} must be one of {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            for request_id in list(self._queues):
                self.core.abort_request(request_id)
        await self._between_steps(functools.partial(self._set_paused, mode), mode != "keep")

    async def resume(self) -> None:
        await self._between_steps(functools.partial(self._set_paused, None), False)

    def _set_paused(self, mode: str | None) -> None:
        self._paused = mode

    async def _between_steps(self, action: Callable[[], _T], needs_quiet: bool = True) -> _T:
        """``action`` on the engine thread between steps: with ``needs_quiet``, once no
        sequence runs and no step is on the device (admission stopped until then), else once
        the step on the device is read back."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._jobs_lock:
            if self.dead_error is not None or self._stop.is_set():
                raise EngineDeadError("the engine has stopped")
            self._jobs.append((action, future, needs_quiet))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def _run_jobs(self) -> bool:
        """The first action ``_between_steps`` asked for, when the engine is ready for it;
        False while it waits for sequences to finish (or there is none)."""
        if not self._jobs:  # every step: no lock taken while nothing is asked for
            return False
        with self._jobs_lock:
            if not self._jobs:
                return False
            action, future, needs_quiet = self._jobs[0]
            if needs_quiet and not self.core.is_quiet() and self._paused == "keep":
                self._jobs.pop(0)  # nothing will finish while the sequences are kept
                future.set_exception(
                    RuntimeError(
                        "paused with sequences kept in place: resume, or pause with "
                        "mode wait or abort, before the weights change or it sleeps"
                    )
                )
                return True
            if needs_quiet:
                self.core.scheduler.is_admitting = False
                if not self.core.is_quiet():
                    return False
            self._jobs.pop(0)
        if not needs_quiet:
            self._deliver_all(self.core.settle())  # the step on the device, read back
        try:
            future.set_result(action())
        except Exception as exc:  # the action's error, to its caller; the engine goes on
            future.set_exception(exc)
        self.core.scheduler.is_admitting = self._paused is None
        return True

    async def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------

    def _deliver(self, output: RequestOutput | BaseException, request_id: str) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, output)
        except RuntimeError:  # the event loop is closed
            pass

    def _deliver_all(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs to their requests' queues, one wake-up of each event loop for all
        (``call_soon_threadsafe`` writes to the loop's wake-up pipe each call: one call an
        output took 1.9 ms of this thread a step at 1,000 streams, 0.02 ms for one call)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for output in outputs:
            entry = self._queues.get(output.request_id)
            if entry is not None:
                loop, queue = entry
                batches.setdefault(loop, []).append((queue, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed
                pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._run_jobs():
                    continue
                if self.core.is_sleeping or self._paused:  # aborts taken; requests wait
                    self._deliver_all(self.core.drain_inbox())
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                if not self.core.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._deliver_all(self.core.step())
        except BaseException as exc:  # the loop must never die silently
            _LOG.exception("engine loop died")
            self.dead_error = exc
            error = EngineDeadError(f"engine loop died: {exc!r}")
            for request_id in list(self._queues):
                self._deliver(error, request_id)
        finally:  # a weight update asked for and never run fails (the engine stopped or died)
            with self._jobs_lock:
                jobs, self._jobs = self._jobs, []
            for _, future, _ in jobs:
                future.set_exception(EngineDeadError("the engine stopped before the update ran"))


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On the event loop: each output into its request's queue, in the step's order."""
    for queue, output in items:
        queue.put_nowait(output)
