"""The LoRA product's semantics in pure jnp: two dense GEMMs over every slot with the tokens'
one-hot slot between them (``jaxserve/models/lora.py``'s first form). The oracle of the Triton
kernel (``triton``) and the path ``dispatch`` takes off the GPU; same signature as the kernel's.

``x [T, X]``, ``a [M, X, n * R]`` (n projections that read the same input, their A matrices
joined on the rank axis: q, k, v; gate, up), ``bs`` n arrays ``[M, R, O_i]``, ``token_slots
i32[T]``: 0 is no adapter (a zero term), s >= 1 is row s - 1 of the stacks. Returns the n terms
``[T, O_i]`` in x's dtype; ``x @ A`` is rounded to x's dtype before ``@ B``, as the model's
einsums do. ``x_scale [X]``: the input is ``x_scale * x`` (a norm's weight times its unscaled
rows, rounded as ``rms_norm`` rounds it), which the kernel applies as it reads x.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def scaled_input(x: jax.Array, x_scale: jax.Array | None) -> jax.Array:
    """``x_scale * x`` (the product ``models.layers.rms_norm`` returns), or x."""
    return x if x_scale is None else x_scale * x


def slot_mask(token_slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:  # [T, M]
    """Each token's one-hot slot row (all zeros for the base model)."""
    rows = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
    return (token_slots[:, None] == rows[None, :]).astype(dtype)


def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, X, n * R]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none
    mask: jax.Array | None = None,  # [T, M]  ``slot_mask``, when the caller has it already
    x_scale: jax.Array | None = None,  # [X]  x's columns scaled first (``scaled_input``)
) -> tuple[jax.Array, ...]:  # n x [T, O_i]
    """Every slot's shrink, masked to each token's own slot, then every slot's expand summed
    (one slot is non-zero per token)."""
    x = scaled_input(x, x_scale)
    if mask is None:
        mask = slot_mask(token_slots, a.shape[0], x.dtype)
    xa = jnp.einsum("TX,MXR->TMR", x, a) * mask[:, :, None]  # [T, M, n * R]
    parts = jnp.split(xa, len(bs), axis=2)
    return tuple(jnp.einsum("TMR,MRO->TO", p, b) for p, b in zip(parts, bs, strict=True))
