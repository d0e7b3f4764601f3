"""Ragged paged attention as a Pallas Triton kernel: the tier for GPUs without Mosaic GPU.

Same signature and semantics as ``reference.ragged_paged_attention``. Mosaic GPU
needs Hopper (compute capability 9.0); on an A100, L4 or L40S this kernel runs instead of the
jnp reference, through Pallas' Triton lowering (deprecated in jax 0.11 but shipped, and the
only Pallas path that compiles for those GPUs). Setting ``JAXSERVE_ATTENTION=triton`` forces it
on Hopper too, to measure it there (``dispatch.choose_kernel``).

Work decomposition. The tile plan is the Mosaic kernel's (``mosaic_gpu.plan_tiles``): a tile is
up to ``block_q`` consecutive query tokens of one sequence. One program handles one tile for one KV
head (and one KV split): its ``rows = block_q x Gp`` query rows (token-major, ``Gp`` = the GQA
group rounded up to a power of two) are gathered straight from ``q`` with masked loads, then
it walks the sequence's KV ``block_kv`` tokens a step, gathering each step's rows from the
paged cache through the page table, with an online (flash) softmax in registers. Triton wants
power-of-two tensor sizes, so head_dim is padded in registers (masked loads and stores, never
in memory): 80 and 96 run as 128, and ``Gp`` rows per token cover a group of 3, 5 or 7.

Small batches split the KV range ``num_splits`` ways; each split writes its partial output and
log-sum-exp, and ``splits.merge_splits`` combines them in XLA.

An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2`` pages with per-tensor ``k_scale`` /
``v_scale``: Ada's GPUs, where Mosaic GPU does not run, and head sizes the Mosaic kernel's fp8
path does not take) is read as stored (half the bytes), each K and V tile converted to the
queries' dtype in registers (exact: every fp8 value is a bf16 value), and the scales applied
to the float32 results as the Mosaic kernel applies them: ``k_scale`` with the softmax scale,
``v_scale`` with 1 / row-sum.

Attention sinks (GPT-OSS, ``sinks[Hq]``): an unsplit launch takes them as one more operand and
starts each row's online softmax from its head's sink, a running max of the sink and a sum of
one (its mass), with nothing in the accumulator; a split launch leaves them to the merge, which
counts each once. Without sinks the launch is the same as before: no operand, no extra work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_cache import FP8_DTYPES
from pallas_kernels.ragged_paged_attention.mosaic_gpu import (
    launch_plan,
    max_tiles_for,
    scales_operand,
)
from pallas_kernels.ragged_paged_attention.splits import (
    MASK_VALUE,
    merge_splits,
    planned_rows,
    split_range,
)

LOG2E = math.log2(math.e)
DTYPES = (jnp.bfloat16, jnp.float16)
MAX_GROUP = 16  # query heads per KV head
DEFAULT_NUM_SMS = 108  # A100, when the device does not say


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Static tuning knobs; ``None`` picks a value from the shapes."""

    block_kv: int | None = None  # KV tokens a step: see default_block_kv
    num_splits: int | None = None
    num_warps: int | None = None  # 4 for 16-row (decode) tiles, else 8
    num_stages: int = 2
    # Query rows per program (block_q tokens x the padded group): None picks 16 for steps of
    # no more tokens than sequences, else 64; fixed, every step reduces each row alike.
    block_rows: int | None = None

    def __post_init__(self):
        value = self.block_kv
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"block_kv={value} must be a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self.num_warps=} must be 1, 2, 4, 8 or 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")
        rows = self.block_rows
        if rows is not None and (rows < 16 or rows & (rows - 1)):
            raise ValueError(f"block_rows={rows} must be a power of two >= 16")


def unsupported_reason(q, k_pages) -> str | None:
    """Why this call cannot run on the kernel (the caller falls back to the reference); sliding
    windows and soft caps are handled in the kernel, so only shapes and dtypes count."""
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, _ = k_pages.shape
    if q.dtype not in DTYPES or k_pages.dtype not in (q.dtype, *FP8_DTYPES):
        return (
            f"dtypes {q.dtype}/{k_pages.dtype}: the kernel takes bfloat16 or float16 queries "
            "and a cache in their dtype or fp8 (e4m3, e5m2)"
        )
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"{head_dim=}: the kernel takes multiples of 16 up to 256"
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= MAX_GROUP:
        return f"{num_q_heads=}, {num_kv_heads=}: GQA ratio must be an integer in [1, {MAX_GROUP}]"
    return None


def num_sms() -> int:
    """Streaming multiprocessors of the first device (A100 108, L4 58, L40S 142, H200 132)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_NUM_SMS)


def default_block_kv(head_dim: int) -> int:
    """KV tokens a step: 64; at head_dim > 128, 32 before Hopper, whose shared memory (up to
    164 KB, 100 KB on an L4) may not hold two stages of 64 x 256 K and V tiles (128 KB).
    Measured on the H200 at head_dim 256 (benchmarks/RESULTS.md): 64 reads the KV 1.3x faster
    at batch 64 (99% of the floor at 4,096 context against 75%), the same at batch 1."""
    if head_dim <= 128:
        return 64
    major = str(getattr(jax.devices()[0], "compute_capability", "")).split(".")[0]
    return 64 if major.isdigit() and int(major) >= 9 else 32


def default_num_splits(
    programs: int, max_kv: int, block_kv: int, sms: int, programs_per_sm: int = 2
) -> int:
    """Split the KV length while the split programs fit one wave of ``programs_per_sm``
    programs on each SM (the default, 2: two waves of one program an SM)."""
    splits = 1
    while programs * splits * 2 <= programs_per_sm * sms and max_kv >= 4 * splits * block_kv:
        splits *= 2
    return splits


def _attention_kernel(
    plan_ref,  # i32[6, max_tiles]: seq, first token, tokens, first position, kv_len, splits
    pages_ref,  # i32[S, pages_per_seq]
    q_ref,  # [T, Hq, D]
    k_ref,  # [P, page_size, Hkv, D]
    v_ref,
    scales_ref,  # f32[2] or None: an fp8 cache's k_scale, v_scale
    sinks_ref,  # f32[Hq] or None: the sink logits (an unsplit launch only)
    o_ref,  # [T, Hq, Dp] (q dtype), or f32[num_splits, T, Hq, Dp]
    lse_ref,  # f32[num_splits, T, Hq] or None
    *,
    rows: int,
    group: int,
    block_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    tile, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens, _, head_dim = q_ref.shape
    num_pages, page_size, _, _ = k_ref.shape
    pages_per_seq = pages_ref.shape[1]
    padded_group = _next_pow2(group)
    padded_dim = max(16, _next_pow2(head_dim))

    k_scale = 1.0 if scales_ref is None else scales_ref[0]
    v_scale = 1.0 if scales_ref is None else scales_ref[1]
    seq = plan_ref[0, tile]
    t0 = plan_ref[1, tile]
    size = plan_ref[2, tile]
    pos0 = plan_ref[3, tile]
    kv_len = plan_ref[4, tile]
    live_splits = plan_ref[5, tile]  # of the launch's num_splits, the ones this tile takes

    r = jnp.arange(rows, dtype=jnp.int32)  # i32[rows]  row = token * Gp + g
    row_token = r // padded_group
    row_g = r % padded_group
    # A split past the tile's live ones loads and stores nothing: the merge ignores its part.
    is_row = (row_token < size) & (row_g < group) & (split < live_splits)  # bool[rows]
    token = jnp.minimum(t0 + row_token, num_tokens - 1)  # i32[rows]
    q_head = head * group + jnp.minimum(row_g, group - 1)  # i32[rows]
    row_pos = pos0 + row_token  # i32[rows]
    d = jnp.arange(padded_dim, dtype=jnp.int32)  # i32[Dp]
    is_col = d < head_dim if padded_dim != head_dim else None  # bool[Dp]

    def with_cols(mask):  # [n] row mask -> [n, Dp] element mask
        mask = mask[:, None]
        return mask if is_col is None else mask & is_col[None, :]

    q = pltriton.load(
        q_ref.at[token[:, None], q_head[:, None], d[None, :]],
        mask=with_cols(is_row),
        other=0.0,
    )  # [rows, Dp]

    pos_last = pos0 + size - 1
    kv_hi = jnp.clip(pos_last + 1, 0, kv_len)
    kb_lo = jnp.int32(0)
    if sliding_window is not None:
        kb_lo = jnp.clip(pos0 - sliding_window + 1, 0, kv_hi) // block_kv
    num_blocks = jnp.where(size > 0, (kv_hi + block_kv - 1) // block_kv - kb_lo, 0)
    s_lo, s_hi = split_range(kb_lo, num_blocks, split, live_splits)

    def step(block, carry):
        acc, m_i, l_i = carry
        kv_pos = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[block_kv]
        is_kv = kv_pos < kv_hi
        slot = jnp.minimum(kv_pos // page_size, pages_per_seq - 1)
        page = pltriton.load(pages_ref.at[seq, slot], mask=is_kv, other=0)
        page = jnp.clip(page, 0, num_pages - 1)[:, None]  # i32[block_kv, 1]
        offset = (kv_pos % page_size)[:, None]
        kv_mask = with_cols(is_kv)
        k = pltriton.load(k_ref.at[page, offset, head, d[None, :]], mask=kv_mask, other=0.0)
        s = pltriton.dot(q, k.astype(q.dtype), trans_b=True)  # f32[rows, block_kv]
        if soft_cap is not None:
            s = jnp.tanh(s * (k_scale * sm_scale / soft_cap)) * (soft_cap * LOG2E)
        else:
            s = s * (k_scale * sm_scale * LOG2E)
        mask = (kv_pos[None, :] <= row_pos[:, None]) & is_kv[None, :]
        if sliding_window is not None:
            mask = mask & (kv_pos[None, :] > row_pos[:, None] - sliding_window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        v = pltriton.load(v_ref.at[page, offset, head, d[None, :]], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(q.dtype), v.astype(q.dtype))
        return acc, m_new, l_i

    acc_0 = jnp.zeros((rows, padded_dim), jnp.float32)
    if sinks_ref is None:
        m_0 = jnp.full((rows,), MASK_VALUE, jnp.float32)
        l_0 = jnp.zeros((rows,), jnp.float32)
    else:  # the sink as a first column with no value: max = sink, sum = its mass, 1
        m_0 = pltriton.load(sinks_ref.at[q_head]) * LOG2E  # f32[rows]
        l_0 = jnp.ones((rows,), jnp.float32)
    carry = (acc_0, m_0, l_0)
    acc, m_i, l_i = lax.fori_loop(s_lo, s_hi, step, carry)

    is_empty = l_i == 0.0
    out = acc * (v_scale / jnp.where(is_empty, 1.0, l_i))[:, None]
    # NOTE: the output is padded to Dp (sliced in XLA), and a masked row stores to token T,
    # past the end: no masked lane aliases a live element. The GPU never touches masked lanes;
    # interpret mode writes every lane of a masked store back, so an alias could clobber one.
    out_token = jnp.where(is_row, token, num_tokens)[:, None]  # i32[rows, 1]
    if lse_ref is None:
        o_view = o_ref.at[out_token, q_head[:, None], d[None, :]]
    else:
        o_view = o_ref.at[split, out_token, q_head[:, None], d[None, :]]
        lse = jnp.where(is_empty, MASK_VALUE, m_i + jnp.log2(jnp.where(is_empty, 1.0, l_i)))
        pltriton.store(lse_ref.at[split, out_token[:, 0], q_head], lse, mask=is_row)
    pltriton.store(o_view, out.astype(o_ref.dtype), mask=is_row[:, None])


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | float | None = None,  # f32[]: an fp8 cache holds k / k_scale
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # [Hq]  a logit per query head in each row's denominator
    config: TritonConfig = TritonConfig(),
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Pallas Triton ragged paged attention; see the module docstring for the work layout."""
    _check_call(q, k_pages, sliding_window, sinks)
    launch = _launch_for(q, k_pages, page_indices, config)
    is_split = launch.num_splits > 1
    planned = config.num_splits is None
    plan = launch_plan(cu_q_lens, kv_lens, num_seqs, q.shape[0], launch, num_sms(), planned=planned)
    body = functools.partial(
        _attention_kernel,
        rows=launch.rows,
        group=launch.group,
        block_kv=launch.block_kv,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    kernel_sinks = () if sinks is None or is_split else (sinks.astype(jnp.float32),)
    scales = _scales(k_scale, v_scale)
    outs = pl.pallas_call(
        _bind_refs(body, has_scales=bool(scales), has_sinks=bool(kernel_sinks), has_lse=is_split),
        out_shape=_out_shape(q, launch.num_splits),
        grid=(launch.max_tiles, k_pages.shape[2], launch.num_splits),
        compiler_params=pltriton.CompilerParams(
            num_warps=launch.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(plan, page_indices.astype(jnp.int32), q, k_pages, v_pages, *scales, *kernel_sinks)
    if is_split:
        out = merge_splits(
            outs[0],
            outs[1][..., None],
            cu_q_lens,
            num_seqs,
            out_dtype=q.dtype,
            sinks=sinks,
            live_splits=plan[5, 0],
        )
    else:
        out = outs[0]
    return out[..., : q.shape[-1]]


def _scales(k_scale, v_scale) -> tuple[jax.Array, ...]:
    """The Mosaic kernel's scales operand (``mosaic_gpu.scales_operand``), or () without
    scales: a bf16 cache's launch as before."""
    if k_scale is None and v_scale is None:
        return ()
    return (scales_operand(k_scale, v_scale, None),)


def _check_call(q, k_pages, sliding_window, sinks) -> None:
    """Raise ValueError for a call the kernel does not take."""
    reason = unsupported_reason(q, k_pages)
    if reason is not None:
        raise ValueError(f"ragged_paged_attention on Pallas Triton: {reason}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1")
    num_q_heads = q.shape[1]
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"{sinks.shape=} must be ({num_q_heads},): one logit per query head")


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    group: int  # query heads per KV head
    rows: int  # query rows per program: block_q tokens x the group rounded up to a power of two
    block_q: int  # query tokens per tile
    block_kv: int  # KV tokens a step
    num_warps: int
    max_tiles: int  # the grid's tile axis: every tile the plan may hold
    num_splits: int  # of each tile's KV range
    num_kv_heads: int


def _launch_for(q, k_pages, page_indices, config: TritonConfig) -> _Launch:
    """Tiles, warps, KV splits and grid for this call (``config``'s, where it gives them)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    padded_group = _next_pow2(group)
    # NOTE: a batch with no more tokens than sequences is (nearly) all decodes: 16 rows (the
    # smallest tl.dot) waste the least; prefill chunks get 64 rows, to reuse each KV step more.
    rows = max(config.block_rows or (16 if num_tokens <= num_slots else 64), padded_group)
    block_q = rows // padded_group
    block_kv = config.block_kv or default_block_kv(head_dim)
    # NOTE: ptxas (Triton 3.9, sm_80) fits a 16-row tile in 116-123 registers with 4 warps at
    # head_dim 128-256; a 64-row tile needs 8 warps (4 spill at head_dim 80 and 128).
    num_warps = config.num_warps or (4 if rows <= 16 else 8)
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    num_splits = config.num_splits or default_num_splits(
        planned_rows(max_tiles) * num_kv_heads, pages_per_seq * page_size, block_kv, num_sms()
    )
    return _Launch(group, rows, block_q, block_kv, num_warps, max_tiles, num_splits, num_kv_heads)


def _out_shape(q: jax.Array, num_splits: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``(o,)`` in q's dtype; or, when the KV is split, ``(o, lse)`` per split in float32; o's
    head_dim padded to a power of two (sliced after)."""
    num_tokens, num_q_heads, head_dim = q.shape
    o_shape = (num_tokens, num_q_heads, max(16, _next_pow2(head_dim)))  # head_dim padded
    if num_splits == 1:
        return (jax.ShapeDtypeStruct(o_shape, q.dtype),)
    return (
        jax.ShapeDtypeStruct((num_splits, *o_shape), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads), jnp.float32),
    )


def _bind_refs(body, *, has_scales: bool, has_sinks: bool, has_lse: bool):
    """Adapt the kernel body to the launch's operands: the scales, the sinks and the lse
    output are there only when used."""

    def wrapped(plan, pages, q, k, v, *rest):
        rest = list(rest)
        scales = rest.pop(0) if has_scales else None
        sinks = rest.pop(0) if has_sinks else None
        o, *lse = rest
        return body(plan, pages, q, k, v, scales, sinks, o, lse[0] if has_lse else None)

    return wrapped
