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
The Pallas Triton kernel (``triton``) computes the same; ``dispatch`` picks between them. This
reference walks each row's positions in blocks (``block_pages``) with an online softmax, so what
it allocates in a step grows with the step's rows and a block, not with max_model_len:
``temporary_bytes`` says how much, for the capacity planner (``runner/capacity.py``).

Einsum letters: T tokens, N query heads, L latent, R rotary dims, S cached positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fresh import fresh_full
from pallas_kernels.kv_cache import Scale, dequantize_kv
from pallas_kernels.ragged_paged_attention.reference import DEFAULT_MASK_VALUE, query_rows

# The reference walks each row's positions in blocks of whole pages (an online softmax, as the
# kernels do), so its temporaries are a block's, not max_model_len's: ROW_POSITIONS bounds the
# rows x positions of one block (T rows gather T x block positions of latents), MAX_BLOCK the
# positions of a block at decode sizes.
ROW_POSITIONS = 1 << 18
MAX_BLOCK = 2048


def block_pages(num_tokens: int, page_size: int, pages_per_seq: int) -> int:
    """Pages per block of the walk over a row's positions: a power of two, as many as keep
    ``num_tokens`` x the block's positions within ROW_POSITIONS (at least one page, at most
    MAX_BLOCK positions or the page table's width)."""
    limit = max(1, min(ROW_POSITIONS // (num_tokens * page_size), MAX_BLOCK // page_size))
    pages = 1 << (limit.bit_length() - 1)  # the largest power of two <= limit
    return max(1, min(pages, pages_per_seq))


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
    """Each query row attends to its own sequence's latents, causally, in float32: a loop over
    blocks of ``block_pages`` pages up to the step's longest sequence, each block's scores
    folded into a running maximum, sum and weighted latent (a block a row cannot see adds
    exact zeros, so the loop's length never changes a row's result)."""
    num_tokens, num_heads, latent = q_latent.shape
    _, page_size, _, _ = ckv_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    per_block = block_pages(num_tokens, page_size, pages_per_seq)
    num_blocks = -(-pages_per_seq // per_block)
    block = per_block * page_size  # positions per block

    seq_of_row, is_valid_row, row_pos = query_rows(num_tokens, kv_lens, cu_q_lens, num_seqs)
    # Past the page table: page 0, masked (kv_lens never reach it).
    table = jnp.pad(page_indices, ((0, 0), (0, num_blocks * per_block - pages_per_seq)))
    row_pages = table[seq_of_row]  # i32[T, num_blocks * per_block]
    row_len = jnp.where(is_valid_row, kv_lens[seq_of_row], 0)  # i32[T]
    row_end = jnp.minimum(row_pos + 1, row_len)  # i32[T]: the positions a row sees
    longest = jnp.max(jnp.where(jnp.arange(num_slots) < num_seqs[0], kv_lens, 0))
    q_latent32 = q_latent.astype(jnp.float32)
    q_pe32 = q_pe.astype(jnp.float32)

    def fold(i, carry):  # block i of every row's positions
        high, total, acc = carry  # f32[T, N], f32[T, N], f32[T, N, L]
        pages = jax.lax.dynamic_slice_in_dim(row_pages, i * per_block, per_block, axis=1)
        ckv = dequantize_kv(ckv_pages[pages].reshape(num_tokens, block, latent), ckv_scale)
        kpe = dequantize_kv(kpe_pages[pages].reshape(num_tokens, block, -1), kpe_scale)
        scores = jnp.einsum("TNL,TSL->TNS", q_latent32, ckv)
        scores += jnp.einsum("TNR,TSR->TNS", q_pe32, kpe)
        mask = (i * block + jnp.arange(block, dtype=jnp.int32))[None, :] < row_end[:, None]
        scores = jnp.where(mask[:, None, :], scores * sm_scale, DEFAULT_MASK_VALUE)
        new_high = jnp.maximum(high, scores.max(-1))
        rescale = jnp.exp(high - new_high)
        probs = jnp.where(mask[:, None, :], jnp.exp(scores - new_high[..., None]), 0.0)
        total = total * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum("TNS,TSL->TNL", probs, ckv)
        return new_high, total, acc

    init = (  # (fresh_full: one layer's start is not another's: each lives with its loop)
        fresh_full(q_latent, (num_tokens, num_heads), DEFAULT_MASK_VALUE, jnp.float32),
        fresh_full(q_latent, (num_tokens, num_heads), 0, jnp.float32),
        fresh_full(q_latent, (num_tokens, num_heads, latent), 0, jnp.float32),
    )
    steps = jnp.minimum(-(-longest // block), num_blocks)
    _, total, acc = jax.lax.fori_loop(0, steps, fold, init)
    out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.astype(q_latent.dtype)


def temporary_bytes(
    num_tokens: int,
    num_heads: int,  # per device
    latent: int,  # L
    rope_dim: int,  # R
    page_size: int,
    pages_per_seq: int,
    cache_itemsize: int,  # the page arrays' element size (fp8: 1)
    q_itemsize: int,  # the query's and output's
) -> int:
    """What one call allocates besides its inputs and output, at most (the capacity
    planner's figure; tests hold it against XLA's ``memory_analysis`` on the CPU): a block's
    gathered latents and rotary keys in float32 (XLA fuses the gather into the conversion;
    an fp8 cache's scaled copy besides), its scores and probabilities [T, N, block], the
    float32 query, and the running maximum, sum and weighted latent, three times over (the
    loop's carry in and out, a block's product)."""
    block = block_pages(num_tokens, page_size, pages_per_seq) * page_size
    positions = num_tokens * block * (latent + rope_dim)
    gathered = positions * (4 + (cache_itemsize if cache_itemsize == 1 else 0))
    scores = 2 * num_tokens * num_heads * block * 4
    query = num_tokens * num_heads * (latent + rope_dim) * 4
    carry = 3 * num_tokens * num_heads * (2 + latent) * 4
    return gathered + scores + query + carry + num_tokens * num_heads * latent * q_itemsize
