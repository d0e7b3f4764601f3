"""The LoRA product in one launch with X split across programs (``LoraKernelConfig.split_k``):
a third form beside ``triton.py``'s two launches and its fused one, for decode steps.

At one token the two launches cost about 11.6 us a projection group on an H100, where the
group's bytes take 0.2 us, and the fused launch was slower still: each of its output tiles
walks all of X alone (down: 14,336 in-features, 56 dependent steps). Here the grid is (splits
of X, every output's column tiles, row tiles): a program reduces its rows' ``x @ A`` over its
split of X only, for its projection's R columns of A, multiplies that partial sum by its strip
of B and adds the product into a float32 output with atomic adds, as vLLM's split-K
``lora_shrink`` does. Every program walks a few steps of X, so the group's latency is a few
dependent loads rather than X's length; A is read once per column tile (from L2 after the
first). The output is zeroed by XLA first, and rounded to x's dtype after.

Unlike the other forms, each split's partial ``x @ A`` is rounded to B's dtype (the others
round the whole sum), and the atomic adds make the float32 sum's order, and so its last bits,
vary from run to run. The base model's tokens add nothing.

Measured: not yet (issue 39's next ``lora_kernel`` call times it beside the other forms).
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

from pallas_kernels.lora import reference
from pallas_kernels.lora import triton as lt

PROGRAMS_PER_SM = 16  # the splits of X grow until the grid holds about this many per SM


def num_splits(
    num_tokens: int, num_slots: int, size_x: int, col_tiles: int, sms: int, config
) -> int:
    """``config.num_splits``, else the largest power of two (at most ``lt.MAX_SPLITS`` and X's
    ``block_k`` steps) that keeps the programs that may work (row tiles holding rows x every
    column tile x splits) within ``PROGRAMS_PER_SM`` per SM."""
    if config.num_splits is not None:
        return config.num_splits
    busy = pl.cdiv(num_tokens, config.block_m) + min(num_slots, num_tokens)
    k_blocks = pl.cdiv(size_x, config.block_k)
    splits = 1
    while (
        splits * 2 <= min(k_blocks, lt.MAX_SPLITS)
        and busy * col_tiles * splits * 2 <= PROGRAMS_PER_SM * sms
    ):
        splits *= 2
    return splits


def split_k(
    x: jax.Array,  # [T, X]  in the tokens' order
    order: jax.Array,  # i32[T]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    tile_plan: jax.Array,
    tiles,  # LoraKernelConfig, resolved by ``lt.plan``
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n x [T, O_i] in the tokens' order, x's dtype
    """Every projection's term in one launch over (splits of X, every output's column tiles,
    row tiles); the float32 sums rounded to x's dtype after."""
    assert tiles.block_m and tiles.block_k
    num_tokens, size_x = x.shape
    block_n, col_tiles = lt.output_tiles(tiles, bs)
    splits = num_splits(num_tokens, a.shape[0], size_x, sum(col_tiles), lt.num_sms(), tiles)
    # One row past the tokens takes the masked rows' (zero) adds in interpret mode, which has
    # no masked atomics; the columns are padded to whole tiles. Both are cut off after.
    zeros = [jnp.zeros((num_tokens + 1, n * block_n), jnp.float32) for n in col_tiles]
    body = functools.partial(
        _split_k_kernel,
        col_tiles=col_tiles,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=tiles.block_k,
        steps=pl.cdiv(pl.cdiv(size_x, tiles.block_k), splits),
        masked_atomics=not interpret,
        precision=lt._precision(x.dtype),
    )
    first_zero = 4 + len(bs)  # after tile_plan, order, x, a and the b's
    outs = pl.pallas_call(
        body,
        out_shape=tuple(jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros),
        grid=(splits, sum(col_tiles), tile_plan.shape[1]),
        input_output_aliases={first_zero + i: i for i in range(len(bs))},
        compiler_params=pltriton.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="lora_split_k",
    )(tile_plan, order, x, a, *bs, *zeros)
    return tuple(
        out[:num_tokens, : b.shape[2]].astype(x.dtype) for out, b in zip(outs, bs, strict=True)
    )


def _split_k_kernel(
    plan_ref,
    order_ref,
    x_ref,
    a_ref,
    *refs,
    col_tiles,
    block_m,
    block_n,
    block_k,
    steps,
    masked_atomics,
    precision,
):
    # plan_ref i32[4, tiles]; order_ref i32[T]; x_ref [T, X], a_ref [M, n * R, X]; refs: n
    # b_ref [M, R, O_i], n zeroed inputs (aliased to the outputs), n out_ref f32[T + 1, O_pad]
    num_parts = len(col_tiles)
    b_refs, out_refs = refs[:num_parts], refs[2 * num_parts :]
    split = pl.program_id(0)
    tile, parts = lt._output_tile(
        plan_ref,
        order_ref,
        (*b_refs, *out_refs),
        col_tiles,
        block_m,
        col=pl.program_id(1),
        tile=pl.program_id(2),
    )
    for part in parts:
        num_slots, size_r = part.b_ref.shape[:2]
        size_o = part.b_ref.shape[2]

        @pl.when(part.here & (tile.segment < num_slots))
        def _(part=part, size_r=size_r, size_o=size_o):
            xa = _split_xa(
                x_ref, a_ref, tile, part.number * size_r, size_r, split, steps, block_k, precision
            )
            cols = part.col * block_n + jnp.arange(block_n, dtype=jnp.int32)
            is_col = cols < size_o if size_o % block_n else None
            y = lt._times_b_strip(xa, part, tile.segment, block_n, None, is_col, precision)
            index = (tile.rows, cols[None, :])
            if masked_atomics:
                mask = jnp.broadcast_to(tile.is_row[:, None], (block_m, block_n))
                pltriton.atomic_add(part.out_ref, index, y, mask=mask)
            else:  # interpret mode: the masked rows point one past the tokens, and add zeros
                pltriton.atomic_add(part.out_ref, index, jnp.where(tile.is_row[:, None], y, 0))


def _split_xa(
    x_ref, a_ref, tile, first_r: int, size_r: int, split, steps: int, block_k: int, precision
):
    """f32[block_m, R]: the tile's rows' ``x @ A[segment][:, first_r : first_r + R]`` over
    this program's split of X (``steps`` of ``block_k`` columns; past X: masked, zeros)."""
    size_x = x_ref.shape[1]
    block_m = tile.is_row.shape[0]

    def step(i, acc):  # acc f32[block_m, R]
        k0 = pl.multiple_of((split * steps + i) * block_k, block_k)
        ks = k0 + jnp.arange(block_k, dtype=jnp.int32)
        is_k = ks < size_x
        x = pltriton.load(
            x_ref.at[tile.rows, ks[None, :]],
            mask=lt._mask2(tile.is_row, is_k, (block_m, block_k)),
            other=0,
        )  # [block_m, block_k]: the tile's rows, gathered
        a = pltriton.load(
            a_ref.at[tile.segment, pl.ds(first_r, size_r), pl.ds(k0, block_k)],
            mask=lt._mask2(None, is_k, (size_r, block_k)),
            other=0,
        )  # [R, block_k]
        return acc + pltriton.dot(x, a, trans_b=True, precision=precision)

    return lax.fori_loop(0, steps, step, jnp.zeros((block_m, size_r), jnp.float32))


# NOTE: behind one jit, as ``triton.lora_deltas``: the calls of one shape share one lowering.
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none
    x_scale: jax.Array | None = None,  # [X]  the input is x_scale * x, scaled first
    *,
    config: lt.LoraKernelConfig = lt.LoraKernelConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # n x [T, O_i], x's dtype
    """``triton.lora_deltas``'s semantics in this one launch (see the module docstring); the
    rank must be a power of two from 16, as the fused form's."""
    lt.check_call(x, a, bs, token_slots, "the split-K kernel")
    lt.check_scale(x, x_scale, "the split-K kernel")
    x = reference.scaled_input(x, x_scale)
    rank = a.shape[1] // len(bs)
    if not lt.one_launch_rank(rank):
        raise ValueError(f"lora_deltas, split-K: rank {rank}: it takes powers of two from 16")
    num_tokens, size_x = x.shape
    tiles = lt.plan(num_tokens, a.shape[0], size_x, lt.num_sms(), config)
    tiles = dataclasses.replace(tiles, num_splits=config.num_splits)  # (split_k picks its own)
    order, tile_plan = lt.sorted_tiles(token_slots, a.shape[0], tiles)
    return split_k(x, order, a, tuple(bs), tile_plan, tiles, interpret)
