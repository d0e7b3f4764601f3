"""Ragged paged attention over a multi-head latent attention (MLA) cache: the pure-jnp reference.

DeepSeek-V2/V3 cache one latent per token and layer, shared by every head, in two page arrays:
  ckv_pages: [num_pages, page_size, 1, L]  the normalized KV latent c_kv (L = kv_lora_rank)
  kpe_pages: [num_pages, page_size, 1, R]  the rotated shared key k_pe (R = qk_rope_head_dim)
The query arrives absorbed (``models/mla.py``): ``q_latent[T, N, L]`` is each head's key part
times its key expansion, ``q_pe[T, N, R]`` its rotated part. Row t of head n scores
``q_latent . c_kv + q_pe . k_pe`` (times ``sm_scale``) against its sequence's tokens, and
returns the probability-weighted latent ``[T, N, L]``; the model expands it to each head's value.

The batch (``kv_lens``, ``page_indices``, ``cu_q_lens``, ``num_seqs``) and the causal mask mean
what they mean in ``ragged_paged_attention.reference``; this is that function with one KV head,
K = V = concat(c_kv, k_pe) and the output's first L columns (the tests check it), computed
without joining the two page arrays. An fp8 cache stores ``x / scale`` (``kv_cache.write_latent``).
The Pallas Triton kernel (``triton``) computes the same; ``dispatch`` picks between them.

Einsum letters: T tokens, N query heads, L latent, R rotary dims, S cached positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import Scale, dequantize_kv
from pallas_kernels.ragged_paged_attention.reference import DEFAULT_MASK_VALUE, query_rows


def ragged_paged_mla_attention(
    q_latent: jax.Array,  # [T, N, L]
    q_pe: jax.Array,  # [T, N, R]
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    kv_lens: jax.Array,  # i32[S]  tokens in the cache per sequence, new ones included
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
) -> jax.Array:  # [T, N, L], q_latent's dtype
    """Each query row attends to its own sequence's latents, causally, in float32."""
    num_tokens = q_latent.shape[0]
    _, page_size, _, latent = ckv_pages.shape
    rope_dim = kpe_pages.shape[-1]
    num_slots, pages_per_seq = page_indices.shape
    max_kv = pages_per_seq * page_size

    seq_of_row, is_valid_row, row_pos = query_rows(num_tokens, kv_lens, cu_q_lens, num_seqs)

    ckv_seq = ckv_pages[page_indices].reshape(num_slots, max_kv, latent)  # [S_seq, S, L]
    kpe_seq = kpe_pages[page_indices].reshape(num_slots, max_kv, rope_dim)
    ckv_rows = dequantize_kv(ckv_seq[seq_of_row], ckv_scale)  # f32[T, S, L]
    kpe_rows = dequantize_kv(kpe_seq[seq_of_row], kpe_scale)  # f32[T, S, R]

    scores = jnp.einsum("TNL,TSL->TNS", q_latent.astype(jnp.float32), ckv_rows)
    scores += jnp.einsum("TNR,TSR->TNS", q_pe.astype(jnp.float32), kpe_rows)
    scores = scores * sm_scale
    kv_pos = jnp.arange(max_kv, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= row_pos[:, None]) & (kv_pos[None, :] < kv_lens[seq_of_row][:, None])
    mask &= is_valid_row[:, None]  # bool[T, S]
    scores = jnp.where(mask[:, None, :], scores, DEFAULT_MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, :], probs, 0.0)
    out = jnp.einsum("TNS,TSL->TNL", probs, ckv_rows)
    return out.astype(q_latent.dtype)
