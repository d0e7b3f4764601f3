"""Ragged paged attention: the pure-jnp reference that defines the semantics.

The model calls ``dispatch.ragged_paged_attention``; on CPU that is this function, on GPU and
TPU a Pallas kernel that must agree with it. Every kernel test compares against it.

Layout (one layer of the KV cache):
  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]
The batch is one flattened ragged batch of S sequences, T tokens in all. Sequence i owns the
query rows cu_q_lens[i]:cu_q_lens[i+1]; those are its *last* q_len_i tokens, so a query row at
chunk offset j sits at absolute position kv_lens[i] - q_len_i + j and attends causally to KV
positions 0..that position (prefill chunks and decode tokens alike). Rows past
cu_q_lens[num_seqs] are padding and come back as zeros.

Quantized cache (fp8): the pages hold ``x / scale`` (``pallas_kernels.kv_cache``), with one
float32 scale per tensor (``k_scale``, ``v_scale``: per layer); attention reads ``page * scale``
in float32 (``kv_cache.dequantize_kv``) before the dots. A scale of None means 1.0.

Attention sinks (GPT-OSS): ``sinks[Hq]`` is a learned logit per query head that joins every
row's softmax as one more column with no value: each row's weights are
``exp(s_j) / (sum_i exp(s_i) + exp(sink))``, so they may sum to less than one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul.reference import quantize_rows
from pallas_kernels.kv_cache import Scale, dequantize_kv

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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


def quantize_queries(q: jax.Array) -> jax.Array:  # f32[T, Hq, D]
    """The queries as the Mosaic GPU kernel's fp8 wgmma path reads them: each (token, head)
    row rounded to e4m3 at its own scale (``amax / 448``: ``fp8_matmul.reference.quantize_rows``)
    and multiplied back in float32. ``ragged_paged_attention`` over these is that path's oracle
    but for the rounding of P to e4m3, which happens inside the online softmax."""
    q8, scale = quantize_rows(q)
    return q8.astype(jnp.float32) * scale


def temporary_bytes(
    num_tokens: int,
    num_q_heads: int,  # per device
    num_kv_heads: int,  # per device
    head_dim: int,
    max_kv: int,  # pages_per_seq * page_size: every row scores the whole page table
    *,
    sinks: bool = False,
) -> int:
    """What one call allocates besides its inputs and output, at most (the capacity
    planner's figure when this reference is the path; tests hold it against XLA's
    ``memory_analysis`` on the CPU): each row's gathered keys and values [T, max_kv, Hkv, D]
    in float32, its scores and probabilities [T, Hq, max_kv]; with attention sinks the
    scores joined with the sink column and their softmax besides. A sliding window masks
    positions but gathers them all: it changes nothing here."""
    gathered = 2 * num_tokens * max_kv * num_kv_heads * head_dim * 4
    scores = (4 if sinks else 2) * num_tokens * num_q_heads * (max_kv + 1) * 4
    return gathered + scores + 2 * num_tokens * num_q_heads * head_dim * 4
