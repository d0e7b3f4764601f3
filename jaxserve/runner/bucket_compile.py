"""Compiling the programs of a set of token buckets: the model steps, then the logits, the
sampler variants and the prompt-logprob program of each bucket, in a pool of threads
(lowering holds the GIL, XLA's compile does not), and ``BackgroundCompile``, what warm-up
leaves to compile while the engine serves. ``warmup.warm_up`` decides which compile when.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.runner.packing import pack

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner

# The warm-up's lines, under one name: users filter them as one story.
_LOG = logging.getLogger("jaxserve.runner.warmup")

BACKGROUND_SLOTS = 4  # compiles at a time once the KV cache is allocated
BACKGROUND_RETRIES = 3  # compiles alone after running out of device memory


@dataclasses.dataclass
class BackgroundCompile:
    """The buckets warm-up leaves to compile while the engine serves (``serve_while_compiling``).

    NOTE: XLA's autotuner times candidate kernels on buffers of each program's shapes. Once
    the KV cache is allocated only the activation headroom is left (1.3 GiB on the H200 for
    Llama-3-8B). Measured there: model steps of up to 256 tokens compiled beside it, sixteen
    at a time; a sampler with a new number of rows did not, even alone, while it held the
    matmul by the head (timed on a 1 GiB copy of it): that matmul is now a program of its own
    (``programs.logits_step``), compiled before the cache (``warm_up``).
    Four compile at a time here, and one that runs out of memory compiles again alone."""

    thread: threading.Thread | None = None
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    slots: threading.Semaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(BACKGROUND_SLOTS)
    )
    _alone: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def compile(self, lowered: Any) -> Any:
        """``lowered.compile()`` in one of the slots; out of device memory, again alone (every
        slot held), up to ``BACKGROUND_RETRIES`` times a second apart."""
        for attempt in range(BACKGROUND_RETRIES + 1):
            if attempt:
                time.sleep(1.0)
            with self._alone if attempt else contextlib.nullcontext():
                held = BACKGROUND_SLOTS if attempt else 1
                for _ in range(held):
                    self.slots.acquire()
                try:
                    if self.stopping.is_set():
                        raise concurrent.futures.CancelledError("the runner shut down")
                    return lowered.compile()
                except jax.errors.JaxRuntimeError as exc:
                    if "RESOURCE_EXHAUSTED" not in str(exc) or attempt == BACKGROUND_RETRIES:
                        raise
                    _LOG.info("Out of device memory compiling a program; again, alone")
                finally:
                    for _ in range(held):
                        self.slots.release()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Cancel what has not started and wait for what has (a compile thread still running
        at the interpreter's exit can crash it)."""
        self.stopping.set()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.thread is not None:
            self.thread.join()


# The programs of a token bucket besides its model step (``compile_buckets``' ``programs``).
PROGRAMS = ("logits", "prompt_logprobs", "samplers")


def compile_buckets(
    runner: ModelRunner,
    pool: concurrent.futures.ThreadPoolExecutor,
    buckets: list[int],
    kv_cache: Any,
    start: float,
    raise_ready: bool = False,
    steps: bool = True,
    programs: tuple[str, ...] = PROGRAMS,
) -> None:
    """The programs of ``buckets``: model steps first (unless ``steps`` is off), then those
    of ``programs`` not compiled yet (the sampler variants belong to a sequence bucket, which
    several token buckets share); raises the weights' load error as soon as it comes.
    ``raise_ready``: the background's compile, beside the KV cache
    (``BackgroundCompile.compile``), and ``runner.ready_tokens`` rises to each bucket whose
    programs (and all smaller buckets') are done."""
    # Each program's compile starts as soon as it is lowered, while the next one lowers; beside
    # the KV cache (the background), in the background's slots.
    compile_fn = runner.background.compile if raise_ready else _compile_whole_device
    todo = list(_bucket_programs(runner, buckets, programs))
    if steps:
        _compile_steps(runner, pool, buckets, kv_cache, start, compile_fn, raise_ready and not todo)
    if not todo:
        return
    # NOTE: after the steps, not beside them: XLA times candidate kernels on the device
    # while it compiles, and the steps' choices are the ones that matter.
    kinds = collections.Counter(kind for kind, *_ in todo)
    names = {"logits": "the logits", "prompt_logprobs": "the prompt logprobs"}
    what = [names.get(kind, f"{kinds[kind]} sampler variants") for kind in PROGRAMS if kinds[kind]]
    _LOG.info(
        "Compiling %s for the buckets of %s tokens (%d programs)",
        " and ".join([", ".join(what[:-1]), what[-1]] if len(what) > 1 else what),
        ", ".join(map(str, buckets)),
        len(todo),
    )
    progress = _BucketProgress(runner, buckets, todo, start, raise_ready)
    futures = []
    specs: dict[int, jax.ShapeDtypeStruct] = {}  # the samplers' logits, per number of rows
    for kind, table, key, bucket in todo:
        _check(runner)
        future = pool.submit(compile_fn, _lower(runner, kind, key, specs))
        future.add_done_callback(functools.partial(progress.done, bucket, table, key))
        futures.append((future, table, key))
    for future, table, key in futures:
        runner.loading.raise_if_failed()
        table[key] = future.result()  # the callback may not have run yet


def _compile_steps(
    runner: ModelRunner,
    pool: concurrent.futures.ThreadPoolExecutor,
    buckets: list[int],
    kv_cache: Any,
    start: float,
    compile_fn: Callable[[Any], Any],
    raise_ready: bool,
) -> None:
    """The model step of each bucket; ``raise_ready`` (their other programs already compiled):
    each bucket's steps run once it and every smaller bucket are done."""
    _LOG.info(
        "Compiling the model step for %d token bucket%s (%s)",
        len(buckets),
        "" if len(buckets) == 1 else "s",
        ", ".join(map(str, buckets)),
    )
    futures = {}
    for bucket in buckets:
        _check(runner)
        lowered = runner.lower_step(bucket, kv_cache)
        futures[pool.submit(compile_fn, lowered)] = bucket
    for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
        runner.loading.raise_if_failed()
        runner.compiled_steps[futures[future]] = future.result()
        _LOG.info(
            "Compiled model step for %d tokens (%d/%d) at %.1f s",
            futures[future],
            done,
            len(buckets),
            time.perf_counter() - start,
        )
        if raise_ready:
            _raise_ready(runner, buckets, lambda b: b in runner.compiled_steps)


def _raise_ready(runner: ModelRunner, buckets: list[int], is_done: Callable[[int], bool]) -> None:
    """Raise ``runner.ready_tokens`` to the largest of ``buckets`` up to which every one is
    done (ascending; the smaller buckets outside them are ready already)."""
    ready = runner.ready_tokens
    for bucket in buckets:
        if not is_done(bucket):
            break
        ready = bucket
    if ready > runner.ready_tokens:
        _LOG.info("Steps of up to %d tokens now run", ready)
        runner.ready_tokens = ready


def _compile_whole_device(lowered: Any) -> Any:
    return lowered.compile()


def _check(runner: ModelRunner) -> None:
    """Between lowerings: the weights' load error, or the runner's shutdown."""
    runner.loading.raise_if_failed()
    if runner.background.stopping.is_set():
        raise concurrent.futures.CancelledError("the runner shut down")


class _BucketProgress:
    """Called from the compiling threads as each of ``todo``'s programs finishes: puts it in
    the runner's table, logs each token bucket whose programs have all compiled, and
    (``raise_ready``) raises ``runner.ready_tokens`` to the largest bucket up to which every
    bucket is done."""

    def __init__(
        self,
        runner: ModelRunner,
        buckets: list[int],
        todo: list[tuple[str, dict, Any, int]],
        start: float,
        raise_ready: bool,
    ) -> None:
        self.runner = runner
        self.buckets = buckets
        self.left = collections.Counter(bucket for *_, bucket in todo)
        self.start = start
        self.raise_ready = raise_ready
        self.num_buckets_done = len(buckets) - len(self.left)
        self.lock = threading.Lock()
        if raise_ready:  # buckets with nothing left to compile
            _raise_ready(runner, buckets, lambda b: self.left[b] == 0)

    def done(self, bucket: int, table: dict, key: Any, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # raised by compile_buckets (or shut down); the bucket never becomes ready
        table[key] = future.result()
        with self.lock:
            self.left[bucket] -= 1
            if self.left[bucket] > 0:
                return
            self.num_buckets_done += 1
            _LOG.info(
                "Compiled the programs of %d tokens (%d/%d) at %.1f s",
                bucket,
                self.num_buckets_done,
                len(self.buckets),
                time.perf_counter() - self.start,
            )
            if self.raise_ready:
                _raise_ready(self.runner, self.buckets, lambda b: self.left[b] == 0)


def _bucket_programs(
    runner: ModelRunner, buckets: list[int], programs: tuple[str, ...]
) -> Iterator[tuple[str, dict, Any, int]]:
    """(kind, the runner's table for it, its key, its token bucket) of each program of
    ``programs`` that ``buckets`` need and the runner has not compiled: the logits and the
    prompt logprobs per token bucket, the sampler variants per sequence bucket."""
    queued: set[Any] = set()
    for bucket in buckets:
        rows = runner.inputs.seq_bucket(bucket)
        wanted: list[tuple[str, dict, Any]] = []
        if "logits" in programs:
            wanted.append(("logits", runner.compiled_logits, bucket))
        if "prompt_logprobs" in programs:
            wanted.append(("prompt_logprobs", runner.compiled_prompt_lp, bucket))
        if "samplers" in programs:
            for flags in runner.inputs.sampler_variants:
                wanted.append(("samplers", runner.compiled_samplers, (rows, flags)))
        for kind, table, key in wanted:
            if key not in table and (kind, key) not in queued:
                queued.add((kind, key))
                yield kind, table, key, bucket


def _lower(runner: ModelRunner, kind: str, key: Any, specs: dict) -> Any:
    """The program ``kind`` of ``key`` (a token bucket, or a sampler's (sequence bucket,
    variant)), lowered against arguments laid out as at run time; ``specs``: the samplers'
    logits found so far, by number of rows."""
    if kind == "samplers":
        rows, flags = key
        _, inputs = runner.inputs.padding_step(rows, flags)
        packed, layout = pack(inputs)
        if rows not in specs:
            specs[rows] = _logits_spec(runner, rows)
        logits = specs[rows]
        return runner.sample_fn.lower(logits, runner.put(packed), layout=layout, flags=flags)
    hidden = runner.put(np.zeros((key, runner.model_config.hidden_size), runner.dtype))
    if kind == "logits":
        packed, layout = runner.step_inputs(runner.inputs.padding_step(key)[0])
        return runner.logits_fn.lower(
            runner.head, hidden, runner.put(packed), layout, tied=runner.tied
        )
    next_ids = runner.put(np.zeros(key, np.int32))
    return runner.prompt_lp_fn.lower(runner.head, hidden, next_ids, tied=runner.tied)


def _logits_spec(runner: ModelRunner, rows: int) -> jax.ShapeDtypeStruct:
    """The logits a sampler of ``rows`` rows takes, as the logits program returns them
    (replicated; not made: 128 MiB at 256 rows of a 128k vocabulary)."""
    hidden = runner.put(np.zeros((rows, runner.model_config.hidden_size), runner.dtype))
    packed, layout = runner.step_inputs(runner.inputs.padding_step(rows)[0])
    logits = functools.partial(runner.logits_fn, layout=layout, tied=runner.tied)
    shape = jax.eval_shape(logits, runner.head, hidden, runner.put(packed))
    sharding = runner.tp.replicated if runner.tp is not None else hidden.sharding
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
