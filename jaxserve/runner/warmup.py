"""Warm-up: every program a request can reach is compiled before the server takes traffic (or,
with ``serve_while_compiling``, those of the smallest bucket and every matmul by the head, the
rest in the background: ``warm_up``).

The model step is compiled ahead of time for every token bucket, in parallel threads (lowering
holds the GIL, XLA's compile does not); then the logits, the sampler variants and the
prompt-logprob program of every bucket (``bucket_compile``). Then the KV cache is allocated
and one step of the smallest bucket runs end to end (model step, both sampler kinds, and the
pending-token feed of every bucket, which compiles on that first call), so a broken program
fails the start, not a request.

NOTE: the larger buckets are compiled but not run. Running each once added nothing the compile
had not done, and on the CPU the reference attention's largest steps took 12-16 s of a demo
start and most of its peak memory (2,048 tokens: 4.5 GB; ``LLM()``'s 8,192: 10.8 GB).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.runner import bucket_compile
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
    matmuls by the head of the others; the other model steps then compile on a
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
        # The programs with a matmul by the head (the logits of every bucket, the prompt
        # logprobs of the decode buckets) still compile first: XLA's autotuner times each new
        # number of rows on a copy of the head (1 GiB for Llama-3's vocabulary), which does
        # not fit beside the KV cache (measured: every sampler of a new bucket ran out of
        # memory there while the matmul was in them). The larger buckets' prompt logprobs, in
        # chunks of 128 rows, compiled beside it.
        first = buckets[:1]
        decode = [b for b in buckets[1:] if b <= runner.max_seq_bucket]
        prefill = buckets[1 + len(decode) :]
    workers = max(1, min(max_workers, os.cpu_count() or 1))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    kv_cache = runner.abstract_kv_cache()
    runner.ready_tokens = 0
    try:
        with fewer_collections():
            bucket_compile.compile_buckets(runner, pool, first, kv_cache, start)
            if decode or prefill:
                heads = ("logits", "prompt_logprobs")
                bucket_compile.compile_buckets(
                    runner, pool, decode, kv_cache, start, steps=False, programs=heads
                )
                bucket_compile.compile_buckets(
                    runner, pool, prefill, kv_cache, start, steps=False, programs=heads[:1]
                )
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
    except BaseException:  # the compiles running finish before the interpreter exits
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    runner.compile_seconds = time.perf_counter() - start
    _LOG.info(
        "Compiled %d step shapes in %.1f s (compilation cache: %s)",
        len(first),
        runner.compile_seconds,
        runner.config.cache_dir,
    )
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
                    bucket_compile.compile_buckets(
                        runner, pool, decode, kv_cache, start, raise_ready=True
                    )
                if prefill:
                    group = prefill
                    bucket_compile.compile_buckets(
                        runner, pool, prefill, kv_cache, start, raise_ready=True
                    )
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


# While the background lowers (Python under the interpreter lock), the engine thread waits for
# the lock at each handoff for up to the switch interval (5 ms by default): 16-token steps of
# the first request took about 90 ms each on the H200 (TTFT 2.5-3.3 s for 512 tokens).
BACKGROUND_SWITCH_INTERVAL_S = 0.0005


def _run_smallest_step(runner: ModelRunner) -> None:
    """One padding step of the smallest bucket through the model step and both sampler kinds,
    then one that reads its input ids from those samples (the pending-token feed)."""
    batch, inputs = runner.inputs.padding_step(runner.token_buckets[0])
    with runner.precision():
        runner.kv_cache, forward = runner.run_step(batch)
        for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
            out = runner.sample(forward, inputs, flags)
            jax.block_until_ready(out.token_ids)
        source = np.zeros(batch.num_tokens, np.int32)
        runner.kv_cache, forward = runner.run_step(batch, source, out.token_ids)
        jax.block_until_ready(forward.hidden)
