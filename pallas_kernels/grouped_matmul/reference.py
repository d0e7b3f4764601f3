"""The grouped matmul's semantics in pure jnp: ``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as
a dense dot per group, G times the work. The tests' oracle for the Triton kernel (``triton``) and
for the entry point (``dispatch``), which have the same signature. A quantized ``rhs`` (fp8 e4m3
or int8 values) comes with ``scale f32[G, N]``: group g's product times ``scale[g]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(
    lhs: jax.Array,  # [R, K]  sorted by group
    rhs: jax.Array,  # [G, K, N]  lhs's dtype, or fp8 e4m3 / int8 values with a scale
    group_sizes: jax.Array,  # i32[G]
    scale: jax.Array | None = None,  # f32[G, N]  per (group, output column)
) -> jax.Array:  # [R, N], lhs's dtype
    """The semantics, as a dense dot per group (G times the work: the tests' oracle)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # i32[G]
    starts = ends - group_sizes.astype(jnp.int32)
    row = jnp.arange(lhs.shape[0], dtype=jnp.int32)[:, None]  # i32[R, 1]
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
    for group in range(rhs.shape[0]):
        is_row = (row >= starts[group]) & (row < ends[group])  # bool[R, 1]
        weight = rhs[group] if scale is None else rhs[group].astype(jnp.float32)
        operand = lhs if scale is None else lhs.astype(jnp.float32)
        product = jnp.dot(
            operand, weight, preferred_element_type=jnp.float32, precision="highest"
        )  # f32[R, N]
        if scale is not None:
            product = product * scale[group][None, :]
        out = jnp.where(is_row, product, out)
    return out.astype(lhs.dtype)
