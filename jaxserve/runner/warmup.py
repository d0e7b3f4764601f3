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
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.runner.sampling import SamplerFlags

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner

_LOG = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, max_workers: int) -> int:
    """Compile and run every bucket; returns the number of model step shapes compiled."""
    start = time.perf_counter()
    kv_cache = runner.kv_cache if runner.kv_cache is not None else runner.abstract_kv_cache()
    buckets = runner.token_buckets
    _LOG.info(
        "Compiling the model step for %d token buckets: %s",
        len(buckets),
        ", ".join(map(str, buckets)),
    )
    workers = max(1, min(max_workers, len(buckets), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # Each bucket's compile starts as soon as it is lowered, while the next one lowers.
        futures = {}
        for bucket in buckets:
            batch, _ = runner.inputs.padding_step(bucket)
            lowered = runner.step_fn.lower(runner.weights, kv_cache, batch)
            futures[pool.submit(lowered.compile)] = bucket
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            bucket = futures[future]
            runner.compiled_steps[bucket] = future.result()
            _LOG.info(
                "Compiled model step for %d tokens (%d/%d) at %.1f s",
                bucket,
                done,
                len(buckets),
                time.perf_counter() - start,
            )
    runner.allocate_kv_cache()
    for bucket in buckets:
        batch, inputs = jax.device_put(runner.inputs.padding_step(bucket))
        runner.kv_cache, hidden = runner.run_step(batch)
        for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
            out = runner.sample_fn(
                runner.head, hidden, batch.logits_indices, inputs, tied=runner.tied, flags=flags
            )
            jax.block_until_ready(out.token_ids)
        source = np.full(bucket, -1, np.int32)
        jax.block_until_ready(runner.feed_fn(batch.input_ids, source, out.token_ids))
    runner.compile_seconds = time.perf_counter() - start
    return len(buckets)
