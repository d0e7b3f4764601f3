"""Rotary position embeddings with every rope scaling, as pure functions of the positions.

``rotary_angles(positions, head_dim, theta, scaling)`` gives each token's rotation angles and
the cos/sin scale; ``apply_rotary`` turns q or k by them (the rotate-half layout of Hugging Face
checkpoints). The model computes the angles once per step for each (base, scaling) its layers
use (Gemma 3's local layers have their own base).

Scalings (``config.RopeScaling.rope_type``), as transformers defines them:
  linear    every frequency divided by ``factor``;
  llama3    long wavelengths divided by ``factor``, short kept, smooth in between;
  yarn      frequencies blended between divided and kept by wavelength, cos/sin scaled;
  dynamic   NTK: the base grows with the sequence length past the original context;
  longrope  per-frequency ``short_factor`` within the original context, ``long_factor`` past it.

NOTE: dynamic and longrope depend on the sequence length. Here a token's rotation depends on
its own position only (as if the sequence ended there), so a token's K in the cache never
changes, chunked prefill equals one prefill and batching changes nothing. That is what
transformers computes when it generates with its KV cache from a prompt within the original
context; a single transformers forward over a longer prompt rotates all of it by the length of
the whole prompt instead.

Einsum letters: T tokens, D head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.config import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Rotation speed per frequency, f32[D // 2], for the scalings that do not depend on the
    position (longrope: its short factors)."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # f32[D // 2]
    base_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling.rope_type == "dynamic":
        return base_freq
    if scaling.rope_type == "linear":
        return base_freq / scaling.factor
    if scaling.rope_type == "longrope":
        return 1.0 / (jnp.asarray(scaling.short_factor, jnp.float32) * theta**exponents)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return _llama3_inv_freq(base_freq, scaling)


def _llama3_inv_freq(base_freq: jax.Array, scaling: RopeScaling) -> jax.Array:
    # Llama 3.1: long wavelengths slowed by `factor`, short kept, smooth in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / base_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, base_freq / scaling.factor, base_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """YaRN: frequencies turning fewer than ``beta_slow`` times over the original context are
    divided by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp in
    between (over the frequency index)."""

    def correction_dim(num_rotations: float) -> float:
        old_len = scaling.original_max_position_embeddings
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # f32[D // 2]: 1 where the frequency is kept, 0 where it is divided
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rotary_angles(
    positions: jax.Array,  # i32[T]
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
) -> tuple[jax.Array, float]:  # (f32[T, D // 2] angles, cos/sin scale)
    """Each token's rotation angles and the scale of its cos and sin."""
    pos = positions.astype(jnp.float32)[:, None]  # f32[T, 1]
    if scaling is not None and scaling.rope_type == "dynamic":
        # The base that transformers uses for a sequence ending at this token.
        old_len = scaling.original_max_position_embeddings
        seq_len = jnp.maximum(pos + 1, float(old_len))  # f32[T, 1]
        factor = scaling.factor
        base = theta * ((factor * seq_len / old_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32)[None, :] / head_dim
        return pos * (1.0 / (base**exponents)), 1.0
    freqs = pos * inv_freq(head_dim, theta, scaling)[None, :]  # f32[T, D // 2]
    if scaling is None:
        return freqs, 1.0
    if scaling.rope_type == "longrope":
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        long_freq = 1.0 / (jnp.asarray(scaling.long_factor, jnp.float32) * theta**exponents)
        is_long = pos >= scaling.original_max_position_embeddings  # bool[T, 1]
        freqs = jnp.where(is_long, pos * long_freq[None, :], freqs)
    return freqs, scaling.attention_factor


def cos_sin(
    freqs: jax.Array,  # f32[T, D // 2]
    attention_factor: float,
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:  # ([T, 1, D], [T, 1, D]) in dtype
    cos = jnp.cos(jnp.concatenate([freqs, freqs], axis=-1))
    sin = jnp.sin(jnp.concatenate([freqs, freqs], axis=-1))
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos[:, None, :].astype(dtype), sin[:, None, :].astype(dtype)


def apply_rotary(
    x: jax.Array,  # [T, heads, D]
    cos: jax.Array,  # [T, 1, D], x's dtype
    sin: jax.Array,  # [T, 1, D]
) -> jax.Array:  # [T, heads, D]
    """Rotary embedding in the rotate-half layout of Hugging Face checkpoints:
    ``x * cos + rotate_half(x) * sin``, with the same products and sums, half by half.

    NOTE: each half's result is joined once at the end, where the turned copy of ``x`` was a
    concatenation of its own: after a per-head norm (Qwen3) XLA on the GPU then fuses the turn
    into the norm's pass, one pass over q and k fewer a layer (a Qwen3-0.6B embedding step
    1.04-1.06x on an H100; ``benchmarks/probes/rope_fusion.py``). The halves of ``cos`` and
    ``sin`` are equal (``cos_sin``)."""
    half = x.shape[-1] // 2
    return rotate_halves(x[..., :half], x[..., half:], cos, sin)


def rotate_halves(
    x1: jax.Array,  # [T, heads, D // 2]  the first half of each head
    x2: jax.Array,  # [T, heads, D // 2]  the second
    cos: jax.Array,  # [T, 1, D]
    sin: jax.Array,
) -> jax.Array:  # [T, heads, D]
    """``apply_rotary`` of the head whose halves are ``x1`` and ``x2``."""
    half = x1.shape[-1]
    c, s = cos[..., :half], sin[..., :half]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
