"""fp8 GEMM for decode-sized steps as a Pallas Mosaic GPU kernel (Hopper's wgmma).

A decode step multiplies a few token rows by every weight of the model, so with fp8 weights its
matmuls should read one byte per weight at the H200's bandwidth. XLA's fp8 GEMMs reached about
half of that at 1-16 rows, and its W8A8 GEMM (cuBLASLt) was slower than weight-only at batch 1.
This kernel is built for the weight stream, with the product turned around:

    y^T [N, M] = W [N, K] . x^T [K, M]

so the weight is wgmma's A operand (64 output channels a warpgroup, the M of the instruction)
and the few token rows are its N (a multiple of 8, up to ``MAX_ROWS``): no tensor-core work is
spent on padding rows, and the weight keeps the checkpoint's ``[out, in]`` layout, K-major, as
fp8 wgmma wants both operands. Each program owns ``block_n`` output channels and one of
``num_splits`` shares of K, and streams ``[block_n, block_k]`` weight tiles through shared
memory with TMA, ``num_stages`` in flight (``plgpu.emit_pipeline``). A program that holds the
whole of K finishes the product itself: both scales (read into shared memory while the weight
streams), the output dtype, and the tile stored transposed, so the kernel writes ``[M, N]`` (the
rows padded to a multiple of 8) and nothing runs after it. When the channels alone give too few
programs to fill the GPU, K is split instead, and the f32 partial sums are added after the
kernel, in XLA, which then applies the scales and turns the product back to ``[M, N]``.

Two modes (``reference`` has the semantics):
- W8A8 (``act_quant=True``): x quantized per row to fp8 (in XLA, before the kernel); both
  operands go to the fp8 wgmma from shared memory as they landed.
- weight-only (``act_quant=False``): x in float16, the weight tile converted e4m3 -> f16 in
  registers (Hopper converts two values an instruction; e4m3 -> bf16 it does not) and fed to
  the wgmma as its register operand. Pallas interpret mode has no register operand for wgmma,
  so there the converted tile goes through shared memory instead (``dequant_in_smem``).

The weight's N and K must be multiples of 64 (every projection of the shipped configs is);
``unsupported_reason`` says why a call does not fit, and the caller falls back to XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_matmul.reference import FP8, as_f16, quantize_rows

ROWS = 64  # output channels of one wgmma (its M)
MAX_ROWS = 128  # token rows the kernel takes (wgmma's N, padded to a multiple of 8)
X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
DEFAULT_NUM_SMS = 132  # H100 / H200
SMEM_BYTES = 227 * 1024  # shared memory one block may use on H100 / H200
# Split K until the grid holds this many programs per SM, keeping at least num_stages tiles
# per program for the pipeline to fill.
PROGRAMS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class Fp8MatmulConfig:
    """Static tiles of one call; ``num_splits=None`` picks the K split from the shapes."""

    block_n: int = 64  # output channels per program: 64 or 128
    block_k: int = 128  # K per pipeline step: 64, 128 or 256
    num_stages: int = 4
    num_splits: int | None = None

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise ValueError(f"{self.block_n=} must be 64 or 128")
        if self.block_k not in (64, 128, 256):
            raise ValueError(f"{self.block_k=} must be 64, 128 or 256")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")


def num_sms() -> int:
    """Streaming multiprocessors of the first device (132 on an H200 or when it does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_NUM_SMS)


def padded_rows(m: int) -> int:
    """The token rows as the kernel computes them: a multiple of 8 (wgmma's N)."""
    return -(-m // 8) * 8


def plan(m: int, k: int, n: int, config: Fp8MatmulConfig, sms: int) -> Fp8MatmulConfig:
    """``config`` with ``block_k`` fitted to K and ``num_splits`` chosen: K is split in halves
    while the grid is short of ``PROGRAMS_PER_SM`` programs an SM and each share keeps at least
    ``num_stages`` tiles."""
    block_k = config.block_k
    while k % block_k:
        block_k //= 2
    k_steps = k // block_k
    num_splits = config.num_splits
    if num_splits is None:
        n_blocks = n // config.block_n
        num_splits = 1
        while (
            n_blocks * num_splits < PROGRAMS_PER_SM * sms
            and k_steps % (2 * num_splits) == 0
            and k_steps // (2 * num_splits) >= config.num_stages
        ):
            num_splits *= 2
    return dataclasses.replace(config, block_k=block_k, num_splits=num_splits)


def smem_bytes(m: int, config: Fp8MatmulConfig, act_quant: bool, dequant_in_smem: bool) -> int:
    """Shared memory of one program: the pipeline's stages, then the output tile."""
    x_itemsize = 1 if act_quant else 2
    stage = config.block_n * config.block_k + padded_rows(m) * config.block_k * x_itemsize
    converted = config.block_n * config.block_k * 2 if dequant_in_smem and not act_quant else 0
    out = config.block_n * padded_rows(m) * 4  # f32 partial sums, or the output (at most f32)
    scales = (config.block_n + padded_rows(m)) * 4
    return config.num_stages * stage + converted + out + scales


def unsupported_reason(x: Any, w: Any, w_scale: Any, config: Fp8MatmulConfig) -> str | None:
    """Why the kernel does not take this call (shapes and dtypes only), or None."""
    if x.ndim != 2 or w.ndim != 2:
        return f"x {x.shape} and w {w.shape} must be 2-D"
    m, k = x.shape
    n, k_w = w.shape
    if not 1 <= m <= MAX_ROWS:
        return f"{m=} rows: the kernel takes 1 to {MAX_ROWS}"
    if k_w != k:
        return f"x {x.shape} and w {w.shape} ([N, K]) disagree on K"
    if w.dtype != FP8:
        return f"w dtype {w.dtype}: the kernel takes float8_e4m3fn"
    if x.dtype not in X_DTYPES:
        return f"x dtype {x.dtype}: the kernel takes bfloat16, float16 or float32"
    if n % config.block_n or k % 64:
        return f"w [N={n}, K={k}]: N must be a multiple of {config.block_n} and K of 64"
    if w_scale.shape != (n,) or w_scale.dtype != jnp.float32:
        return f"w_scale {w_scale.dtype}{list(w_scale.shape)} must be float32[{n}]"
    return None


def _kernel(
    w_ref,  # f8[N, K] (GMEM)
    x_ref,  # [Mp, K] f8 (W8A8) or f16 (GMEM)
    scales_ref,  # f32[N + Mp] (GMEM): the weight's per channel, then the rows' (direct only)
    o_ref,  # [Mp, N] out dtype (direct), or f32[num_splits, N, Mp] partial sums (GMEM)
    o_smem,  # [Mp, block_n] out dtype (direct), or f32[block_n, Mp]
    a_smem,  # f16[block_n, block_k]: the converted weight tile (dequant_in_smem), else None
    scales_smem,  # f32[block_n + Mp] (direct), else None
    scales_bar,  # its barrier (direct), else None
    *,
    tiles: Fp8MatmulConfig,
    k_steps: int,  # pipeline steps of one split
):
    n_block = lax.axis_index("n")
    split = lax.axis_index("split")
    rows = x_ref.shape[0]
    first = split * k_steps
    channels = pl.ds(n_block * tiles.block_n, tiles.block_n)
    if scales_smem is not None:  # in flight while the weight streams
        block_n, n = tiles.block_n, w_ref.shape[0]
        plgpu.copy_gmem_to_smem(scales_ref.at[channels], scales_smem.at[:block_n], scales_bar)
        plgpu.copy_gmem_to_smem(scales_ref.at[pl.ds(n, rows)], scales_smem.at[block_n:], scales_bar)

    def scope(acc_ref):  # f32[block_n, Mp] accumulator
        def step(_, w_smem, x_smem):
            b = x_smem.transpose((1, 0))  # [block_k, Mp], K-major as fp8 wgmma wants
            if w_smem.dtype == x_smem.dtype:  # W8A8: fp8 x fp8 from shared memory
                plgpu.wgmma(acc_ref, w_smem, b)
            elif a_smem is None:  # weight-only: e4m3 -> f16 in registers, the register operand
                plgpu.wgmma(acc_ref, w_smem[...].astype(jnp.float16), b)
            else:  # weight-only in interpret mode: the converted tile through shared memory
                a_smem[...] = w_smem[...].astype(jnp.float16)
                plgpu.commit_smem()
                plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(0)  # the stage's buffers are free for the next TMA when it returns

        plgpu.emit_pipeline(
            step,
            grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((tiles.block_n, tiles.block_k), lambda i: (n_block, first + i)),
                plgpu.BlockSpec((rows, tiles.block_k), lambda i: (0, first + i)),
            ],
            max_concurrent_steps=tiles.num_stages,
        )(w_ref, x_ref)
        return acc_ref[...]

    out = pl.run_scoped(scope, plgpu.ACC((tiles.block_n, rows), jnp.float32))
    if scales_smem is None:  # a share of K: the f32 partial sums, as they are
        o_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, channels])
    else:
        _store_scaled(out, o_ref.at[:, channels], o_smem, scales_smem, scales_bar)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_scaled(out, o_ref, o_smem, scales_smem, scales_bar) -> None:
    """A program that held the whole of K: ``out`` f32[block_n, Mp] times both scales, in the
    output dtype, stored transposed into ``o_ref`` [Mp, block_n] (GMEM)."""
    block_n = out.shape[0]
    plgpu.barrier_wait(scales_bar)
    w_scale = scales_smem[:block_n]  # f32[block_n]: a scale per accumulator row
    x_scale = scales_smem[block_n:]  # f32[Mp]: a scale per column
    out = out * lax.broadcast_in_dim(w_scale, out.shape, [0])
    out = out * lax.broadcast_in_dim(x_scale, out.shape, [1])
    o_smem.T[...] = out.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)


@functools.partial(jax.jit, static_argnames=("act_quant", "out_dtype", "config", "interpret"))
def fp8_matmul(
    x: jax.Array,  # [M, K]  bf16 | f16 | f32, M <= MAX_ROWS
    w: jax.Array,  # f8e4m3[N, K]
    w_scale: jax.Array,  # f32[N]  per output channel
    *,
    act_quant: bool,
    out_dtype: Any = None,  # default: x's dtype
    config: Fp8MatmulConfig = Fp8MatmulConfig(),
    interpret: bool = False,
) -> jax.Array:  # [M, N] out_dtype
    """``x @ (w * w_scale).T`` on the Mosaic GPU kernel; see the module docstring."""
    reason = unsupported_reason(x, w, w_scale, config)
    if reason is not None:
        raise ValueError(f"fp8_matmul: {reason}")
    m, k = x.shape
    n = w.shape[0]
    rows = padded_rows(m)
    tiles = plan(m, k, n, config, num_sms())
    assert tiles.num_splits is not None
    dequant_in_smem = interpret and not act_quant
    smem = smem_bytes(m, tiles, act_quant, dequant_in_smem)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"fp8_matmul: {m} rows with {tiles} need {smem:,} bytes of shared memory; the "
            f"limit is {SMEM_BYTES:,}: lower num_stages or block_k"
        )
    if act_quant:
        xk, x_scale = quantize_rows(x)  # f8[M, K], f32[M, 1]
    else:
        xk, x_scale = as_f16(x), jnp.ones((m, 1), jnp.float32)
    xk = jnp.pad(xk, ((0, rows - m), (0, 0)))  # zero rows: nothing added to the real ones
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    direct = tiles.num_splits == 1
    out = _launch(w, xk, w_scale, x_scale, tiles, out_dtype, direct, dequant_in_smem, interpret)
    if direct:
        return out[:m]  # [Mp, N] -> [M, N] (nothing to cut when M is a multiple of 8)
    y = out.sum(axis=0)[:, :m].T  # f32[M, N]
    return (y * x_scale * w_scale).astype(out_dtype)


def _launch(
    w: jax.Array,
    xk: jax.Array,  # [Mp, K]
    w_scale: jax.Array,  # f32[N]
    x_scale: jax.Array,  # f32[M, 1]
    tiles: Fp8MatmulConfig,
    out_dtype: Any,
    direct: bool,  # K whole in each program: the kernel scales and writes [Mp, N] itself
    dequant_in_smem: bool,
    interpret: bool,
) -> jax.Array:  # [Mp, N] out_dtype (direct), else f32[num_splits, N, Mp]
    assert tiles.num_splits is not None
    (n, k), rows = w.shape, xk.shape[0]
    scales = jnp.concatenate(
        [w_scale, jnp.pad(x_scale[:, 0], (0, rows - x_scale.shape[0]))]
    )  # f32[N + Mp]
    body = functools.partial(_kernel, tiles=tiles, k_steps=k // tiles.block_k // tiles.num_splits)
    if direct:
        out_type = jax.ShapeDtypeStruct((rows, n), out_dtype)
        o_smem = plgpu.SMEM((rows, tiles.block_n), out_dtype)
    else:
        out_type = jax.ShapeDtypeStruct((tiles.num_splits, n, rows), jnp.float32)
        o_smem = plgpu.SMEM((tiles.block_n, rows), jnp.float32)
    scratch = [
        o_smem,
        plgpu.SMEM((tiles.block_n, tiles.block_k), jnp.float16) if dequant_in_smem else None,
        plgpu.SMEM((tiles.block_n + rows,), jnp.float32) if direct else None,
        plgpu.Barrier(num_arrivals=2) if direct else None,
    ]
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(n // tiles.block_n, tiles.num_splits),
        grid_names=("n", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="fp8_matmul",
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(w, xk, scales)
