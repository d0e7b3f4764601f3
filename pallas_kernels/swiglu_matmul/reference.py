"""``silu(x @ w_gate) * (x @ w_up)`` from the fused ``[K, 2N]`` weight, in jnp: the semantics of
the Mosaic GPU kernel (``mosaic_gpu``), which keeps both products in float32 and rounds once."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_matmul(x: jax.Array, w: jax.Array) -> jax.Array:  # [M, K], [K, 2N] -> [M, N]
    """The gate and up products in float32, SwiGLU on them, one rounding to ``x``'s dtype."""
    n = w.shape[1] // 2
    gate_up = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate_up[:, :n]) * gate_up[:, n:]).astype(x.dtype)


def gelu_matmul(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:  # [M, K], [K, N], [N]
    """The product and its bias in float32, exact GELU (erf) on them, one rounding."""
    h = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return (0.5 * h * (1.0 + jax.lax.erf(h * 0.7071067811865476))).astype(x.dtype)
