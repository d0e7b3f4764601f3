"""Qwen3's (and Gemma 3's) per-head RMSNorm and rotary embedding of q or k in one pass, as a
Pallas Triton kernel.

XLA runs the decoder's ``normed_rotary`` as two kernels a tensor: a reduction that reads every
head for its 1 / rms, then the pass that reads it again to norm and turn it. In the H100's
16,384-token Qwen3-0.6B embedding step those are about 46 and 61 us a layer for q and k
(benchmarks/reports/2026-12-07-session-twenty-three). Here each program loads ``block_t``
tokens' heads once, straight from the fused q/k/v product (no copy of the slice), reduces each
head's squares in registers, norms, turns and writes: q and k are read once instead of twice.

The heads are ``qkv[:, first:first + heads]``; ``first`` must be a multiple of ``heads`` (k
after n q heads: grouped-query attention's n is a multiple of its k heads), and ``heads`` and
the head size powers of two (Triton's blocks). ``reference.normed_rope`` is the semantics.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_T = 16  # tokens a program: every token bucket is a multiple


def unsupported_reason(qkv: Any, first: int, heads: int, block_t: int = BLOCK_T) -> str | None:
    """Why the kernel does not take these heads of ``qkv [T, X, D]``, or None."""
    t, x, d = qkv.shape
    if heads & (heads - 1) or d & (d - 1) or d < 32:
        return f"{heads} heads of {d}: the kernel takes powers of two (a head of 32 or more)"
    if first % heads or first + heads > x:
        return f"heads {first}..{first + heads} of {x}: the first must be a multiple of {heads}"
    if t % block_t:
        return f"{t} tokens: the kernel takes a multiple of {block_t}"
    if qkv.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtype {qkv.dtype}: the kernel takes bfloat16, float16 or float32"
    return None


def _kernel(x_ref, w_ref, cos_ref, sin_ref, o_ref, *, eps: float, half: int, unit_offset: bool):
    # x_ref [block_t, heads, D] of qkv; w_ref [D]; cos_ref, sin_ref [block_t, D]
    dtype = o_ref.dtype
    x1 = x_ref[:, :, pl.ds(0, half)].astype(jnp.float32)
    x2 = x_ref[:, :, pl.ds(half, half)].astype(jnp.float32)
    squares = jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)  # [block_t, heads]
    scale = jax.lax.rsqrt(squares / (2 * half) + eps)[:, :, None]
    w1, w2 = w_ref[pl.ds(0, half)][None, None, :], w_ref[pl.ds(half, half)][None, None, :]
    if unit_offset:  # (x / rms) (1 + w) in float32, then one cast
        y1 = (x1 * scale * (1.0 + w1.astype(jnp.float32))).astype(dtype)
        y2 = (x2 * scale * (1.0 + w2.astype(jnp.float32))).astype(dtype)
    else:  # x / rms cast first, then the weight in x's dtype
        y1 = w1 * (x1 * scale).astype(dtype)
        y2 = w2 * (x2 * scale).astype(dtype)
    c = cos_ref[:, pl.ds(0, half)][:, None, :]
    s = sin_ref[:, pl.ds(0, half)][:, None, :]
    o_ref[:, :, pl.ds(0, half)] = (y1 * c - y2 * s).astype(dtype)
    o_ref[:, :, pl.ds(half, half)] = (y2 * c + y1 * s).astype(dtype)


@functools.partial(
    jax.jit, static_argnames=("first", "heads", "eps", "unit_offset", "block_t", "interpret")
)
def normed_rope(
    qkv: jax.Array,  # [T, X, D]
    weight: jax.Array,  # [D]
    cos: jax.Array,  # [T, D]  qkv's dtype
    sin: jax.Array,  # [T, D]
    *,
    first: int,
    heads: int,
    eps: float,
    unit_offset: bool = False,
    block_t: int = BLOCK_T,
    interpret: bool = False,
) -> jax.Array:  # [T, heads, D]
    """``reference.normed_rope`` on the kernel; see the module docstring."""
    reason = unsupported_reason(qkv, first, heads, block_t)
    if reason is not None:
        raise ValueError(f"normed_rope: {reason}")
    t, _, d = qkv.shape
    kernel = functools.partial(_kernel, eps=eps, half=d // 2, unit_offset=unit_offset)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, heads, d), qkv.dtype),
        grid=(t // block_t,),
        in_specs=[
            pl.BlockSpec((block_t, heads, d), lambda i: (i, first // heads, 0)),
            pl.BlockSpec((d,), lambda i: (0,)),
            pl.BlockSpec((block_t, d), lambda i: (i, 0)),
            pl.BlockSpec((block_t, d), lambda i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((block_t, heads, d), lambda i: (i, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qk_norm_rope",
    )(qkv, weight, cos, sin)
