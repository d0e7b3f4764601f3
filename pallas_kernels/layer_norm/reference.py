"""The semantics of ``triton.add_layer_norm``: the encoder's post-LN block as XLA runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_layer_norm(
    x: jax.Array,  # [T, H]
    residual: jax.Array,  # [T, H]  x's dtype
    scale: jax.Array,  # [H]
    bias: jax.Array,  # [H]
    *,
    eps: float,
) -> jax.Array:  # [T, H] x's dtype
    """``LayerNorm(x + residual)``: the sum rounded to x's dtype (as the model adds them), then
    the mean, variance, normalization, scale and bias in float32, one cast back."""
    s = (x + residual).astype(jnp.float32)
    mean = jnp.mean(s, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(s - mean), axis=-1, keepdims=True)
    y = (s - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
