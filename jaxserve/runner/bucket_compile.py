"""Compiling the programs of a set of token buckets: the model steps, then the sampler variants
and the prompt-logprob program of each bucket, in a pool of threads (lowering holds the GIL,
XLA's compile does not), and ``BackgroundCompile``, what warm-up leaves to compile while the
engine serves. ``warmup.warm_up`` decides which buckets compile when.
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
from jaxserve.runner.sampling import SamplerFlags

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
    at a time; a sampler with a new number of rows did not, even alone (its matmul by the
    head is timed on a 1 GiB copy of it), so those compile before the cache (``warm_up``).
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


def compile_buckets(
    runner: ModelRunner,
    pool: concurrent.futures.ThreadPoolExecutor,
    buckets: list[int],
    kv_cache: Any,
    start: float,
    raise_ready: bool = False,
    steps: bool = True,
    samplers: bool = True,
) -> None:
    """The programs of ``buckets``: model steps first, then the sampler variants and prompt
    logprobs (either alone: ``steps``, ``samplers``); raises the weights' load error as soon
    as it comes. ``raise_ready``: the background's compile, beside the KV cache
    (``BackgroundCompile.compile``), and ``runner.ready_tokens`` rises to each bucket whose
    programs (and all smaller buckets') are done."""
    # Each program's compile starts as soon as it is lowered, while the next one lowers; beside
    # the KV cache (the background), in the background's slots.
    compile_fn = runner.background.compile if raise_ready else _compile_whole_device
    if steps:
        _compile_steps(
            runner, pool, buckets, kv_cache, start, compile_fn, raise_ready and not samplers
        )
    if not samplers:
        return
    # NOTE: after the steps, not beside them: XLA times candidate kernels on the device
    # while it compiles, and the steps' choices are the ones that matter.
    variants = SamplerFlags.variants()
    _LOG.info(
        "Compiling %d sampler variants and the prompt-logprob program for each token "
        "bucket (%d programs)",
        len(variants),
        len(buckets) * (len(variants) + 1),
    )
    progress = _BucketProgress(runner, buckets, len(variants) + 1, start, raise_ready)
    others = []
    for lowered, table, key, bucket in _sampler_and_logprob_programs(runner, buckets, variants):
        _check(runner)
        future = pool.submit(compile_fn, lowered)
        future.add_done_callback(functools.partial(progress.done, bucket, table, key))
        others.append((future, table, key))
    for future, table, key in others:
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
    """The model step of each bucket; ``raise_ready`` (their samplers already compiled): each
    bucket's steps run once it and every smaller bucket are done."""
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
    """Called from the compiling threads as each sampler or prompt-logprob program finishes:
    puts it in the runner's table, logs each token bucket whose programs have all compiled,
    and (``raise_ready``) raises ``runner.ready_tokens`` to the largest bucket up to which
    every bucket is done."""

    def __init__(
        self,
        runner: ModelRunner,
        buckets: list[int],
        programs_per_bucket: int,
        start: float,
        raise_ready: bool,
    ) -> None:
        self.runner = runner
        self.buckets = buckets
        self.programs_per_bucket = programs_per_bucket
        self.start = start
        self.raise_ready = raise_ready
        self.num_done: collections.Counter[int] = collections.Counter()
        self.num_buckets_done = 0
        self.lock = threading.Lock()

    def done(self, bucket: int, table: dict, key: Any, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # raised by compile_buckets (or shut down); the bucket never becomes ready
        table[key] = future.result()
        with self.lock:
            self.num_done[bucket] += 1
            if self.num_done[bucket] < self.programs_per_bucket:
                return
            self.num_buckets_done += 1
            _LOG.info(
                "Compiled the sampler programs for %d tokens (%d/%d) at %.1f s",
                bucket,
                self.num_buckets_done,
                len(self.buckets),
                time.perf_counter() - self.start,
            )
            if self.raise_ready:
                _raise_ready(
                    self.runner,
                    self.buckets,
                    lambda b: self.num_done[b] >= self.programs_per_bucket,
                )


def _sampler_and_logprob_programs(
    runner: ModelRunner, buckets: list[int], variants: tuple[SamplerFlags, ...]
) -> Iterator[tuple[Any, dict, object, int]]:
    """(lowered program, the runner's table for it, its key, its token bucket) for every
    sampler variant and the prompt logprobs of every token bucket, lowered against arguments
    laid out as at run time."""
    hidden_size, dtype = runner.model_config.hidden_size, runner.dtype
    for bucket in buckets:
        hidden = runner.put(np.zeros((bucket, hidden_size), dtype))
        for flags in variants:
            batch, inputs = runner.inputs.padding_step(bucket, flags)
            packed, layout = pack((batch.logits_indices, inputs))
            lowered = runner.sample_fn.lower(
                runner.head,
                hidden,
                runner.put(packed),
                layout=layout,
                tied=runner.tied,
                flags=flags,
            )
            yield lowered, runner.compiled_samplers, (bucket, flags), bucket
        next_ids = runner.put(np.zeros(bucket, np.int32))
        lowered = runner.prompt_lp_fn.lower(runner.head, hidden, next_ids, tied=runner.tied)
        yield lowered, runner.compiled_prompt_lp, bucket, bucket
