"""Skinny matmul: ``y[M, N] = x[M, K] @ W`` for decode-sized M, as a Pallas Triton kernel.

A decode step multiplies a few token rows by every weight of the model, so its matmuls are
bound by reading the weights, and XLA's GEMMs ran most of them at 60-70% of the H200's bandwidth
(the fused qkv, o, down and lm_head projections of Llama-3-8B at batch 1). This kernel is built
for the weight stream:

- The grid is N blocks x K splits. Each program walks its share of K in ``block_k`` steps, each
  step one ``[block_k, block_n]`` (or ``[block_n, block_k]``) weight tile of large contiguous
  rows, and accumulates ``x_tile @ w_tile`` in f32 registers; Triton pipelines the loads
  ``num_stages`` deep. When N alone gives too few programs to fill the GPU, K is split too and
  the f32 partial sums are added after the kernel, in XLA.
- ``x``'s M rows (1..64) are loaded masked into a tile of ``block_m`` rows (at least 16, the
  smallest tensor-core dot); nothing is padded in memory. K and N need not divide the tiles.
- The weight is in the model's layout ``[K, N]`` (``w_layout="kn"``: bf16/fp16/f32 weights,
  the einsums' ``[in..., out...]`` reshaped) or in the quantized layout ``[N, K]``
  (``w_layout="nk"``: ``quant.QArray`` values, or a tied embedding). fp8 e4m3 and int8 values
  are loaded as one byte each and converted to x's dtype in registers; an f32 ``scale[N]`` (per
  output channel) multiplies the f32 sums.

``reference.skinny_matmul`` is the pure-jnp semantics, with the same signature;
``dispatch`` says whether a step of a given token count takes this kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
BYTE_DTYPES = (jnp.float8_e4m3fn, jnp.int8)  # converted to x's dtype in registers
LAYOUTS = ("kn", "nk")
MAX_ROWS = 64  # rows of x the kernel takes
DEFAULT_NUM_SMS = 132  # H200, when the device does not say
# Split K until the grid holds this many programs per SM, while the f32 partial sums cost at
# most this share of the weight's bytes (they are written and read back once each).
PROGRAMS_PER_SM = 4
MAX_PARTIAL_SHARE = 0.1
MIN_K_STEPS = 4  # weight tiles per program at least, for the pipeline to fill


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Static tiles of one call; ``None`` picks a value from the shapes (``plan``)."""

    block_n: int | None = None
    block_k: int | None = None
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self.num_warps=} must be 1, 2, 4, 8 or 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")


def num_sms() -> int:
    """Streaming multiprocessors of the first device (H200 132, A100 108)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_NUM_SMS)


def plan(
    m: int, k: int, n: int, w_itemsize: int, w_layout: str, sms: int, config: SkinnyConfig
) -> SkinnyConfig:
    """``config`` with every ``None`` replaced by a tile for these shapes.

    In the model's layout a weight tile is ``[128, 128]`` 16-bit values (256-byte rows along
    N); in the ``[N, K]`` layout ``[16..64, 256]`` bytes (256-byte rows along K), N tiles
    narrowed until the grid fills the GPU. Then K is split while it does not."""
    if w_layout == "kn":
        block_n = config.block_n or 128
        block_k = config.block_k or (128 if w_itemsize <= 2 else 64)
    else:
        block_n = config.block_n or 64
        block_k = config.block_k or max(64, 256 // w_itemsize)
    block_n = min(block_n, max(16, _next_pow2(n)))
    block_k = min(block_k, max(16, _next_pow2(k)))
    target = PROGRAMS_PER_SM * sms
    if w_layout == "nk" and config.block_n is None:
        # NOTE: a tile of an [N, K] weight reads block_k contiguous bytes per row at any
        # block_n, so narrower N tiles fill the GPU first, without partial sums to add after.
        while block_n > 16 and pl.cdiv(n, block_n) < target:
            block_n //= 2
    num_splits = config.num_splits
    if num_splits is None:
        n_blocks, k_blocks = pl.cdiv(n, block_n), pl.cdiv(k, block_k)
        # Partial sums: m x n f32 written and read per split, against k x n weight bytes.
        max_by_bytes = max(1, int(MAX_PARTIAL_SHARE * k * w_itemsize / (8 * m)))
        num_splits = 1
        while (
            n_blocks * num_splits < target
            and k_blocks >= MIN_K_STEPS * num_splits * 2
            and num_splits * 2 <= max_by_bytes
        ):
            num_splits *= 2
    return dataclasses.replace(config, block_n=block_n, block_k=block_k, num_splits=num_splits)


def unsupported_reason(x: Any, w: Any, scale: Any, w_layout: str) -> str | None:
    """Why the kernel does not take this call (shapes and dtypes only), or None."""
    if w_layout not in LAYOUTS:
        return f"{w_layout=} must be one of {LAYOUTS}"
    if x.ndim != 2 or w.ndim != 2:
        return f"x {x.shape} and w {w.shape} must be 2-D"
    m, k = x.shape
    k_w = w.shape[0] if w_layout == "kn" else w.shape[1]
    if not 1 <= m <= MAX_ROWS:
        return f"{m=} rows: the kernel takes 1 to {MAX_ROWS}"
    if k_w != k:
        return f"x {x.shape} and w {w.shape} ({w_layout}) disagree on K"
    if x.dtype not in X_DTYPES:
        return f"x dtype {x.dtype}: the kernel takes bfloat16, float16 or float32"
    if w.dtype not in BYTE_DTYPES and w.dtype != x.dtype:
        return f"w dtype {w.dtype}: the kernel takes x's dtype ({x.dtype}), fp8 e4m3 or int8"
    n = w.shape[1] if w_layout == "kn" else w.shape[0]
    if scale is not None and (scale.shape != (n,) or scale.dtype != jnp.float32):
        return f"scale {scale.dtype}{list(scale.shape)} must be float32[{n}]"
    return None


def _kernel(x_ref, w_ref, scale_ref, o_ref, *, tiles: SkinnyConfig, w_layout: str, block_m: int):
    # x_ref [M, K]; w_ref [K, N] or [N, K]; scale_ref f32[N] or None;
    # o_ref [M, N] (out dtype), or f32[num_splits, M, N] partial sums when K is split.
    assert tiles.block_n and tiles.block_k and tiles.num_splits
    block_n, block_k, num_splits = tiles.block_n, tiles.block_k, tiles.num_splits
    n_block, split = pl.program_id(0), pl.program_id(1)
    m, k = x_ref.shape
    n = w_ref.shape[1] if w_layout == "kn" else w_ref.shape[0]
    n0 = n_block * block_n
    is_row = jnp.arange(block_m, dtype=jnp.int32) < m  # bool[block_m]
    is_col = n0 + jnp.arange(block_n, dtype=jnp.int32) < n  # bool[block_n]
    mask_k, mask_n = k % block_k != 0, n % block_n != 0  # static: masks only where needed
    num_k_blocks = pl.cdiv(k, block_k)
    k_lo = num_k_blocks * split // num_splits
    k_hi = num_k_blocks * (split + 1) // num_splits
    rows, cols = pl.ds(0, block_m), pl.ds(n0, block_n)

    def step(i, acc):  # acc f32[block_m, block_n]
        k0 = pl.multiple_of(i * block_k, block_k)
        ks = pl.ds(k0, block_k)
        is_k = k0 + jnp.arange(block_k, dtype=jnp.int32) < k  # bool[block_k]
        x_mask = is_row[:, None] & (is_k[None, :] if mask_k else True)
        x_mask = jnp.broadcast_to(x_mask, (block_m, block_k))
        x = pltriton.load(x_ref.at[rows, ks], mask=x_mask, other=0.0)  # [block_m, block_k]
        if w_layout == "kn":
            w_view, k_axis, n_axis = w_ref.at[ks, cols], 0, 1  # [block_k, block_n]
        else:
            w_view, k_axis, n_axis = w_ref.at[cols, ks], 1, 0  # [block_n, block_k]
        w_mask = None
        if mask_k or mask_n:
            w_mask = jnp.expand_dims(is_k, 1 - k_axis) if mask_k else True
            w_mask = w_mask & (jnp.expand_dims(is_col, 1 - n_axis) if mask_n else True)
            w_mask = jnp.broadcast_to(w_mask, w_view.shape)
        zero = 0 if jnp.issubdtype(w_ref.dtype, jnp.integer) else 0.0  # (0 -> fp8: no cast)
        # Each weight is read once per step: streamed past L2 first, leaving it to x and
        # the KV cache.
        w = pltriton.load(
            w_view,
            mask=w_mask,
            other=zero if w_mask is not None else None,
            eviction_policy="evict_first",
        )
        # NOTE: the conversion of fp8/int8 values happens here, in registers: the weight
        # crosses the memory bus at one byte per value.
        w = w.astype(x.dtype)
        return acc + pltriton.dot(x, w, trans_b=w_layout == "nk")

    acc = lax.fori_loop(k_lo, k_hi, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_mask = is_row[:, None] & is_col[None, :]
    if num_splits > 1:
        pltriton.store(o_ref.at[split, rows, cols], acc, mask=out_mask)
        return
    if scale_ref is not None:
        acc = acc * pltriton.load(scale_ref.at[cols], mask=is_col, other=0.0)[None, :]
    pltriton.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=out_mask)


# NOTE: behind one jit, so the model's calls of one shape (every layer's qkv, say) share one
# lowering of the kernel: lowered at each call, 32 layers' calls took 2.4 s to lower, against
# 0.13 s shared (on the CPU, one token bucket's qkv projections at the Llama-3-8B shape).
@functools.partial(jax.jit, static_argnames=("w_layout", "out_dtype", "config", "interpret"))
def skinny_matmul(
    x: jax.Array,  # [M, K]  bf16 | f16 | f32, M <= 64
    w: jax.Array,  # [K, N] ("kn") or [N, K] ("nk"): x's dtype, f8e4m3 or i8
    scale: jax.Array | None = None,  # f32[N]  per output channel, applied to the f32 sums
    *,
    w_layout: str = "kn",
    out_dtype: Any = None,  # default: x's dtype
    config: SkinnyConfig = SkinnyConfig(),
    interpret: bool = False,
) -> jax.Array:  # [M, N] out_dtype
    """``x @ W`` (times ``scale``) on the Pallas Triton kernel; see the module docstring."""
    reason = unsupported_reason(x, w, scale, w_layout)
    if reason is not None:
        raise ValueError(f"skinny_matmul: {reason}")
    m, k = x.shape
    n = w.shape[1] if w_layout == "kn" else w.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    tiles = plan(m, k, n, w.dtype.itemsize, w_layout, num_sms(), config)
    assert tiles.block_n and tiles.num_splits
    is_split = tiles.num_splits > 1
    out_shape = jax.ShapeDtypeStruct(
        (tiles.num_splits, m, n) if is_split else (m, n), jnp.float32 if is_split else out_dtype
    )
    body = functools.partial(
        _kernel, tiles=tiles, w_layout=w_layout, block_m=max(16, _next_pow2(m))
    )
    args: tuple[jax.Array, ...] = (x, w)
    if scale is not None and not is_split:
        args += (scale,)
    else:
        body = _without_scale(body)
    out = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(pl.cdiv(n, tiles.block_n), tiles.num_splits),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="skinny_matmul",
    )(*args)
    if not is_split:
        return out
    y = out.sum(axis=0)  # f32[M, N]
    if scale is not None:
        y = y * scale
    return y.astype(out_dtype)


def _without_scale(body):
    def wrapped(x_ref, w_ref, o_ref):
        return body(x_ref, w_ref, None, o_ref)

    return wrapped
