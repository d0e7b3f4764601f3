"""Combining a KV-split attention's partial results, shared by the GPU kernels: each split of a
tile's KV range writes its normalised partial output and its log-sum-exp, and the splits are
merged here in XLA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def merge_splits(
    o_parts: jax.Array,  # f32[NS, T, Hq, D]
    lse_parts: jax.Array,  # f32[NS, T, Hq, C]  log2-domain, its C columns all equal
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    out_dtype,
) -> jax.Array:  # [T, Hq, D]
    """Weight each split's partial output by its share of the softmax mass.

    Written as elementwise ops over the (small, static) split axis so that XLA emits one
    fusion. Rows past cu_q_lens[num_seqs] were never written and come back as zeros.
    """
    num_splits, num_tokens = o_parts.shape[:2]
    lse = [lse_parts[s, :, :, :1] for s in range(num_splits)]  # f32[T, Hq, 1] each
    top = functools.reduce(jnp.maximum, lse)
    weights = [jnp.exp2(x - top) for x in lse]
    out = functools.reduce(jnp.add, [w * o_parts[s] for s, w in enumerate(weights)])
    out = out / functools.reduce(jnp.add, weights)
    is_valid = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]  # bool[T]
    return jnp.where(is_valid[:, None, None], out, 0.0).astype(out_dtype)
