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
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
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
    """Compile every program, then run one small step; returns the number of model step
    shapes compiled."""
    start = time.perf_counter()
    kv_cache = runner.kv_cache if runner.kv_cache is not None else runner.abstract_kv_cache()
    buckets = runner.token_buckets
    variants = SamplerFlags.variants()
    _LOG.info(
        "Compiling the model step for %d token buckets (%s)",
        len(buckets),
        ", ".join(map(str, buckets)),
    )
    workers = max(1, min(max_workers, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # Each program's compile starts as soon as it is lowered, while the next one lowers.
        steps = {}
        for bucket in buckets:
            lowered = runner.lower_step(bucket, kv_cache)
            steps[pool.submit(lowered.compile)] = bucket
        for done, future in enumerate(concurrent.futures.as_completed(steps), 1):
            runner.compiled_steps[steps[future]] = future.result()
            _LOG.info(
                "Compiled model step for %d tokens (%d/%d) at %.1f s",
                steps[future],
                done,
                len(buckets),
                time.perf_counter() - start,
            )
        # NOTE: after the steps, not beside them: XLA times candidate kernels on the device
        # while it compiles, and the steps' choices are the ones that matter.
        _LOG.info(
            "Compiling %d sampler variants and the prompt-logprob program for each token "
            "bucket (%d programs)",
            len(variants),
            len(buckets) * (len(variants) + 1),
        )
        progress = _BucketProgress(len(buckets), len(variants) + 1, start)
        others = {}
        for lowered, table, key, bucket in _sampler_and_logprob_programs(runner, variants):
            future = pool.submit(lowered.compile)
            future.add_done_callback(functools.partial(progress.done, bucket))
            others[future] = (table, key)
        for future, (table, key) in others.items():
            table[key] = future.result()
    allocated = time.perf_counter()
    runner.allocate_kv_cache()
    jax.block_until_ready(runner.kv_cache)
    _LOG.info(
        "Allocated the KV cache (%s) in %.1f s",
        format_bytes(runner.capacity.kv_budget_bytes),
        time.perf_counter() - allocated,
    )
    _run_smallest_step(runner)
    runner.compile_seconds = time.perf_counter() - start
    return len(buckets)


class _BucketProgress:
    """Logs each token bucket whose sampler programs have all compiled (called from the
    compiling threads, as each program finishes)."""

    def __init__(self, num_buckets: int, programs_per_bucket: int, start: float) -> None:
        self.num_buckets = num_buckets
        self.programs_per_bucket = programs_per_bucket
        self.start = start
        self.num_done: collections.Counter[int] = collections.Counter()
        self.num_buckets_done = 0
        self.lock = threading.Lock()

    def done(self, bucket: int, _: concurrent.futures.Future) -> None:
        with self.lock:
            self.num_done[bucket] += 1
            if self.num_done[bucket] < self.programs_per_bucket:
                return
            self.num_buckets_done += 1
            _LOG.info(
                "Compiled the sampler programs for %d tokens (%d/%d) at %.1f s",
                bucket,
                self.num_buckets_done,
                self.num_buckets,
                time.perf_counter() - self.start,
            )


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
    runner: ModelRunner, variants: tuple[SamplerFlags, ...]
) -> Iterator[tuple[Any, dict, object, int]]:
    """(lowered program, the runner's table for it, its key, its token bucket) for every
    sampler variant and the prompt logprobs of every token bucket, lowered against arguments
    laid out as at run time."""
    hidden_size, dtype = runner.model_config.hidden_size, runner.dtype
    for bucket in runner.token_buckets:
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
