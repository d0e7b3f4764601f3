"""The per-head norm and rotation's semantics in jnp, with the kernel's signature (``triton``):
the tests' oracle. The same products in the same order as the decoder's ``normed_rotary``:
each head's 1 / rms in float32, the normed row cast to the activations' dtype before the norm's
weight (as Hugging Face does; Gemma's ``1 + weight`` in float32 before the cast), then the
rotate-half rotation with ``cos`` and ``sin`` (whose halves are equal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normed_rope(
    qkv: jax.Array,  # [T, X, D]  the fused q/k/v product's heads
    weight: jax.Array,  # [D]  the per-head norm's
    cos: jax.Array,  # [T, D]  qkv's dtype
    sin: jax.Array,  # [T, D]
    *,
    first: int,  # the first of the heads to norm and turn
    heads: int,  # how many
    eps: float,
    unit_offset: bool = False,  # Gemma's 1 + weight
) -> jax.Array:  # [T, heads, D]
    x = qkv[:, first : first + heads]
    x32 = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        y = (x32 * scale * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    else:
        y = weight * (x32 * scale).astype(x.dtype)
    half = x.shape[-1] // 2
    y1, y2 = y[..., :half], y[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    return jnp.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=-1)
