"""The skinny matmul's semantics in pure jnp, with the kernel's signature (``triton``): f32 sums
of ``x`` times ``W`` (converted to x's dtype), times the per-channel ``scale``. The tests'
oracle.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def skinny_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None = None,
    *,
    w_layout: str = "kn",
    out_dtype: Any = None,
) -> jax.Array:  # [M, N] out_dtype
    """The kernel's semantics in jnp: f32 sums of x times W (converted to x's dtype)."""
    contract = (((1,), (0 if w_layout == "kn" else 1,)), ((), ()))
    y = lax.dot_general(x, w.astype(x.dtype), contract, preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * scale
    return y.astype(out_dtype or x.dtype)
