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


@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_normed_rotary_equals_the_norm_then_the_turn(unit_offset, dtype) -> None:
    """Each half normed as it turns, with the head's scale reduced apart: the values of
    ``rms_norm`` then ``apply_rotary`` (Qwen3's q/k norm, and Gemma 3's ``1 + weight``)."""
    from jaxserve.models import decoder, layers

    seed = int(np.random.default_rng().integers(2**31))
    key = jax.random.key(seed)
    tokens, heads, dim = 29, 4, 128
    x = jax.random.normal(key, (tokens, heads, dim), dtype) * 3
    weight = (jax.random.normal(jax.random.fold_in(key, 1), (dim,)) * 0.5 + 1).astype(dtype)
    positions = jax.random.randint(jax.random.fold_in(key, 2), (tokens,), 0, 32768)
    freqs, scale = rope.rotary_angles(positions, dim, 1e6, None)
    rotary = rope.cos_sin(freqs, scale, dtype)
    normed_rotary = jax.jit(decoder.normed_rotary, static_argnums=(2, 3))
    got = normed_rotary(x, weight, 1e-6, unit_offset, rotary)
    want = jax.jit(lambda x, w, r: rope.apply_rotary(layers.rms_norm(x, w, 1e-6, unit_offset), *r))(
        x, weight, rotary
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    # The same products; XLA may order the reduction of the mean of squares otherwise.
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(want, np.float32),
        rtol=2e-2,
        atol=1e-5,
        err_msg=f"{seed=}",
    )
    assert float(jnp.mean((got == want).astype(jnp.float32))) > 0.99, f"{seed=}"
