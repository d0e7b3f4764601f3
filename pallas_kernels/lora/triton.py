"""The LoRA product as a grouped (segmented) matmul in Pallas Triton: Punica's SGMV, as vLLM's
``lora_shrink`` / ``lora_expand`` kernels do it.

Same signature and semantics as ``reference.lora_deltas``: ``x [T, X]``, ``a [M, n * R, X]``,
``bs`` n x ``[M, R, O_i]``, ``token_slots i32[T]`` (0: no adapter; s >= 1: row s - 1), the n
terms ``[T, O_i]`` in x's dtype, sums in f32.

How it runs (one call per projection group of a layer), in two kernels:
  1. Sort (XLA): the tokens ordered by slot, the base model's tokens last
     (``sort_tokens``: a stable argsort of T ints and a bincount). Every call of a step sorts
     the same ``token_slots``, which XLA computes once. Neither x nor the terms are permuted in
     memory: the kernels read and write rows through ``order``.
  2. Shrink (kernel): ``xa[T, n * R] = x @ A[slot]`` per segment. The grid is K splits x row
     tiles; the row tiles are the grouped matmul's plan (``grouped_matmul.triton.plan_tiles``:
     one tile per (slot, block of ``block_m`` sorted rows) that slot's rows touch, computed on
     the device from the slots' token counts, a fixed grid whatever the routing). A tile gathers
     its rows of x and walks its split's share of X in ``block_k`` steps, each step one
     ``[n * R, block_k]`` tile of its slot's A (stored X-minor, PEFT's lora_A layout). The base
     model's tokens form the last segment: no tile reads anything for them; the tiles past the
     plan's end return at once. Splitting X gives a decode step with a handful of tokens enough
     programs to stream A at the memory's speed; the f32 partial sums (``[splits, T, n * R]``,
     small: R is 8-64) are left as they are, in sorted order. With ``x_scale`` (a norm's weight,
     x its unscaled rows) each x tile is multiplied by its columns' weights as it is read,
     rounded as ``rms_norm`` rounds the product, so the decoder need not write the normed rows
     for the kernel: at decode XLA folds the weight into the base GEMM, and a written copy was a
     kernel of its own, two a layer (``models/lora.py``, ``LayerLora.normed``).
  3. Expand (kernel): ``y_i[T, O_i] = xa_i @ B_i[slot]`` for the n projections at once: the
     grid's columns are every output's column tiles one after another, its rows the same row
     tiles. A tile adds up the splits' partial sums of its rows, rounds them to x's dtype (as
     the reference does), reads its slot's ``[R, block_n]`` strip of B once and stores its rows
     at the tokens' own positions (a scatter through ``order``). The base model's tiles store
     zeros.

The old form's gathers of x, sum of the splits, one expand per projection and gathers back
were seven kernels and more per group (launch-bound at decode, 2-4 ms a Llama-3-8B step on
the H200 on 2026-12-05); this is two.

So a step reads the A and B of each slot that has tokens once per row tile (at decode: once),
and nothing of an empty slot or for the base model's tokens: with few tokens on adapters the
term costs little, where the dense product reads every slot's A and B whatever the step holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped_matmul.triton import num_tiles_for, plan_tiles
from pallas_kernels.lora import reference
from pallas_kernels.skinny_matmul.triton import num_sms

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# The fused form (``use_fused``): one launch a group, each output tile reducing its rows'
# x @ A over all of X itself. Measured on an H100 at one token (2026-12-05, rank 16, Llama-3-8B
# groups): 1 us faster than two launches in qkv and o, slower where X is long or the columns
# many (down 30.8 against 12.8 us, gate_up 21.8 against 16.8), a model step's terms 2.69 ms
# against 2.03 and batch-1 TPOT with one adapter 1.41x the base against 1.24x. So it runs only
# when asked for (``LoraKernelConfig.fused``). Its step along X: longer than the shrink's 128
# (the benchmark's sweep at one token: 128 and 256 within 10% of each other, 512 up to 40%
# slower).
FUSED_BLOCK_K = 256
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
    # One launch instead of two (``use_fused``): each output tile reduces its rows' x @ A over
    # all of X itself. Only when asked for: slower than two launches where it matters (above).
    fused: bool = False

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


def plan(
    num_tokens: int,
    num_slots: int,
    size_x: int,
    sms: int,
    config: LoraKernelConfig,
    fused: bool = False,
):
    """``config`` with every ``None`` filled for these shapes. Splits of X: as many as keep the
    tiles that may hold rows (at most one per token block and slot) under
    ``PROGRAMS_PER_SM`` programs per SM, and at least one ``block_k`` step each. ``fused``: the
    one-launch form's longer steps along X (``FUSED_BLOCK_K``; it has no splits)."""
    block_m = config.block_m or (16 if num_tokens <= 32 * num_slots else 64)
    widest = FUSED_BLOCK_K if fused else 128
    block_k = config.block_k or min(widest, max(16, _next_pow2(size_x)))
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


def one_launch_rank(rank: int) -> bool:
    """Whether the one-launch forms (fused, split-K) tile this rank: a power of two of at
    least 16 (each projection's columns of the joined A are then whole tiles, no mask)."""
    return rank >= 16 and not rank & (rank - 1)


def use_fused(config: LoraKernelConfig, rank: int) -> bool:
    """Whether the call runs as one launch: when ``config.fused`` asks for it, at a rank the
    one launch tiles (``one_launch_rank``)."""
    return config.fused and one_launch_rank(rank)


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


def _mask2(rows, cols, shape: tuple[int, int]):
    """A 2-D mask of ``shape`` from row and column masks, either None (all true); None when
    both are."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def _sorted_rows(order_ref, first_row, is_row):
    """The original row of each of a tile's sorted rows; where masked, one past the last.

    NOTE: a masked row's index must not be another row's: a masked store writes nothing on
    the GPU, but interpret mode stores the old value back and drops only indices out of
    bounds, so a masked duplicate of a real row could undo its store."""
    rows = first_row + jnp.arange(is_row.shape[0], dtype=jnp.int32)
    num_rows = order_ref.shape[0]
    return jnp.where(is_row, pltriton.load(order_ref.at[rows], mask=is_row, other=0), num_rows)


def _shrink_kernel(plan_ref, order_ref, x_ref, a_ref, *refs, tiles, block_r, precision):
    # plan_ref i32[4, tiles]; order_ref i32[T]; x_ref [T, X] in the tokens' order;
    # a_ref [M, R, X]; refs: (scale_ref [X],) when x is scaled, then out_ref f32[S, T, R] in
    # sorted order
    scale_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    split, tile = pl.program_id(0), pl.program_id(1)
    num_slots, size_r, size_x = a_ref.shape
    block_m, block_k, num_splits = tiles.block_m, tiles.block_k, tiles.num_splits
    segment, first_row, is_row, works = _tile(plan_ref, tile, block_m)
    is_r = jnp.arange(block_r, dtype=jnp.int32) < size_r if size_r % block_r else None
    out_tile = out_ref.at[split, pl.ds(first_row, block_m), pl.ds(0, block_r)]
    out_mask = _mask2(is_row, is_r, (block_m, block_r))
    steps = pl.cdiv(pl.cdiv(size_x, block_k), num_splits)  # static: block_k steps a split
    ragged_k = size_x % (block_k * num_splits) != 0  # static: the last steps need a mask

    @pl.when(works & (segment < num_slots))
    def _():
        source = _sorted_rows(order_ref, first_row, is_row)[:, None]  # [block_m, 1]

        def step(i, acc):  # acc f32[block_m, block_r]
            k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
            cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
            is_k = cols < size_x if ragged_k else None
            x = pltriton.load(
                x_ref.at[source, cols[None, :]],
                mask=_mask2(is_row, is_k, (block_m, block_k)),
                other=0,
            )  # [block_m, block_k]: the tile's rows, gathered
            if scale_ref is not None:  # a norm's weight: the product rms_norm rounds
                scale = pltriton.load(
                    scale_ref.at[cols], mask=is_k, other=None if is_k is None else 0
                )
                x = (scale[None, :] * x).astype(x.dtype)
            a_mask = _mask2(is_r, is_k, (block_r, block_k))
            a = pltriton.load(
                a_ref.at[segment, pl.ds(0, block_r), pl.ds(k0, block_k)],
                mask=a_mask,
                other=None if a_mask is None else 0,
            )  # [block_r, block_k]: A's rows, X minor as stored
            return acc + pltriton.dot(x, a, trans_b=True, precision=precision)

        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_r), jnp.float32))
        pltriton.store(out_tile, acc, mask=out_mask)


def _expand_kernel(
    plan_ref, order_ref, xa_ref, *refs, col_tiles, block_m, block_n, block_r, precision
):
    # plan_ref i32[4, tiles]; order_ref i32[T]; xa_ref f32[S, T, n * R] sorted (the shrink's
    # splits); refs: n b_ref [M, R, O_i], then n out_ref [T, O_i] in the tokens' order
    tile, parts = _output_tile(plan_ref, order_ref, refs, col_tiles, block_m)
    for part in parts:
        _expand_part(xa_ref, part, tile, block_n, block_r, precision)


def _fused_kernel(
    plan_ref, order_ref, x_ref, a_ref, *refs, col_tiles, block_m, block_n, block_k, precision
):
    # plan_ref i32[4, tiles]; order_ref i32[T]; x_ref [T, X] and a_ref [M, n * R, X];
    # refs: n b_ref [M, R, O_i], then n out_ref [T, O_i], both in the tokens' order
    tile, parts = _output_tile(plan_ref, order_ref, refs, col_tiles, block_m)
    for part in parts:
        _fused_part(x_ref, a_ref, part, tile, block_n, block_k, precision)


class _RowTile(NamedTuple):
    """A program's row tile (``_tile``)."""

    segment: Any  # its slot; >= num_slots: the base model's tokens
    first_row: Any  # its first row in sorted order
    is_row: Any  # bool[block_m]
    rows: Any  # i32[block_m, 1]: each row's token (one past the last where masked)


class _Part(NamedTuple):
    """One projection of a call, as a program of the output grid sees it."""

    number: int  # which projection (static)
    b_ref: Any  # [M, R, O_i]
    out_ref: Any  # [T, O_i]
    col: Any  # the program's column tile within this projection's
    here: Any  # whether the program's column is one of this projection's, on working rows


def _output_tile(
    plan_ref, order_ref, refs, col_tiles, block_m, col=None, tile=None
) -> tuple[_RowTile, list[_Part]]:
    """The program's row tile, and each projection's part: the grid's columns are every
    output's column tiles in turn. ``refs``: the n b_refs, then the n out_refs. ``col`` and
    ``tile``: the program's column and row tile (None: grid axes 0 and 1)."""
    col = pl.program_id(0) if col is None else col
    tile = pl.program_id(1) if tile is None else tile
    segment, first_row, is_row, works = _tile(plan_ref, tile, block_m)
    rows = _sorted_rows(order_ref, first_row, is_row)[:, None]
    num_parts, parts, first_col = len(refs) // 2, [], 0
    for i, count in enumerate(col_tiles):  # static
        part_col = col - first_col
        first_col += count
        here = works & (part_col >= 0) & (part_col < count)
        parts.append(_Part(i, refs[i], refs[num_parts + i], part_col, here))
    return _RowTile(segment, first_row, is_row, rows), parts


def _expand_part(xa_ref, part: _Part, tile: _RowTile, block_n, block_r, precision):
    """One projection's column tile of a row tile, from the shrink's partial sums."""
    num_slots, size_r = part.b_ref.shape[:2]
    block_m = tile.is_row.shape[0]
    is_r = jnp.arange(block_r, dtype=jnp.int32) < size_r if size_r % block_r else None
    out_tile, out_mask, is_col = _out_tile(part, tile, block_n)

    @pl.when(part.here & (tile.segment < num_slots))
    def _():
        rows = tile.first_row + jnp.arange(block_m, dtype=jnp.int32)
        xa_cols = part.number * size_r + jnp.arange(block_r, dtype=jnp.int32)
        xa_mask = _mask2(tile.is_row, is_r, (block_m, block_r))
        xa = jnp.zeros((block_m, block_r), jnp.float32)
        for split in range(xa_ref.shape[0]):  # static: the shrink's partial sums
            xa += pltriton.load(
                xa_ref.at[split, rows[:, None], xa_cols[None, :]], mask=xa_mask, other=0.0
            )  # [block_m, block_r]
        y = _times_b_strip(xa, part, tile.segment, block_n, is_r, is_col, precision)
        pltriton.store(out_tile, y.astype(part.out_ref.dtype), mask=out_mask)

    _zeros_for_the_base_model(part, tile, out_tile, out_mask, block_n)


def _fused_part(x_ref, a_ref, part: _Part, tile: _RowTile, block_n, block_k, precision):
    """One projection's column tile of a row tile, its rows' x @ A reduced here."""
    num_slots, size_r = part.b_ref.shape[:2]
    out_tile, out_mask, is_col = _out_tile(part, tile, block_n)

    @pl.when(part.here & (tile.segment < num_slots))
    def _():
        first_r = part.number * size_r  # the projection's columns of the joined A
        xa = _fused_xa(x_ref, a_ref, tile, first_r, size_r, block_k, precision)
        y = _times_b_strip(xa, part, tile.segment, block_n, None, is_col, precision)
        pltriton.store(out_tile, y.astype(part.out_ref.dtype), mask=out_mask)

    _zeros_for_the_base_model(part, tile, out_tile, out_mask, block_n)


def _out_tile(part: _Part, tile: _RowTile, block_n: int):
    """(the program's output tile, stored at the tokens' own rows; its mask; the column mask,
    None where the column tiles divide the output)."""
    size_o = part.b_ref.shape[2]
    cols = part.col * block_n + jnp.arange(block_n, dtype=jnp.int32)
    is_col = cols < size_o if size_o % block_n else None
    out_mask = _mask2(tile.is_row, is_col, (tile.is_row.shape[0], block_n))
    return part.out_ref.at[tile.rows, cols[None, :]], out_mask, is_col


def _zeros_for_the_base_model(part: _Part, tile: _RowTile, out_tile, out_mask, block_n: int):
    """The base model's tokens: zeros, no weight read."""

    @pl.when(part.here & (tile.segment >= part.b_ref.shape[0]))
    def _():
        zeros = jnp.zeros((tile.is_row.shape[0], block_n), part.out_ref.dtype)
        pltriton.store(out_tile, zeros, mask=out_mask)


def _times_b_strip(xa, part: _Part, segment, block_n: int, is_r, is_col, precision):
    """``xa`` (f32 [rows, block_r], the rows' x @ A) rounded to B's dtype, as the reference
    and the einsums round it, times the slot's ``[block_r, block_n]`` strip of B."""
    block_r = xa.shape[1]
    b_mask = _mask2(is_r, is_col, (block_r, block_n))
    b = pltriton.load(
        part.b_ref.at[segment, pl.ds(0, block_r), pl.ds(part.col * block_n, block_n)],
        mask=b_mask,
        other=None if b_mask is None else 0,
    )  # [block_r, block_n]
    return pltriton.dot(xa.astype(b.dtype), b, precision=precision)


def _fused_xa(x_ref, a_ref, tile: _RowTile, first_r: int, size_r: int, block_k: int, precision):
    """f32[block_m, R]: the tile's rows' ``x @ A[segment][:, first_r : first_r + R]`` over all
    of X, ``block_k`` columns of x a step."""
    size_x = x_ref.shape[1]
    block_m = tile.is_row.shape[0]
    ragged_k = size_x % block_k != 0  # static: the last step needs a mask

    def step(i, acc):  # acc f32[block_m, R]
        k0 = pl.multiple_of(i * block_k, block_k)
        ks = k0 + jnp.arange(block_k, dtype=jnp.int32)
        is_k = ks < size_x if ragged_k else None
        x = pltriton.load(
            x_ref.at[tile.rows, ks[None, :]],
            mask=_mask2(tile.is_row, is_k, (block_m, block_k)),
            other=0,
        )  # [block_m, block_k]: the tile's rows, gathered
        a_mask = _mask2(None, is_k, (size_r, block_k))
        a = pltriton.load(
            a_ref.at[tile.segment, pl.ds(first_r, size_r), pl.ds(k0, block_k)],
            mask=a_mask,
            other=None if a_mask is None else 0,
        )  # [R, block_k]
        return acc + pltriton.dot(x, a, trans_b=True, precision=precision)

    init = jnp.zeros((block_m, size_r), jnp.float32)
    return lax.fori_loop(0, pl.cdiv(size_x, block_k), step, init)


def unsupported_reason(x, a, bs) -> str | None:
    """Why this call cannot run on the kernel (shapes and dtypes only), or None."""
    if x.ndim != 2 or a.ndim != 3 or x.shape[1] != a.shape[2]:
        return f"shapes x {x.shape}, a {a.shape}: the kernel takes [T, X] and [M, R, X]"
    if not bs or a.shape[1] % len(bs):
        return f"a's rank axis ({a.shape[1]}) must split into {len(bs)} equal parts"
    rank = a.shape[1] // len(bs)
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
    x: jax.Array,  # [T, X]  in the tokens' order
    order: jax.Array,  # i32[T]  the tokens sorted by slot (``sort_tokens``)
    a: jax.Array,  # [M, R, X]
    tile_plan: jax.Array,  # i32[4, tiles]  ``plan_tiles`` of the slots' token counts
    tiles: LoraKernelConfig,  # resolved by ``plan``
    interpret: bool,
    x_scale: jax.Array | None = None,  # [X]  x's columns scaled as they are read
) -> jax.Array:  # f32[S, T, R]  the splits' partial sums, rows in sorted order
    assert tiles.block_m and tiles.block_k and tiles.num_splits
    block_r = max(16, _next_pow2(a.shape[1]))
    body = functools.partial(
        _shrink_kernel, tiles=tiles, block_r=block_r, precision=_precision(x.dtype)
    )
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((tiles.num_splits, x.shape[0], a.shape[1]), jnp.float32),
        grid=(tiles.num_splits, tile_plan.shape[1]),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="lora_shrink",
    )(tile_plan, order, x, a, *(() if x_scale is None else (x_scale,)))


def expand(
    xa: jax.Array,  # f32[S, T, n * R]  the shrink's partial sums, sorted
    order: jax.Array,  # i32[T]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    tile_plan: jax.Array,
    tiles: LoraKernelConfig,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n x [T, O_i] in the tokens' order, b's dtype
    """Every projection's term in one call: the grid's columns are the n outputs' column
    tiles one after another."""
    assert tiles.block_m
    body = functools.partial(
        _expand_kernel,
        block_m=tiles.block_m,
        block_r=max(16, _next_pow2(bs[0].shape[1])),
        precision=_precision(bs[0].dtype),
    )
    return _per_output_tile(body, (xa,), order, bs, tile_plan, tiles, interpret, "lora_expand")


def fused(
    x: jax.Array,  # [T, X]  in the tokens' order
    order: jax.Array,  # i32[T]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    tile_plan: jax.Array,
    tiles: LoraKernelConfig,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n x [T, O_i] in the tokens' order, x's dtype
    """The shrink and the expand in one launch (``use_fused``): each output column tile of
    each row tile reduces its rows' ``x @ A`` over all of X for its projection's R columns of
    A, then multiplies by its strip of B. At decode the rows are few, so the reduction each
    tile repeats reads only x's few rows and its projection's A (from L2 after the first)."""
    assert tiles.block_m and tiles.block_k
    body = functools.partial(
        _fused_kernel,
        block_m=tiles.block_m,
        block_k=tiles.block_k,
        precision=_precision(x.dtype),
    )
    return _per_output_tile(body, (x, a), order, bs, tile_plan, tiles, interpret, "lora_fused")


def output_tiles(tiles: LoraKernelConfig, bs: Sequence[jax.Array]) -> tuple[int, tuple[int, ...]]:
    """(the output's column tile, each projection's count of them): ``tiles.block_n``, else
    128 or the widest output's power of two, from 16."""
    block_n = tiles.block_n or min(128, max(16, _next_pow2(max(b.shape[2] for b in bs))))
    return block_n, tuple(pl.cdiv(b.shape[2], block_n) for b in bs)


def _per_output_tile(
    body, inputs: tuple[jax.Array, ...], order, bs, tile_plan, tiles, interpret: bool, name: str
) -> tuple[jax.Array, ...]:
    """``body`` over a grid of (every output's column tiles one after another, row tiles):
    ``body(plan_ref, order_ref, *inputs, *b_refs, *out_refs, col_tiles=, block_n=)``."""
    block_n, col_tiles = output_tiles(tiles, bs)
    num_tokens = order.shape[0]
    return tuple(
        pl.pallas_call(
            functools.partial(body, col_tiles=col_tiles, block_n=block_n),
            out_shape=tuple(jax.ShapeDtypeStruct((num_tokens, b.shape[2]), b.dtype) for b in bs),
            grid=(sum(col_tiles), tile_plan.shape[1]),
            compiler_params=pltriton.CompilerParams(
                num_warps=tiles.num_warps, num_stages=tiles.num_stages
            ),
            interpret=interpret,
            name=name,
        )(tile_plan, order, *inputs, *bs)
    )


def check_call(x, a, bs, token_slots, kernel: str) -> None:
    """A ValueError naming ``kernel`` where the call's shapes or dtypes do not fit it."""
    reason = unsupported_reason(x, a, bs)
    if reason is None and token_slots.shape != (x.shape[0],):
        reason = f"token_slots.shape={token_slots.shape} must be ({x.shape[0]},)"
    if reason is not None:
        raise ValueError(f"lora_deltas on {kernel}: {reason}")


def check_scale(x: jax.Array, x_scale: jax.Array | None, kernel: str) -> None:
    """A ValueError naming ``kernel`` unless ``x_scale`` is None or one of x's dtype per
    column."""
    if x_scale is not None and (x_scale.shape != x.shape[1:] or x_scale.dtype != x.dtype):
        raise ValueError(
            f"lora_deltas on {kernel}: x_scale {x_scale.dtype}{list(x_scale.shape)} must be "
            f"{x.dtype}[{x.shape[1]}] (one per column of x, its dtype)"
        )


def sorted_tiles(
    token_slots: jax.Array, num_slots: int, tiles: LoraKernelConfig
) -> tuple[jax.Array, jax.Array]:  # order i32[T], tile_plan i32[4, tiles]
    """The tokens sorted by slot (``sort_tokens``) and the row tiles of their segments."""
    assert tiles.block_m
    num_tokens = token_slots.shape[0]
    order, sizes = sort_tokens(token_slots, num_slots)
    tile_plan = plan_tiles(sizes, num_rows=num_tokens, block_m=tiles.block_m)
    assert tile_plan.shape[1] == num_tiles_for(num_tokens, num_slots, tiles.block_m)
    return order, tile_plan


# NOTE: behind one jit, so the calls of one shape (every layer's qkv, say) share one lowering.
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none
    x_scale: jax.Array | None = None,  # [X]  the input is x_scale * x (``reference``)
    *,
    config: LoraKernelConfig = LoraKernelConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # n x [T, O_i], x's dtype
    """The n LoRA terms of one input on the kernels; see the module docstring. ``x_scale``
    (a norm's weight, x its unscaled rows): the shrink scales x as it reads it, so the caller
    need not write the scaled rows (two launches; the fused form takes them scaled)."""
    check_call(x, a, bs, token_slots, "Pallas Triton")
    check_scale(x, x_scale, "Pallas Triton")
    num_tokens, size_x = x.shape
    one_launch = use_fused(config, a.shape[1] // len(bs))
    tiles = plan(num_tokens, a.shape[0], size_x, num_sms(), config, fused=one_launch)
    order, tile_plan = sorted_tiles(token_slots, a.shape[0], tiles)
    if one_launch:
        x = reference.scaled_input(x, x_scale)
        return fused(x, order, a, tuple(bs), tile_plan, tiles, interpret)
    xa = shrink(x, order, a, tile_plan, tiles, interpret, x_scale)  # f32[S, T, n * R], sorted
    return expand(xa, order, bs, tile_plan, tiles, interpret)
