"""Arrays that start a loop's carry, made per call rather than from a constant.

XLA merges equal constants across a program. A step that runs the same loop in every layer
(the MLA reference's online softmax, batch-invariant mode's row-tiled GEMMs) would start every
layer's loop from one constant buffer; each loop then takes a copy of it, and XLA's scheduler
places those copies at the start of the step, so they are all live together. Measured on the
CPU: the MLA reference's step grew by its [T, N, L] float32 accumulator a layer, the row-tiled
GEMMs by 0.16 GiB a layer at the Llama-3-8B shape. A start made from an element of the call's
own input is a value of its own, and lives only as long as its loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def fresh_full(like: jax.Array, shape: tuple[int, ...], fill_value: float, dtype: Any) -> jax.Array:
    """``jnp.full(shape, fill_value, dtype)``, computed from ``like``'s first element (times
    zero; a NaN or infinity there is read as zero first, so the value is exact whatever the
    input holds)."""
    first = like.reshape(-1)[0].astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(first), first, 0.0) * 0.0  # XLA folds neither step
    return jnp.broadcast_to((zero + fill_value).astype(dtype), shape)
