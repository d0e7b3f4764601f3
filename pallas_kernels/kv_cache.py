"""What a paged KV cache holds and how new tokens are written into it.

The models write each step's keys and values here (``write_kv``: one layer's
``[num_pages, page_size, num_kv_heads, head_dim]`` K and V pages; ``write_latent``: multi-head
latent attention's latent pages, laid out in ``mla.reference``), and every attention path reads
the pages back (``ragged_paged_attention``, ``mla``).

Quantized cache (fp8): the pages hold ``x / scale`` rounded to the cache dtype and saturated
to its finite range (``quantize_kv``, what the writes store), with one float32 scale per
tensor (``k_scale``, ``v_scale``: per layer). Attention reads ``page * scale`` in float32
(``dequantize_kv``) before the dots. A scale of None means 1.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The 8-bit float cache dtypes: e4m3 (the OCP "fn" variant, finite only, max 448), e5m2.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

Scale = jax.Array | float | None  # f32[] per-tensor scale; None: 1.0


def stacked_scales(*scales: Scale) -> jax.Array:  # f32[len(scales)]
    """Per-tensor scales as one kernel operand, 1.0 for None (an fp8 cache's K and V, or an
    MLA cache's latent and rope parts)."""
    values = (1.0 if scale is None else scale for scale in scales)
    return jnp.stack([jnp.asarray(value, jnp.float32).reshape(()) for value in values])


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


# NOTE: every cache write tells XLA its slots are unique (``unique_indices``): within a step each
# token owns its slot, and the rows that own none (padding, a recompute that must not write)
# share an out-of-range slot, which ``mode="drop"`` skips. A scatter that may meet duplicates
# makes each element's write an atomic read-modify-write, 16-bit ones through 32-bit
# compare-and-swap loops: on the H200 the embeddings trace (2026-12-05) showed Qwen3-0.6B's
# cache writes at 0.5 TB/s, 7.4 of a 16,384-token step's 36.7 ms.


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
    k_slots = k_pages.reshape(flat_shape).at[slot_mapping]  # unique: the NOTE above
    v_slots = v_pages.reshape(flat_shape).at[slot_mapping]
    k_flat = k_slots.set(k_new, mode="drop", unique_indices=True)
    v_flat = v_slots.set(v_new, mode="drop", unique_indices=True)
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def write_latent(
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    c_kv: jax.Array,  # [T, L]
    k_pe: jax.Array,  # [T, R]
    slot_mapping: jax.Array,  # i32[T]  page * page_size + offset; >= P * page_size drops the row
    *,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' latents into their slots, quantized to the cache dtype."""
    page_size = ckv_pages.shape[1]
    ckv_new = quantize_kv(c_kv, ckv_pages.dtype, ckv_scale)
    kpe_new = quantize_kv(k_pe, kpe_pages.dtype, kpe_scale)
    # NOTE: indexed by (page, offset), not through a flat [P * page_size] view: XLA copied the
    # whole (donated) page array when a reshaped one fed the reference's loop over blocks.
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    ckv_pages = ckv_pages.at[page, offset, 0].set(ckv_new, mode="drop", unique_indices=True)
    kpe_pages = kpe_pages.at[page, offset, 0].set(kpe_new, mode="drop", unique_indices=True)
    return ckv_pages, kpe_pages
