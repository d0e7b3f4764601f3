"""A grouped matmul as a Pallas Triton kernel: a mixture of experts' experts on NVIDIA GPUs.

Same signature and semantics as ``reference.grouped_matmul``:
``lhs[R, K]`` sorted by group, ``rhs[G, K, N]``, ``group_sizes i32[G]`` (summing to at most R;
the rows past the sum come out zero), ``out[R, N]`` in ``lhs``'s dtype, accumulated in f32.

Work decomposition (megablox's). The rows are cut into blocks of ``block_m``; a group's rows
span one or more consecutive blocks, and a block holding the end of one group and the start of
the next is visited once for each. A tile is one (group, row block) pair: it loops over K,
loading its rows of ``lhs`` and its group's ``[block_k, block_n]`` weight tile, and stores only
its group's rows (masked). The rows past the groups' sum form one more segment whose tiles store
zeros without reading a weight. S contiguous segments span at most ``cdiv(R, block_m) + S - 1``
blocks, so the grid is fixed at ``cdiv(N, block_n)`` column tiles x ``cdiv(R, block_m) + G``
row tiles, whatever the routing; the tile -> (segment, block) plan is computed on the device from
``group_sizes`` (``plan_tiles``, plain jnp: no host sync, no recompile), and the tiles past
the plan's end return at once.

Each (group touched, row tile) reads its group's weights once: at decode, a handful of rows
per expert, that is each touched expert's weights once, the bytes floor of the step.

Quantized weights (weight-only): ``rhs`` in fp8 e4m3 or int8 with ``scale f32[G, N]``, one
per (group, output column). Each weight tile crosses the memory bus at one byte per value and
is converted to ``lhs``'s dtype in registers before the dot; the f32 sums of a tile are
multiplied by its group's scales of those columns before the store.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Quantized weights, read with a scale per (group, output column).
BYTE_DTYPES = (jnp.float8_e4m3fn, jnp.int8)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static tile sizes; ``None`` picks from the shapes (``default_config``)."""

    block_m: int | None = None  # rows a tile: 16 at decode, up to 128 for prefill
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self.num_warps=} must be 1, 2, 4, 8 or 16")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")


def has_large_shared_memory() -> bool:
    """Whether the GPU gives a program 160 KiB or more of shared memory (A100, H100/H200,
    B200; compute capability 8.0, 9.x, 10.x) rather than the ~100 KiB of an A10, L4 or
    L40S (8.6, 8.9). Off the GPU (interpret mode, lowering tests): True."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return True
    capability = str(getattr(device, "compute_capability", ""))
    return capability not in ("8.6", "8.7", "8.9")


def default_config(
    num_rows: int, num_groups: int, large_shared_memory: bool = True
) -> GroupedMatmulConfig:
    """Tiles for the mean rows per group, a static figure (R and G are shapes): 16-row tiles
    for decode (a few rows per expert: the weights stream, the rows do not matter), up to
    128-row tiles for prefill (many rows per expert: each weight tile feeds more rows).
    A 128 x 128 tile pipelines 3 K steps (96 KiB of shared memory) where the GPU has room,
    else 2. The thresholds follow the H200 sweep of Qwen3-30B-A3B's layer
    (benchmarks/RESULTS.md): at one row per group (batch 1) 16 x 128 x 64 tiles took 54 us
    against 61 us for 16 x 64 x 128; at 16 rows per group (batch 256) 64-row tiles took 358 us
    against 410 us for 16-row ones."""
    rows_per_group = num_rows / max(1, num_groups)
    if rows_per_group <= 1:
        return GroupedMatmulConfig(16, 128, 64, num_warps=4, num_stages=4)
    if rows_per_group <= 8:
        return GroupedMatmulConfig(16, 64, 128, num_warps=4, num_stages=4)
    if rows_per_group <= 128:
        return GroupedMatmulConfig(64, 128, 64, num_warps=4, num_stages=3)
    stages = 3 if large_shared_memory else 2
    return GroupedMatmulConfig(128, 128, 64, num_warps=8, num_stages=stages)


def _resolve(config: GroupedMatmulConfig, num_rows: int, num_groups: int) -> GroupedMatmulConfig:
    default = default_config(num_rows, num_groups, has_large_shared_memory())
    return GroupedMatmulConfig(
        **{
            f.name: getattr(config, f.name)
            if getattr(config, f.name) is not None
            else getattr(default, f.name)
            for f in dataclasses.fields(config)
        }
    )


def num_tiles_for(num_rows: int, num_groups: int, block_m: int) -> int:
    """Row tiles of the grid: G groups and the zero segment, S = G + 1 segments."""
    return pl.cdiv(num_rows, block_m) + num_groups


def plan_tiles(
    group_sizes: jax.Array,  # i32[G]
    *,
    num_rows: int,
    block_m: int,
) -> jax.Array:  # i32[4, num_tiles]: segment (G: the zero rows), first row, row lo, row hi
    """Each row tile's segment (a group, or G for the zero rows past the groups' sum), the
    first row of its block, and the rows [lo, hi) of the segment in that block; past the
    plan's end a tile has lo == hi (no work)."""
    num_groups = group_sizes.shape[0]
    num_tiles = num_tiles_for(num_rows, num_groups, block_m)
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)  # i32[G]
    ends = jnp.append(ends, num_rows)  # i32[G + 1]; the last segment: the zero rows
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])  # i32[G + 1]
    first_block = starts // block_m
    num_blocks = jnp.where(ends > starts, (ends - 1) // block_m - first_block + 1, 0)
    tile_ends = jnp.cumsum(num_blocks)  # i32[G + 1]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    # The segment of each tile: how many segments end at or before it (compare-all, no loop:
    # a few hundred tiles x G + 1 segments).
    segment = (tile_ends[None, :] <= tile[:, None]).sum(1, dtype=jnp.int32)  # [0, G + 1]
    is_planned = segment <= num_groups
    seg = jnp.minimum(segment, num_groups)
    block = first_block[seg] + tile - (tile_ends[seg] - num_blocks[seg])
    first_row = jnp.where(is_planned, block * block_m, 0)
    lo = jnp.where(is_planned, jnp.maximum(starts[seg], first_row), 0)
    hi = jnp.where(is_planned, jnp.minimum(ends[seg], first_row + block_m), 0)
    return jnp.stack([seg, first_row, lo, hi]).astype(jnp.int32)


def _grouped_matmul_kernel(
    plan_ref,  # i32[4, num_tiles]: segment, first row, row lo, row hi
    lhs_ref,  # [R, K]
    rhs_ref,  # [G, K, N]  lhs's dtype, or fp8 / int8 with scale_ref
    *refs,  # (scale_ref f32[G, N],) out_ref [R, N]
    block_m: int,
    block_n: int,
    block_k: int,
    precision: lax.Precision | None,
):
    scale_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
    col, tile = pl.program_id(0), pl.program_id(1)
    num_groups, size_k, size_n = rhs_ref.shape
    segment = plan_ref[0, tile]
    first_row = plan_ref[1, tile]
    lo = plan_ref[2, tile]
    hi = plan_ref[3, tile]

    @pl.when(hi > lo)
    def _():
        rows = first_row + jnp.arange(block_m, dtype=jnp.int32)  # i32[bm]
        is_row = (rows >= lo) & (rows < hi)
        cols = col * block_n + jnp.arange(block_n, dtype=jnp.int32)  # i32[bn]
        is_col = cols < size_n if size_n % block_n else None  # static: no mask when it divides
        group = jnp.minimum(segment, num_groups - 1)

        def step(kb, acc):  # acc f32[bm, bn]
            k0 = pl.multiple_of(kb * block_k, block_k)
            ks = k0 + jnp.arange(block_k, dtype=jnp.int32)
            is_k = ks < size_k if size_k % block_k else None
            a_mask = is_row[:, None] if is_k is None else is_row[:, None] & is_k[None, :]
            a = pltriton.load(
                lhs_ref.at[pl.ds(first_row, block_m), pl.ds(k0, block_k)], mask=a_mask, other=0
            )  # [bm, bk]
            b_mask = None
            if is_k is not None or is_col is not None:
                b_mask = jnp.ones((block_k, block_n), jnp.bool_)
                b_mask = b_mask if is_k is None else b_mask & is_k[:, None]
                b_mask = b_mask if is_col is None else b_mask & is_col[None, :]
            zero = 0 if jnp.issubdtype(rhs_ref.dtype, jnp.integer) else 0.0  # (no fp8 cast)
            b = pltriton.load(
                rhs_ref.at[group, pl.ds(k0, block_k), pl.ds(col * block_n, block_n)],
                mask=b_mask,
                other=None if b_mask is None else zero,
            )  # [bk, bn]
            # NOTE: fp8 / int8 weights are converted here, in registers: the weight crosses
            # the memory bus at one byte per value (a no-op for weights in lhs's dtype).
            b = b.astype(a.dtype)
            return acc + pltriton.dot(a, b, precision=precision)

        # The zero segment (past the groups' sum) runs no step and stores zeros.
        mask = is_row[:, None] if is_col is None else is_row[:, None] & is_col[None, :]
        out_tile = out_ref.at[pl.ds(first_row, block_m), pl.ds(col * block_n, block_n)]

        # NOTE: a static trip count, and the zero segment (rows past the groups' sum) in a
        # branch of its own that reads no weight: the Triton lowering refused a loop whose
        # bound was a traced value next to a constant (scf.for's bounds differed in type).
        @pl.when(segment < num_groups)
        def _():
            zeros = jnp.zeros((block_m, block_n), jnp.float32)
            acc = lax.fori_loop(0, pl.cdiv(size_k, block_k), step, zeros)
            if scale_ref is not None:  # this group's scales of these columns
                scale = pltriton.load(
                    scale_ref.at[group, pl.ds(col * block_n, block_n)],
                    mask=is_col,
                    other=None if is_col is None else 0.0,
                )  # f32[bn]
                acc = acc * scale[None, :]
            pltriton.store(out_tile, acc.astype(out_ref.dtype), mask=mask)

        @pl.when(segment >= num_groups)
        def _():
            pltriton.store(out_tile, jnp.zeros((block_m, block_n), out_ref.dtype), mask=mask)


def unsupported_reason(lhs, rhs, scale=None) -> str | None:
    """Why this call cannot run on the kernel (the caller takes jax.lax.ragged_dot)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        return f"shapes {lhs.shape} x {rhs.shape}: the kernel takes [R, K] x [G, K, N]"
    if scale is not None:
        if lhs.dtype not in DTYPES or rhs.dtype not in BYTE_DTYPES:
            return (
                f"dtypes {lhs.dtype}/{rhs.dtype}: with a scale the kernel takes bfloat16, "
                "float16 or float32 rows and fp8 e4m3 or int8 weights"
            )
        expected = (rhs.shape[0], rhs.shape[2])
        if scale.shape != expected or scale.dtype != jnp.float32:
            return f"scale {scale.dtype}{list(scale.shape)} must be float32{list(expected)}"
        return None
    if lhs.dtype not in DTYPES or rhs.dtype != lhs.dtype:
        return (
            f"dtypes {lhs.dtype}/{rhs.dtype}: the kernel takes bfloat16, float16 or float32, "
            "both alike"
        )
    return None


def grouped_matmul(
    lhs: jax.Array,  # [R, K]  sorted by group
    rhs: jax.Array,  # [G, K, N]  lhs's dtype, or fp8 e4m3 / int8 with a scale
    group_sizes: jax.Array,  # i32[G]  rows of each group, in order; may sum to less than R
    scale: jax.Array | None = None,  # f32[G, N]  per (group, output column) of a quantized rhs
    *,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret: bool = False,
) -> jax.Array:  # [R, N], lhs's dtype; rows past the groups' sum are zeros
    """Pallas Triton grouped matmul; see the module docstring for the work layout."""
    reason = unsupported_reason(lhs, rhs, scale)
    if reason is not None:
        raise ValueError(f"grouped_matmul on Pallas Triton: {reason}")
    num_rows, _ = lhs.shape
    num_groups, _, size_n = rhs.shape
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes.shape={group_sizes.shape} must be ({num_groups},)")
    config = _resolve(config, num_rows, num_groups)
    assert config.block_m and config.block_n and config.block_k
    plan = plan_tiles(group_sizes, num_rows=num_rows, block_m=config.block_m)
    body = functools.partial(
        _grouped_matmul_kernel,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        # NOTE: f32 inputs (the CPU's default dtype) keep full precision, not TF32.
        precision=lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None,
    )
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((num_rows, size_n), lhs.dtype),
        # NOTE: columns vary fastest: the programs in flight together share row tiles (their
        # lhs rows stay in L2 across the columns) and a group's tiles (its weight strips too).
        grid=(pl.cdiv(size_n, config.block_n), plan.shape[1]),
        compiler_params=pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="grouped_matmul_triton",
    )(plan, lhs, rhs, *(() if scale is None else (scale,)))
