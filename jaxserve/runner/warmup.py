"""Warm-up: every program a request can reach is compiled before the server takes traffic.

The model step is compiled ahead of time for every token bucket, in parallel threads (lowering
holds the GIL, XLA's compile does not); then the KV cache is allocated and each bucket runs
once through the sampler variants and the pending-token feed, so their compiles are done too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.runner.sampling import SamplerFlags

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner

_LOG = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, max_workers: int) -> int:
    """Compile every program, then run each bucket once; returns the number of model step
    shapes compiled."""
    start = time.perf_counter()
    kv_cache = runner.kv_cache if runner.kv_cache is not None else runner.abstract_kv_cache()
    buckets = runner.token_buckets
    variants = SamplerFlags.variants()
    _LOG.info(
        "Compiling the model step for %d token buckets (%s), then %d sampler variants per bucket",
        len(buckets),
        ", ".join(map(str, buckets)),
        len(variants),
    )
    workers = max(1, min(max_workers, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # Each program's compile starts as soon as it is lowered, while the next one lowers.
        steps = {}
        for bucket in buckets:
            batch, _ = runner.inputs.padding_step(bucket)
            lowered = runner.step_fn.lower(runner.weights, kv_cache, batch)
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
        others = {}
        for lowered, table, key in _sampler_and_logprob_programs(runner, variants):
            others[pool.submit(lowered.compile)] = (table, key)
        for future in concurrent.futures.as_completed(others):
            table, key = others[future]
            table[key] = future.result()
    _LOG.info(
        "Compiled the sampler and prompt-logprob programs at %.1f s", time.perf_counter() - start
    )
    runner.allocate_kv_cache()
    for bucket in buckets:
        batch, inputs = runner.put(runner.inputs.padding_step(bucket))
        runner.kv_cache, hidden = runner.run_step(batch)
        for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
            out = runner.sample(hidden, batch, inputs, flags)
            jax.block_until_ready(out.token_ids)
        source = np.full(bucket, -1, np.int32)
        jax.block_until_ready(runner.feed_fn(batch.input_ids, source, out.token_ids))
    runner.compile_seconds = time.perf_counter() - start
    return len(buckets)


def _sampler_and_logprob_programs(
    runner: ModelRunner, variants: tuple[SamplerFlags, ...]
) -> Iterator[tuple[Any, dict, object]]:
    """(lowered program, the runner's table for it, its key) for every sampler variant and
    the prompt logprobs of every token bucket, lowered against arguments laid out as at run
    time."""
    hidden_size, dtype = runner.model_config.hidden_size, runner.dtype
    for bucket in runner.token_buckets:
        batch = runner.put(runner.inputs.padding_step(bucket)[0])
        hidden = runner.put(np.zeros((bucket, hidden_size), dtype))
        for flags in variants:
            inputs = runner.put(runner.inputs.padding_step(bucket, flags)[1])
            lowered = runner.sample_fn.lower(
                runner.head, hidden, batch.logits_indices, inputs, tied=runner.tied, flags=flags
            )
            yield lowered, runner.compiled_samplers, (bucket, flags)
        next_ids = runner.put(np.zeros(bucket, np.int32))
        lowered = runner.prompt_lp_fn.lower(runner.head, hidden, next_ids, tied=runner.tied)
        yield lowered, runner.compiled_prompt_lp, bucket
