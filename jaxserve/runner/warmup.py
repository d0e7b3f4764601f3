"""Warm-up: every program a request can reach is compiled before the server takes traffic.

The model step is compiled ahead of time for every token bucket, in parallel threads (lowering
holds the GIL, XLA's compile does not); then the sampler variants and the prompt-logprob
program of every bucket. Then the KV cache is allocated and one step of the smallest bucket
runs end to end (model step, both sampler kinds, and the pending-token feed of every bucket,
which compiles on that first call), so a broken program fails the start, not a request.

NOTE: the larger buckets are compiled but not run. Running each once added nothing the compile
had not done, and on the CPU the reference attention's largest steps took 12-16 s of a demo
start and most of its peak memory (2,048 tokens: 4.5 GB; ``LLM()``'s 8,192: 10.8 GB).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.models.weights import format_bytes
from jaxserve.runner.packing import pack
from jaxserve.runner.sampling import SamplerFlags

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner

_LOG = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir``: a second start loads what warm-up
    compiled instead of compiling it again."""
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # NOTE: every program, however quick to compile: the ~100 sampler and prompt-logprob
    # programs take 0.1-0.4 s each on the CPU; under a 0.5 s floor none was cached, and
    # compiling them again made 9 s of every warm start of the demo model.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def warm_up(runner: ModelRunner, max_workers: int) -> int:
    """Compile every program (with ``serve_while_compiling``, the smallest bucket's and the
    sampler programs of the decode-sized buckets; the other model steps then compile on a
    thread of their own while the engine serves, the decode-sized ones first, then the larger
    buckets' programs, ``runner.ready_tokens`` rising as each bucket is ready), wait for the
    weights, allocate the KV cache and run one small step; returns the number of model step
    shapes compiled before serving."""
    start = time.perf_counter()
    buckets = runner.token_buckets
    first, decode, prefill = buckets, [], []
    if runner.config.serve_while_compiling and not runner.multihost:
        # NOTE: one model step, then serve. With a full compilation cache each step program
        # still lowers for 1.5-2 s (the Mosaic GPU attention kernel's lowering most of it):
        # the five decode buckets of 256 sequences made 10 s of a 31 s warm start of
        # Llama-3-8B on the H200. Serving 16-token steps meanwhile is better than not serving.
        # The decode buckets' sampler programs still compile first: each has a matmul by the
        # head with its own number of rows, and XLA's autotuner times it on a copy of the head
        # (1 GiB for Llama-3's vocabulary), which does not fit beside the KV cache (measured:
        # every one of them ran out of memory there). The larger buckets' samplers have the
        # rows of the largest decode bucket, whose timings XLA keeps.
        first = buckets[:1]
        decode = [b for b in buckets[1:] if b <= runner.max_seq_bucket]
        prefill = buckets[1 + len(decode) :]
    workers = max(1, min(max_workers, os.cpu_count() or 1))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    kv_cache = runner.abstract_kv_cache()
    runner.ready_tokens = 0
    try:
        with fewer_collections():
            _compile(runner, pool, first, kv_cache, start)
            if decode:
                _compile(runner, pool, decode, kv_cache, start, steps=False)
        waited = time.perf_counter()
        runner.wait_for_weights()
        if runner.loading.shapes is not None:
            _LOG.info(
                "Weights ready %.1f s after the compile (%.1f s to load, beside it)",
                time.perf_counter() - waited,
                runner.load_seconds,
            )
        _log_free_memory(runner)
        allocated = time.perf_counter()
        runner.allocate_kv_cache()
        jax.block_until_ready(runner.kv_cache)
        _LOG.info(
            "Allocated the KV cache (%s) in %.1f s",
            format_bytes(runner.capacity.kv_budget_bytes),
            time.perf_counter() - allocated,
        )
        _run_smallest_step(runner)
    except BaseException:
        pool.shutdown(cancel_futures=True)
        raise
    runner.compile_seconds = time.perf_counter() - start
    runner.ready_tokens = first[-1]
    if not decode and not prefill:
        pool.shutdown()
        return len(first)
    _LOG.info(
        "Serving steps of up to %d tokens; the buckets of %s tokens compile in the background",
        first[-1],
        ", ".join(map(str, decode + prefill)),
    )

    def compile_rest() -> None:
        group: list[int] = []
        try:
            # precision: a context of the thread that enters it, so entered here
            with runner.precision(), fewer_collections():
                if decode:
                    group = decode
                    _compile(
                        runner, pool, decode, kv_cache, start, raise_ready=True, samplers=False
                    )
                if prefill:
                    group = prefill
                    _compile(runner, pool, prefill, kv_cache, start, raise_ready=True)
            _LOG.info(
                "Compiled every bucket at %.1f s; steps of up to %d tokens run",
                time.perf_counter() - start,
                buckets[-1],
            )
        except Exception:  # the engine keeps serving the steps it has compiled
            if not runner.background.stopping.is_set():  # else the runner shut down meanwhile
                _LOG.exception("Compiling the buckets of %s tokens failed", group)
        finally:
            pool.shutdown()
            if sys.getswitchinterval() == BACKGROUND_SWITCH_INTERVAL_S:  # else changed since
                sys.setswitchinterval(interval)

    runner.background.pool = pool
    interval = sys.getswitchinterval()
    sys.setswitchinterval(BACKGROUND_SWITCH_INTERVAL_S)
    runner.background.thread = threading.Thread(target=compile_rest, name="compile-rest")
    runner.background.thread.start()
    return len(first)


def _log_free_memory(runner: ModelRunner) -> None:
    """With the weights in place, before the KV cache: what the first device's allocator holds
    and the largest block it has free (the cache's per-layer arrays each need one block; a
    load that left its free memory in pieces fails here, and this line says so first)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "largest_free_block_bytes" not in stats:
        return  # the CPU backend keeps no such statistics
    largest = int(stats["largest_free_block_bytes"])
    _LOG.info(
        "Device memory with the weights in place: %s in use, largest free block %s",
        format_bytes(int(stats.get("bytes_in_use", 0))),
        format_bytes(largest),
    )
    if largest < runner.capacity.kv_budget_bytes:
        _LOG.warning(
            "The largest free block (%s) is smaller than the KV cache (%s): its allocation may "
            "fail; lower --gpu-memory-utilization or set --num-gpu-blocks-override",
            format_bytes(largest),
            format_bytes(runner.capacity.kv_budget_bytes),
        )


@contextlib.contextmanager
def fewer_collections(threshold: int = 100_000) -> Iterator[None]:
    """The interpreter's youngest generation collected every ``threshold`` allocations
    instead of 700, while programs lower: lowering makes millions of short-lived objects, and
    each collection also runs JAX's callback into XLA. In the H200's warm start (a real 8B
    checkpoint) that callback alone took 5.0 s of the main thread's 33 s
    (``benchmarks/startup_profile.py``)."""
    before = gc.get_threshold()
    gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


BACKGROUND_SLOTS = 4  # compiles at a time once the KV cache is allocated
BACKGROUND_RETRIES = 3  # compiles alone after running out of device memory
# While the background lowers (Python under the interpreter lock), the engine thread waits for
# the lock at each handoff for up to the switch interval (5 ms by default): 16-token steps of
# the first request took about 90 ms each on the H200 (TTFT 2.5-3.3 s for 512 tokens).
BACKGROUND_SWITCH_INTERVAL_S = 0.0005


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


def _compile(
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
        ready = runner.ready_tokens
        for bucket in buckets:
            if bucket not in runner.compiled_steps:
                break
            ready = bucket
        if raise_ready and ready > runner.ready_tokens:
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
            return  # raised by _compile (or shut down); the bucket never becomes ready
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
            if not self.raise_ready:
                return
            ready = self.runner.ready_tokens
            for b in self.buckets:
                if self.num_done[b] < self.programs_per_bucket:
                    break
                ready = b
            if ready > self.runner.ready_tokens:
                _LOG.info("Steps of up to %d tokens now run", ready)
                self.runner.ready_tokens = ready


def _run_smallest_step(runner: ModelRunner) -> None:
    """One padding step of the smallest bucket through the model step and both sampler kinds,
    then one that reads its input ids from those samples (the pending-token feed)."""
    batch, inputs = runner.inputs.padding_step(runner.token_buckets[0])
    with runner.precision():
        runner.kv_cache, hidden = runner.run_step(batch)
        for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
            out = runner.sample(hidden, np.asarray(batch.logits_indices), inputs, flags)
            jax.block_until_ready(out.token_ids)
        source = np.zeros(batch.num_tokens, np.int32)
        runner.kv_cache, hidden = runner.run_step(batch, source, out.token_ids)
        jax.block_until_ready(hidden)


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
