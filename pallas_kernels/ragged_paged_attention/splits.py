"""Combining a KV-split attention's partial results, shared by the GPU kernels: each split of a
tile's KV range writes its normalised partial output and its log-sum-exp, and the splits are
merged here in XLA. Attention sinks (GPT-OSS) join here, once per row: the splits leave them out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)


def merge_splits(
    o_parts: jax.Array,  # f32[NS, T, Hq, D]
    lse_parts: jax.Array,  # f32[NS, T, Hq, C]  log2-domain, its C columns all equal
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    out_dtype,
    sinks: jax.Array | None = None,  # [Hq]  natural-log sink logits, added to each denominator
) -> jax.Array:  # [T, Hq, D]
    """Weight each split's partial output by its share of the softmax mass (the sink's mass,
    when given, counted once in the total and contributing no value).

    Written as elementwise ops over the (small, static) split axis so that XLA emits one
    fusion. Rows past cu_q_lens[num_seqs] were never written and come back as zeros.
    """
    num_splits, num_tokens = o_parts.shape[:2]
    lse = [lse_parts[s, :, :, :1] for s in range(num_splits)]  # f32[T, Hq, 1] each
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, -1, 1) * LOG2E  # f32[1, Hq, 1]
        top = functools.reduce(jnp.maximum, lse, sink)
    else:
        top = functools.reduce(jnp.maximum, lse)
    weights = [jnp.exp2(x - top) for x in lse]
    out = functools.reduce(jnp.add, [w * o_parts[s] for s, w in enumerate(weights)])
    total = functools.reduce(jnp.add, weights)
    if sinks is not None:
        total = total + jnp.exp2(sink - top)
    out = out / total
    is_valid = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]  # bool[T]
    return jnp.where(is_valid[:, None, None], out, 0.0).astype(out_dtype)
