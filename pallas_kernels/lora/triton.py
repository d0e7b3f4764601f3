"""The LoRA product as a grouped (segmented) matmul in Pallas Triton: Punica's SGMV, as vLLM's
``lora_shrink`` / ``lora_expand`` kernels do it.

Same signature and semantics as ``reference.lora_deltas``: ``x [T, X]``, ``a [M, X, n * R]``,
``bs`` n x ``[M, R, O_i]``, ``token_slots i32[T]`` (0: no adapter; s >= 1: row s - 1), the n
terms ``[T, O_i]`` in x's dtype, sums in f32.

How it runs (one call per projection group of a layer):
  1. Sort (XLA): the tokens ordered by slot, the base model's tokens last
     (``sort_tokens``: a stable argsort of T ints and a bincount); the rows of x gathered in
     that order. Every call of a step sorts the same ``token_slots``, which XLA computes once.
  2. Shrink (kernel): ``xa[T, n * R] = x @ A[slot]`` per segment. The grid is K splits x row
     tiles; the row tiles are the grouped matmul's plan (``grouped_matmul.triton.plan_tiles``:
     one tile per (slot, block of ``block_m`` sorted rows) that slot's rows touch, computed on
     the device from the slots' token counts, a fixed grid whatever the routing). A tile walks
     its split's share of X in ``block_k`` steps, each step one ``[block_k, n * R]`` tile of its
     slot's A. The base model's tokens form the last segment: their tiles store zeros and read
     no weight; the tiles past the plan's end return at once. Splitting X gives a decode step
     with a handful of tokens enough programs to stream A at the memory's speed; the f32
     partial sums (``[splits, T, n * R]``, small: R is 8-64) are added in XLA.
  3. Expand (kernel): ``y[T, O] = xa_i @ B_i[slot]`` per segment, the grid output column
     tiles x the same row tiles; each tile reads its slot's ``[R, block_n]`` strip of B once.
     The base model's segment stores zeros.
  4. Unsort (XLA): the rows of y put back in the tokens' order (a gather by the inverse
     permutation).

So a step reads the A and B of each slot that has tokens once per row tile (at decode: once),
and nothing of an empty slot or for the base model's tokens: with few tokens on adapters the
term costs little, where the dense product reads every slot's A and B whatever the step holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped_matmul.triton import num_tiles_for, plan_tiles
from pallas_kernels.skinny_matmul.triton import num_sms

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
PROGRAMS_PER_SM = 4  # the shrink splits X until its grid holds about this many per SM
MAX_SPLITS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_block(name: str, value: int | None) -> None:
    if value is not None and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class LoraKernelConfig:
    """Static tiles; ``None`` picks from the shapes (``plan``)."""

    block_m: int | None = None  # sorted rows a tile: 16 at decode, 64 when slots hold many
    block_k: int | None = None  # the shrink's step along X
    block_n: int | None = None  # the expand's output columns a tile
    num_splits: int | None = None  # the shrink's splits of X (a power of two)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            _check_block(name, getattr(self, name))
        if self.num_splits is not None and (
            self.num_splits < 1 or self.num_splits & (self.num_splits - 1)
        ):
            raise ValueError(f"num_splits={self.num_splits} must be a power of two >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self.num_warps=} must be 1, 2, 4, 8 or 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")


def plan(num_tokens: int, num_slots: int, size_x: int, sms: int, config: LoraKernelConfig):
    """``config`` with every ``None`` filled for these shapes. Splits of X: as many as keep the
    tiles that may hold rows (at most one per token block and slot) under
    ``PROGRAMS_PER_SM`` programs per SM, and at least one ``block_k`` step each."""
    block_m = config.block_m or (16 if num_tokens <= 32 * num_slots else 64)
    block_k = config.block_k or min(128, max(16, _next_pow2(size_x)))
    num_splits = config.num_splits
    if num_splits is None:
        busy = pl.cdiv(num_tokens, block_m) + min(num_slots, num_tokens)
        k_blocks = pl.cdiv(size_x, block_k)
        num_splits = 1
        while (
            num_splits * 2 <= min(k_blocks, MAX_SPLITS)
            and busy * num_splits * 2 <= PROGRAMS_PER_SM * sms
        ):
            num_splits *= 2
    return dataclasses.replace(
        config, block_m=block_m, block_k=block_k, num_splits=num_splits, block_n=config.block_n
    )


def sort_tokens(
    token_slots: jax.Array,  # i32[T]  0: none; s: row s - 1
    num_slots: int,
) -> tuple[jax.Array, jax.Array]:  # order i32[T], group sizes i32[M]
    """The tokens in slot order, the base model's last (stable), and each slot's count."""
    key = jnp.where(token_slots > 0, token_slots, num_slots + 1)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(token_slots, length=num_slots + 1)[1:].astype(jnp.int32)
    return order, sizes


def _tile(plan_ref, tile, block_m: int):
    """(segment, first row, row mask [block_m]) of row tile ``tile``, and whether it works."""
    segment, first_row = plan_ref[0, tile], plan_ref[1, tile]
    lo, hi = plan_ref[2, tile], plan_ref[3, tile]
    rows = first_row + jnp.arange(block_m, dtype=jnp.int32)
    return segment, first_row, (rows >= lo) & (rows < hi), hi > lo


def _mask2(rows, cols):
    """A 2-D mask from row and column masks, either None (all true)."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], (1, cols.shape[0]))
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def _shrink_kernel(plan_ref, x_ref, a_ref, out_ref, *, tiles, block_r, precision):
    # plan_ref i32[4, tiles]; x_ref [T, X] sorted; a_ref [M, X, R]; out_ref f32[S, T, R]
    split, tile = pl.program_id(0), pl.program_id(1)
    num_slots, size_x, size_r = a_ref.shape
    block_m, block_k, num_splits = tiles.block_m, tiles.block_k, tiles.num_splits
    segment, first_row, is_row, works = _tile(plan_ref, tile, block_m)
    is_r = jnp.arange(block_r, dtype=jnp.int32) < size_r if size_r % block_r else None
    out_tile = out_ref.at[split, pl.ds(first_row, block_m), pl.ds(0, block_r)]
    out_mask = _mask2(is_row, is_r)
    steps = pl.cdiv(pl.cdiv(size_x, block_k), num_splits)  # static: block_k steps a split
    ragged_k = size_x % (block_k * num_splits) != 0  # static: the last steps need a mask

    def step(i, acc):  # acc f32[block_m, block_r]
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        is_k = k0 + jnp.arange(block_k, dtype=jnp.int32) < size_x if ragged_k else None
        x = pltriton.load(
            x_ref.at[pl.ds(first_row, block_m), pl.ds(k0, block_k)],
            mask=_mask2(is_row, is_k),
            other=0,
        )  # [block_m, block_k]
        a_mask = _mask2(is_k, is_r)
        a = pltriton.load(
            a_ref.at[segment, pl.ds(k0, block_k), pl.ds(0, block_r)],
            mask=None if a_mask is None else jnp.broadcast_to(a_mask, (block_k, block_r)),
            other=None if a_mask is None else 0,
        )  # [block_k, block_r]
        return acc + pltriton.dot(x, a, precision=precision)

    @pl.when(works & (segment < num_slots))
    def _():
        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_r), jnp.float32))
        pltriton.store(out_tile, acc, mask=out_mask)

    # The base model's tokens: zeros, no weight read.
    @pl.when(works & (segment >= num_slots))
    def _():
        pltriton.store(out_tile, jnp.zeros((block_m, block_r), jnp.float32), mask=out_mask)


def _expand_kernel(plan_ref, xa_ref, b_ref, out_ref, *, block_m, block_n, block_r, precision):
    # plan_ref i32[4, tiles]; xa_ref [T, R] sorted; b_ref [M, R, O]; out_ref [T, O] sorted
    col, tile = pl.program_id(0), pl.program_id(1)
    num_slots, size_r, size_o = b_ref.shape
    segment, first_row, is_row, works = _tile(plan_ref, tile, block_m)
    is_r = jnp.arange(block_r, dtype=jnp.int32) < size_r if size_r % block_r else None
    cols = col * block_n + jnp.arange(block_n, dtype=jnp.int32)
    is_col = cols < size_o if size_o % block_n else None
    out_tile = out_ref.at[pl.ds(first_row, block_m), pl.ds(col * block_n, block_n)]
    out_mask = _mask2(is_row, is_col)

    @pl.when(works & (segment < num_slots))
    def _():
        xa = pltriton.load(
            xa_ref.at[pl.ds(first_row, block_m), pl.ds(0, block_r)],
            mask=_mask2(is_row, is_r),
            other=0,
        )  # [block_m, block_r]
        b_mask = _mask2(is_r, is_col)
        b = pltriton.load(
            b_ref.at[segment, pl.ds(0, block_r), pl.ds(col * block_n, block_n)],
            mask=None if b_mask is None else jnp.broadcast_to(b_mask, (block_r, block_n)),
            other=None if b_mask is None else 0,
        )  # [block_r, block_n]
        y = pltriton.dot(xa, b, precision=precision)
        pltriton.store(out_tile, y.astype(out_ref.dtype), mask=out_mask)

    @pl.when(works & (segment >= num_slots))
    def _():
        pltriton.store(out_tile, jnp.zeros((block_m, block_n), out_ref.dtype), mask=out_mask)


def unsupported_reason(x, a, bs) -> str | None:
    """Why this call cannot run on the kernel (shapes and dtypes only), or None."""
    if x.ndim != 2 or a.ndim != 3 or x.shape[1] != a.shape[1]:
        return f"shapes x {x.shape}, a {a.shape}: the kernel takes [T, X] and [M, X, R]"
    if not bs or a.shape[2] % len(bs):
        return f"a's rank axis ({a.shape[2]}) must split into {len(bs)} equal parts"
    rank = a.shape[2] // len(bs)
    for b in bs:
        if b.ndim != 3 or b.shape[:2] != (a.shape[0], rank):
            return f"b {b.shape} must be [{a.shape[0]}, {rank}, O]"
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in (a, *bs)):
        return "dtypes: x, a and b alike, bfloat16, float16 or float32"
    return None


def _precision(dtype) -> lax.Precision | None:
    # NOTE: f32 inputs (the CPU's default dtype) keep full precision, not TF32.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def shrink(
    x: jax.Array,  # [T, X]  sorted by slot, the base model's tokens last
    a: jax.Array,  # [M, X, R]
    tile_plan: jax.Array,  # i32[4, tiles]  ``plan_tiles`` of the slots' token counts
    tiles: LoraKernelConfig,  # resolved by ``plan``
    interpret: bool,
) -> jax.Array:  # f32[T, R]
    assert tiles.block_m and tiles.block_k and tiles.num_splits
    block_r = max(16, _next_pow2(a.shape[2]))
    body = functools.partial(
        _shrink_kernel, tiles=tiles, block_r=block_r, precision=_precision(x.dtype)
    )
    partial = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((tiles.num_splits, x.shape[0], a.shape[2]), jnp.float32),
        grid=(tiles.num_splits, tile_plan.shape[1]),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="lora_shrink",
    )(tile_plan, x, a)
    return partial.sum(axis=0) if tiles.num_splits > 1 else partial[0]


def expand(
    xa: jax.Array,  # [T, R]  sorted, x's dtype
    b: jax.Array,  # [M, R, O]
    tile_plan: jax.Array,
    tiles: LoraKernelConfig,
    interpret: bool,
) -> jax.Array:  # [T, O] sorted, xa's dtype
    assert tiles.block_m
    size_o = b.shape[2]
    block_n = tiles.block_n or min(128, max(16, _next_pow2(size_o)))
    body = functools.partial(
        _expand_kernel,
        block_m=tiles.block_m,
        block_n=block_n,
        block_r=max(16, _next_pow2(b.shape[1])),
        precision=_precision(xa.dtype),
    )
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((xa.shape[0], size_o), xa.dtype),
        grid=(pl.cdiv(size_o, block_n), tile_plan.shape[1]),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="lora_expand",
    )(tile_plan, xa, b)


# NOTE: behind one jit, so the calls of one shape (every layer's qkv, say) share one lowering.
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, X, n * R]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none
    *,
    config: LoraKernelConfig = LoraKernelConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # n x [T, O_i], x's dtype
    """The n LoRA terms of one input on the kernels; see the module docstring."""
    reason = unsupported_reason(x, a, bs)
    if reason is not None:
        raise ValueError(f"lora_deltas on Pallas Triton: {reason}")
    num_tokens, size_x = x.shape
    num_slots = a.shape[0]
    if token_slots.shape != (num_tokens,):
        raise ValueError(f"token_slots.shape={token_slots.shape} must be ({num_tokens},)")
    tiles = plan(num_tokens, num_slots, size_x, num_sms(), config)
    assert tiles.block_m
    order, sizes = sort_tokens(token_slots, num_slots)
    tile_plan = plan_tiles(sizes, num_rows=num_tokens, block_m=tiles.block_m)
    assert tile_plan.shape[1] == num_tiles_for(num_tokens, num_slots, tiles.block_m)
    xa = shrink(x[order], a, tile_plan, tiles, interpret).astype(x.dtype)  # [T, n * R]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(num_tokens, dtype=jnp.int32))
    parts = jnp.split(xa, len(bs), axis=1)
    return tuple(
        expand(p, b, tile_plan, tiles, interpret)[inverse] for p, b in zip(parts, bs, strict=True)
    )
