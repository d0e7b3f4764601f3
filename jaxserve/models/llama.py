"""The Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) as pure functions.

``forward(weights, kv_cache, batch, config) -> (kv_cache, hidden)`` runs one ragged batch of
prefill chunks and decode tokens over the paged KV cache; ``compute_logits`` turns selected
hidden rows into logits. Config switches cover the family: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), Llama-3 RoPE scaling, tied embeddings, sliding window (Mistral).

Einsum letters: T tokens, H hidden, N query heads, K kv heads, D head dim, I intermediate,
V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.config import ModelConfig
from jaxserve.models.batch import Batch, KVCache


# NOTE: these are the model code's typed view of the weights. What each field is (checkpoint
# name and layout, shape, dummy init, which configs have it) is its row in families.py, which
# loading, dummy weights, sharding and parameter counting read; tests/test_weight_table.py
# checks that the rows and these fields agree.
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array  # [H]
    wq: jax.Array  # [H, N, D]
    wk: jax.Array  # [H, K, D]
    wv: jax.Array  # [H, K, D]
    wo: jax.Array  # [N, D, H]
    mlp_norm: jax.Array  # [H]
    w_gate: jax.Array  # [H, I]
    w_up: jax.Array  # [H, I]
    w_down: jax.Array  # [I, H]
    bq: jax.Array | None = None  # [N, D]  (Qwen2)
    bk: jax.Array | None = None  # [K, D]
    bv: jax.Array | None = None  # [K, D]
    q_norm: jax.Array | None = None  # [D]  (Qwen3)
    k_norm: jax.Array | None = None  # [D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, H]
    layers: list[LayerWeights]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [H, V]; None when tied to the embedding


AttentionFn = Callable[..., jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype before the scale (as Hugging Face does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:  # f32[D // 2]
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths slowed by `factor`, short kept, smooth in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(
    x: jax.Array,  # [T, heads, D]
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2]
) -> jax.Array:  # [T, heads, D]
    """Rotary embedding in the rotate-half layout of Hugging Face checkpoints."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # f32[T, D/2]
    cos = jnp.concatenate([jnp.cos(freqs)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(freqs)] * 2, axis=-1)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention_block(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    k_pages: jax.Array,  # [P, page_size, K, D]
    v_pages: jax.Array,
    batch: Batch,
    config: ModelConfig,
    inv_freq: jax.Array,  # f32[D // 2]
    attention_fn: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = jnp.einsum("TH,HND->TND", x, lw.wq)
    k = jnp.einsum("TH,HKD->TKD", x, lw.wk)
    v = jnp.einsum("TH,HKD->TKD", x, lw.wv)
    if lw.bq is not None:  # q/k/v biases (Qwen2): the config has all three or none
        q = q + lw.bq
    if lw.bk is not None:
        k = k + lw.bk
    if lw.bv is not None:
        v = v + lw.bv
    if lw.q_norm is not None:  # per-head RMSNorm (Qwen3): both or neither
        q = rms_norm(q, lw.q_norm, config.rms_norm_eps)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, config.rms_norm_eps)
    q = apply_rope(q, batch.positions, inv_freq)
    k = apply_rope(k, batch.positions, inv_freq)
    k_pages, v_pages = pallas_kernels.write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    out = attention_fn(
        q,
        k_pages,
        v_pages,
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=config.head_dim**-0.5,
        sliding_window=config.sliding_window,
    )  # [T, N, D]
    return jnp.einsum("TND,NDH->TH", out, lw.wo), k_pages, v_pages


def mlp_block(lw: LayerWeights, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
    gate = jnp.einsum("TH,HI->TI", x, lw.w_gate)
    up = jnp.einsum("TH,HI->TI", x, lw.w_up)
    return jnp.einsum("TI,IH->TH", jax.nn.silu(gate) * up, lw.w_down)


def forward(
    weights: Weights,
    kv_cache: KVCache,
    batch: Batch,
    config: ModelConfig,
    attention_fn: AttentionFn | None = None,
) -> tuple[KVCache, jax.Array]:  # (kv_cache, hidden[T, H])
    """One step over a ragged batch; returns the updated cache and final-normed hidden states."""
    attention_fn = attention_fn or pallas_kernels.ragged_paged_attention
    inv_freq = rope_inv_freq(config)
    x = weights.embed[batch.input_ids]  # [T, H]
    new_cache: KVCache = []
    # NOTE: a Python loop over per-layer weights (unrolled under jit), not lax.scan over stacked
    # weights: on the H200 the scanned decode GEMMs ran at 32% of the bandwidth floor, unrolled
    # at 88% (BENCHMARKS.md).
    for lw, (k_pages, v_pages) in zip(weights.layers, kv_cache, strict=True):
        h = rms_norm(x, lw.attn_norm, config.rms_norm_eps)
        attn, k_pages, v_pages = attention_block(
            lw, h, k_pages, v_pages, batch, config, inv_freq, attention_fn
        )
        x = x + attn
        x = x + mlp_block(lw, rms_norm(x, lw.mlp_norm, config.rms_norm_eps))
        new_cache.append((k_pages, v_pages))
    return new_cache, rms_norm(x, weights.final_norm, config.rms_norm_eps)


def compute_logits(weights: Weights, hidden: jax.Array) -> jax.Array:  # [N, H] -> f32[N, V]
    if weights.lm_head is None:
        return jnp.einsum("NH,VH->NV", hidden, weights.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("NH,HV->NV", hidden, weights.lm_head, preferred_element_type=jnp.float32)
