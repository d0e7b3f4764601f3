"""Ragged paged attention: the pure-jnp reference that defines the semantics.

The model calls ``pallas_kernels.ragged_paged_attention``; on CPU that is this function, on GPU
and TPU a Pallas kernel that must agree with it. Every kernel test compares against it.

Layout (one layer of the KV cache):
  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]
The batch is one flattened ragged batch of S sequences, T tokens in all. Sequence i owns the
query rows cu_q_lens[i]:cu_q_lens[i+1]; those are its *last* q_len_i tokens, so a query row at
chunk offset j sits at absolute position kv_lens[i] - q_len_i + j and attends causally to KV
positions 0..that position (prefill chunks and decode tokens alike). Rows past
cu_q_lens[num_seqs] are padding and come back as zeros.

Quantized cache (fp8): the pages hold ``x / scale`` rounded to the cache dtype and saturated
to its finite range (``quantize_kv``, what ``write_kv`` stores), with one float32 scale per
tensor (``k_scale``, ``v_scale``: per layer). Attention reads ``page * scale`` in float32
(``dequantize_kv``) before the dots. A scale of None means 1.0.

Attention sinks (GPT-OSS): ``sinks[Hq]`` is a learned logit per query head that joins every
row's softmax as one more column with no value: each row's weights are
``exp(s_j) / (sum_i exp(s_i) + exp(sink))``, so they may sum to less than one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The 8-bit float cache dtypes: e4m3 (the OCP "fn" variant, finite only, max 448), e5m2.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

Scale = jax.Array | float | None  # f32[] per-tensor scale; None: 1.0


def is_quantized(dtype) -> bool:
    """Whether a cache of this dtype stores scaled values (fp8)."""
    return jnp.dtype(dtype) in FP8_DTYPES


def quantize_kv(x: jax.Array, dtype, scale: Scale = None) -> jax.Array:
    """``x / scale`` cast to ``dtype``: for fp8, saturated to its finite range and rounded to
    nearest even (as vLLM's scaled fp8 conversion); other dtypes are a plain cast."""
    if not is_quantized(dtype):
        return x.astype(dtype)
    x32 = x.astype(jnp.float32)
    if scale is not None:
        x32 = x32 / jnp.asarray(scale, jnp.float32)
    finfo = jnp.finfo(dtype)
    return jnp.clip(x32, float(finfo.min), float(finfo.max)).astype(dtype)


def dequantize_kv(x: jax.Array, scale: Scale = None) -> jax.Array:  # float32, x's shape
    """The float32 values a cache holds: ``x * scale``."""
    x32 = x.astype(jnp.float32)
    return x32 if scale is None else x32 * jnp.asarray(scale, jnp.float32)


def query_rows(
    num_tokens: int,
    kv_lens: jax.Array,  # i32[S]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each of the step's query rows: its sequence (i32[T], clamped for padding rows),
    whether it is a real row (bool[T]) and its absolute position in its sequence (i32[T])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_row = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    seq_of_row = jnp.minimum(seq_of_row, kv_lens.shape[0] - 1)
    is_valid_row = rows < cu_q_lens[num_seqs[0]]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[S]
    row_pos = kv_lens[seq_of_row] - q_lens[seq_of_row] + (rows - cu_q_lens[seq_of_row])
    return seq_of_row, is_valid_row, row_pos


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # i32[S]  tokens in the cache per sequence, new ones included
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: jax.Array | None = None,  # [Hq]  a logit per query head in each row's denominator
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Each query row attends to its own sequence's pages, causally; float32 softmax over the
    dequantized cache (``page * scale``), with each head's sink logit in the denominator."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    max_kv = pages_per_seq * page_size
    group = num_q_heads // num_kv_heads

    seq_of_row, is_valid_row, row_pos = query_rows(num_tokens, kv_lens, cu_q_lens, num_seqs)

    # Gather every sequence's pages into a dense [S, max_kv, Hkv, D] view.
    k_seq = k_pages[page_indices].reshape(num_slots, max_kv, num_kv_heads, head_dim)
    v_seq = v_pages[page_indices].reshape(num_slots, max_kv, num_kv_heads, head_dim)
    k_rows = k_seq[seq_of_row]  # [T, max_kv, Hkv, D]
    v_rows = v_seq[seq_of_row]

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("TKGD,TSKD->TKGS", qg, dequantize_kv(k_rows, k_scale)) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = jnp.arange(max_kv, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= row_pos[:, None]) & (kv_pos[None, :] < kv_lens[seq_of_row][:, None])
    if sliding_window is not None:
        mask &= kv_pos[None, :] > row_pos[:, None] - sliding_window
    mask &= is_valid_row[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, DEFAULT_MASK_VALUE)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # one more column per row, the head's sink, dropped after the softmax
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))  # f32[T, K, G, 1]
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    out = jnp.einsum("TKGS,TSKD->TKGD", probs, dequantize_kv(v_rows, v_scale))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def write_kv(
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= P * page_size drops the row
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K/V into their slots (in place when the cache is donated),
    quantized to the cache dtype (``quantize_kv``)."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_new = quantize_kv(k, k_pages.dtype, k_scale)  # [T, Hkv, D]
    v_new = quantize_kv(v, v_pages.dtype, v_scale)
    k_flat = k_pages.reshape(flat_shape).at[slot_mapping].set(k_new, mode="drop")
    v_flat = v_pages.reshape(flat_shape).at[slot_mapping].set(v_new, mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)
