"""The fp8 matmul's semantics in pure jnp, with the kernel's signature (``mosaic_gpu``): the
tests' oracle, and the per-token activation quantizer that the kernel's W8A8 mode and XLA's
W8A8 path (``jaxserve.models.quant``) share.

Two modes, by what the activations become before the products (the weight is fp8 e4m3
``[N, K]`` with an f32 scale per output channel either way; products are summed in f32):
- ``act_quant=True`` (W8A8): each row of x is quantized to fp8 e4m3 with its own scale
  (``quantize_rows``), the product runs on fp8 tensor cores, both scales multiply the sums;
- ``act_quant=False`` (weight-only): x is rounded to float16 (exact for bf16 values of
  magnitude 2^-14 to 65,504; larger ones saturate to +-65,504) and the weight converted to
  float16 (exact: every e4m3 value is a float16 value).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
F16_MAX = 65504.0  # largest finite float16


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-row fp8: (f8e4m3[M, K], f32[M, 1] scales), x ~= values * scale."""
    x32 = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), 1e-12)
    # NOTE: x times the row's factor, not x divided by its scale: XLA rewrites a division by a
    # broadcast scalar into a product with its reciprocal inside jit and not outside, so the
    # same row rounded to other fp8 values in a jitted caller than in eager code.
    return (x32 * (FP8_MAX / amax)).astype(FP8), amax / FP8_MAX


def as_f16(x: jax.Array) -> jax.Array:
    """x in float16, saturated at its largest finite value (the weight-only mode's input)."""
    return jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


def fp8_matmul(
    x: jax.Array,  # [M, K]  bf16 | f16 | f32
    w: jax.Array,  # f8e4m3[N, K]
    w_scale: jax.Array,  # f32[N]
    *,
    act_quant: bool,
    out_dtype: Any = None,
) -> jax.Array:  # [M, N] out_dtype (default x's)
    """``x @ (w * w_scale).T`` as the kernel computes it; see the module docstring."""
    contract = (((1,), (1,)), ((), ()))
    if act_quant:
        xq, x_scale = quantize_rows(x)
        y = lax.dot_general(
            xq.astype(jnp.float32), w.astype(jnp.float32), contract, precision="highest"
        )
        y = y * x_scale
    else:
        y = lax.dot_general(
            as_f16(x).astype(jnp.float32), w.astype(jnp.float32), contract, precision="highest"
        )
    return (y * w_scale).astype(out_dtype or x.dtype)
