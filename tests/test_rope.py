"""The rotary embedding's turn, against Hugging Face's formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import rope


def hf_rotary(x, cos, sin):
    """transformers' ``q * cos + rotate_half(q) * sin``, rotate_half by concatenation."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(("heads", "dim"), [(1, 64), (5, 128), (3, 256)])
def test_apply_rotary_equals_the_rotate_half_formula_bit_for_bit(dtype, heads, dim) -> None:
    """Half by half, the same products and sums: equal bits, whatever the positions."""
    seed = int(np.random.default_rng().integers(2**31))
    key = jax.random.key(seed)
    tokens = 37
    x = jax.random.normal(key, (tokens, heads, dim), dtype) * 4
    positions = jax.random.randint(jax.random.fold_in(key, 1), (tokens,), 0, 131072)
    freqs, scale = rope.rotary_angles(positions, dim, 500000.0, None)
    cos, sin = rope.cos_sin(freqs, scale, dtype)
    got = jax.jit(rope.apply_rotary)(x, cos, sin)
    want = jax.jit(hf_rotary)(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert bool(jnp.array_equal(got, want)), f"{seed=}"
