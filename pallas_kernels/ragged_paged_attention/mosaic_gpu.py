"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper and newer).

Same signature and semantics as ``reference.ragged_paged_attention``. The caller (the model,
through ``dispatch.ragged_paged_attention``) passes one flattened ragged batch
in which prefill chunks and decode tokens sit side by side; this module plans the work in plain
XLA, runs one kernel launch over it and, when the KV length is split, merges the partial results.

Work decomposition. A *tile* is up to ``block_q`` consecutive query tokens of one sequence; one
program handles one tile for one KV head, so its ``G = Hq / Hkv`` query heads x ``block_q``
tokens fill the 64 rows of one wgmma (rows ordered head-major: row = g * block_q + j). The
program streams the sequence's KV pages through shared memory with TMA, ``block_kv`` tokens a
step, ``num_stages`` steps in flight, and keeps an online (flash) softmax in registers. Pages
are gathered per step from the page table; a page index past the sequence is replaced by an
out-of-range one, which TMA fills with zeros without touching memory. Rows past the end of the
query batch (padding) form one extra group of tiles with no KV, so they come back as zeros.

Head sizes 64, 96, 128 and 256 (80 faulted natively: see HEAD_DIMS), bf16 or fp16. The smem
swizzle follows the head size (``swizzle_for``: wgmma wants K and N in whole swizzle tiles),
and untiled Q and O, and the
f32 accumulator, are kept in column chunks of at most 128 (two at head_dim 256, whose default
``block_kv=64, num_stages=2`` needs about 200 KB of the 227 KB of shared memory).

An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2`` pages, per-tensor ``k_scale`` / ``v_scale``)
lands in shared memory as it is stored (half the bytes of bf16); each step converts the K and V
tiles to bf16 through registers (exact: every fp8 value is a bf16 value) into one tiled buffer
each, which the wgmmas read. The scales are applied to the float32 results, ``k_scale`` with the
softmax scale and ``v_scale`` with the 1 / row-sum: ``q . (k * s) = (q . k) * s``, so this is
the reference's ``page * scale`` before the dots without rounding ``page * scale`` to bf16.

When there are too few (tile, head) programs to fill the GPU (small decode batches) the KV range
of each tile is split ``num_splits`` ways; each split writes its normalised partial output and
its log-sum-exp (both token-indexed), and ``splits.merge_splits`` combines them in one XLA fusion.

Attention sinks (GPT-OSS, ``sinks[Hq]``): an unsplit launch reads them after the two scales in
its small f32 GMEM operand and starts each row's online softmax from its head's sink (a running
max of the sink and a sum of one, its mass, with nothing in the accumulator); a split launch
leaves them to the merge, which counts each once. Without sinks nothing changes: the operand
keeps its two scales and the loop its start.
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
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_cache import FP8_DTYPES
from pallas_kernels.ragged_paged_attention.splits import merge_splits

ROWS = 64  # query rows per program: one wgmma M tile
LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # finite, so fully masked rows never produce inf - inf
LSE_COLS = 32  # the log-sum-exp is stored 32 times per row: TMA wants 128-byte smem rows
NUM_SMS = 132  # H100 / H200
SMEM_BYTES = 227 * 1024  # shared memory one block may use on H100 / H200
DTYPES = (jnp.bfloat16, jnp.float16)
# NOTE: not 80: its 32-byte swizzle passed in interpret mode but faulted natively on the H200
# (CUDA_ERROR_MISALIGNED_ADDRESS, 2026-12-03); the Triton kernel takes head_dim 80.
HEAD_DIMS = (64, 96, 128, 256)


def swizzle_for(head_dim: int, itemsize: int) -> int:
    """The widest smem swizzle (bytes) whose tile width divides a head_dim row.

    wgmma takes one swizzle for both operands and wants K (and N of the PV product) in whole
    tiles of ``swizzle // itemsize`` columns: 128 bytes for head_dim 64/128/256, 64 for 96
    (3 tiles of 32 columns), 32 for 80 (5 tiles of 16). P shares V's swizzle.
    """
    for swizzle in (128, 64, 32):
        if head_dim * itemsize % swizzle == 0:
            return swizzle
    raise ValueError(f"{head_dim=} x {itemsize} bytes is not a multiple of 32 bytes")


def smem_bytes(head_dim: int, itemsize: int, block_kv: int, num_stages: int) -> int:
    """Shared memory of one program (the split variant, the larger one); see the scratch list."""
    q = ROWS * head_dim * itemsize
    kv_or_out = max(2 * num_stages * block_kv * head_dim * itemsize, ROWS * head_dim * 4)
    q_or_p = max(ROWS * head_dim, ROWS * block_kv) * itemsize
    return q + kv_or_out + q_or_p + ROWS * LSE_COLS * 4


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs; ``num_splits=None`` picks the KV split count from the shapes."""

    block_kv: int = 64
    num_stages: int = 2
    num_splits: int | None = None
    head_major_kv: bool = False  # KV pages laid out [P, Hkv, page_size, D] (benchmark only)

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")


def block_q_for(group: int) -> int:
    """Query tokens per tile: a multiple of 8 (the smem tiling) with block_q * group <= 64."""
    if not 1 <= group <= 8:
        raise ValueError(f"{group=} (query heads per KV head) must be in [1, 8]")
    return 8 * (8 // group)


def unsupported_reason(q, k_pages, *, head_major_kv: bool = False) -> str | None:
    """Why this call cannot run on the kernel (the caller falls back to the reference); sliding
    windows and soft caps are handled in the kernel, so only shapes and dtypes count."""
    _, num_q_heads, head_dim = q.shape
    if head_major_kv:
        _, num_kv_heads, page_size, _ = k_pages.shape
    else:
        _, page_size, num_kv_heads, _ = k_pages.shape
    if q.dtype not in DTYPES:
        return f"dtypes {q.dtype}/{k_pages.dtype}: the kernel takes bfloat16 or float16 queries"
    if k_pages.dtype in FP8_DTYPES:
        # NOTE: the fp8 path (stages converted through registers) is built and tested for the
        # head sizes of one 128-column chunk that Llama, Qwen and Mistral use.
        if head_dim not in (64, 128):
            return f"{head_dim=} with an fp8 cache: the kernel takes 64 or 128"
    elif k_pages.dtype != q.dtype:
        return (
            f"dtypes {q.dtype}/{k_pages.dtype}: the cache must be in the queries' dtype or fp8 "
            "(e4m3, e5m2)"
        )
    if head_dim not in HEAD_DIMS:
        return f"{head_dim=}: the kernel takes {', '.join(map(str, HEAD_DIMS))}"
    if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= 8:
        return f"{num_q_heads=}, {num_kv_heads=}: GQA ratio must be an integer in [1, 8]"
    if page_size % 8 or (page_size & (page_size - 1)):
        return f"{page_size=}: must be a power of two >= 8"
    return None


def default_num_splits(
    num_tokens: int, num_slots: int, num_kv_heads: int, max_kv: int, block_kv: int
) -> int:
    """Split the KV length when the (tile, head) programs would leave the GPU half empty."""
    programs = min(num_tokens, num_slots) * num_kv_heads
    splits = 1
    while programs * splits * 2 <= 2 * NUM_SMS and max_kv >= 2 * splits * 2 * block_kv:
        splits *= 2
    return splits


def plan_tiles(
    cu_q_lens: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[1]
    *,
    num_tokens: int,
    block_q: int,
    max_tiles: int,
    with_padding: bool,
) -> jax.Array:  # i32[5, max_tiles]: seq, first token, tokens, first position, kv_len
    """Cut each sequence's query rows (and the padding rows) into tiles of block_q tokens."""
    num_slots = kv_lens.shape[0]
    n = num_seqs[0]
    is_live = jnp.arange(num_slots, dtype=jnp.int32) < n  # bool[S]
    q_lens = jnp.where(is_live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # i32[S]
    live_end = cu_q_lens[n]
    pad_len = (num_tokens - live_end) if with_padding else jnp.int32(0)
    g_start = jnp.concatenate([cu_q_lens[:-1], live_end[None]])  # i32[S + 1]
    g_len = jnp.concatenate([q_lens, pad_len[None]]).astype(jnp.int32)  # i32[S + 1]
    g_kv = jnp.concatenate([jnp.where(is_live, kv_lens, 0), jnp.zeros(1, jnp.int32)])
    g_tiles = (g_len + block_q - 1) // block_q  # i32[S + 1]
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(g_tiles, dtype=jnp.int32)])
    tile = jnp.arange(max_tiles, dtype=jnp.int32)  # i32[max_tiles]
    # compare_all: one fusion (the default binary search is a loop, slow on GPU).
    grp = jnp.searchsorted(cu_tiles[1:], tile, side="right", method="compare_all")
    grp = grp.astype(jnp.int32)
    grp = jnp.minimum(grp, num_slots)  # i32[max_tiles]
    first = (tile - cu_tiles[grp]) * block_q  # i32[max_tiles]  offset inside the group
    size = jnp.clip(g_len[grp] - first, 0, block_q)
    size = jnp.where(tile < cu_tiles[-1], size, 0)
    pos0 = g_kv[grp] - g_len[grp] + first
    seq = jnp.minimum(grp, num_slots - 1)
    return jnp.stack([seq, g_start[grp] + first, size, pos0, g_kv[grp]]).astype(jnp.int32)


def max_tiles_for(num_tokens: int, num_slots: int, block_q: int) -> int:
    """Upper bound on the tile count: every group adds at most one partial tile."""
    return max(1, min(num_tokens // block_q + num_slots + 1, num_tokens))


def _attention_kernel(
    plan_ref,  # i32[5, max_tiles] (GMEM)
    pages_ref,  # i32[S, pages_per_seq] (GMEM)
    q_ref,  # [T, Hq, D]
    k_ref,  # [P, page_size, Hkv, D] or [P, Hkv, page_size, D]
    v_ref,
    scales_ref,  # f32[2] (GMEM): k_scale, v_scale; then, with sinks, f32[Hq] of sink logits
    o_ref,  # [T, Hq, D] (q dtype) or f32[num_splits, T, Hq, D]
    lse_ref,  # f32[num_splits, T, Hq, LSE_COLS] or None
    q_smem,  # [ROWS, D] tiled for wgmma
    kv_or_out,  # ((k_smem, v_smem) [num_stages, block_kv, D] tiled, o_smem [C, ROWS, D / C])
    q_or_p,  # (q_raw [C, ROWS, D / C] untiled, p_smem [ROWS, block_kv] tiled)
    lse_smem,  # f32[ROWS, LSE_COLS] untiled, or None
    q_bar,
    k_bar,  # [num_stages]
    v_bar,
    k_deq,  # [block_kv, D] q dtype, tiled: the fp8 K tile converted; None for a bf16 cache
    v_deq,
    *,
    cfg: KernelConfig,
    is_scaled: bool,
    has_sinks: bool,
    num_splits: int,
    group: int,
    block_q: int,
    page_size: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    # Shared memory reused across phases: KV stages and P live in the loop, Q arrives untiled
    # before it, the output leaves after it.
    (k_smem, v_smem), o_smem = kv_or_out
    q_raw, p_smem = q_or_p
    tile = lax.axis_index("tile")
    split = lax.axis_index("split")
    head = lax.axis_index("head")
    block_kv, stages = cfg.block_kv, cfg.num_stages
    pages_per_seq = pages_ref.shape[1]
    rows_per_copy = min(page_size, block_kv)
    copies = block_kv // rows_per_copy

    k_scale = scales_ref[0] if is_scaled else 1.0
    v_scale = scales_ref[1] if is_scaled else 1.0
    seq = plan_ref[0, tile]
    t0 = plan_ref[1, tile]
    size = plan_ref[2, tile]
    pos0 = plan_ref[3, tile]
    kv_len = plan_ref[4, tile]

    @pl.when(size > 0)
    def _():
        pos_last = pos0 + size - 1
        kv_hi = jnp.clip(pos_last + 1, 0, kv_len)
        kb_hi = (kv_hi + block_kv - 1) // block_kv
        kb_lo = jnp.int32(0)
        if sliding_window is not None:
            kb_lo = jnp.clip(pos0 - sliding_window + 1, 0, kv_hi) // block_kv
        num_blocks = kb_hi - kb_lo
        s_lo = kb_lo + num_blocks * split // num_splits
        s_hi = kb_lo + num_blocks * (split + 1) // num_splits
        # Blocks [u_lo, u_hi) need no mask: every row sees every token in them. The masked
        # blocks on either side are processed first, then the open ones (the online softmax
        # does not care about order); step i works on block_of(i) in slot i % num_stages.
        u_lo = kb_lo
        if sliding_window is not None:
            u_lo = (jnp.maximum(pos_last - sliding_window + 1, 0) + block_kv - 1) // block_kv
        u_lo = jnp.clip(u_lo, s_lo, s_hi)
        u_hi = jnp.clip(jnp.minimum(pos0 + 1, kv_hi) // block_kv, u_lo, s_hi)
        num_front = u_lo - s_lo
        num_masked = num_front + s_hi - u_hi
        num_steps = s_hi - s_lo

        def block_of(i):
            back = jnp.where(i < num_masked, u_hi + i - num_front, u_lo + i - num_masked)
            return jnp.where(i < num_front, s_lo + i, back)

        num_seq_pages = (kv_len + page_size - 1) // page_size

        # Tiled smem needs 8-aligned source rows, so Q lands untiled and is retiled through
        # registers (rows past G * block_q stay unused: their results are never stored).
        # Untiled Q and O are kept in column chunks of at most 128 (C = num_cols of them):
        # Mosaic GPU finds no register <-> smem transfer for untiled rows of 256 x 2 bytes.
        num_cols, col_width = q_raw.shape[0], q_raw.shape[-1]
        cols = [pl.ds(c * col_width, col_width) for c in range(num_cols)]
        for g in range(group):
            for c in range(num_cols):
                plgpu.copy_gmem_to_smem(
                    q_ref.at[pl.ds(t0, block_q), head * group + g, cols[c]],
                    q_raw.at[c, pl.ds(g * block_q, block_q)],
                    q_bar,
                )

        def lookup_pages(block):  # the page of each copy of KV block `block`
            pages = []
            for c in range(copies):
                page_slot = (block * block_kv + c * rows_per_copy) // page_size
                page = pages_ref[seq, jnp.minimum(page_slot, pages_per_seq - 1)]
                # Past the sequence: an out-of-range page, which TMA fills with zeros.
                pages.append(jnp.where(page_slot < num_seq_pages, page, num_pages))
            return pages

        def issue(block, slot, pages):
            if page_size > block_kv:
                first_row = lax.rem(block, page_size // block_kv) * block_kv
            else:
                first_row = 0
            rows = pl.ds(first_row, rows_per_copy)
            for c, page in enumerate(pages):
                dst = pl.ds(c * rows_per_copy, rows_per_copy)
                for src, dst_smem, bar in ((k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)):
                    view = (
                        src.at[page, head, rows] if cfg.head_major_kv else src.at[page, rows, head]
                    )
                    plgpu.copy_gmem_to_smem(view, dst_smem.at[slot, dst], bar.at[slot])

        for i in range(stages):
            pl.when(i < num_steps)(lambda i=i: issue(block_of(i), i, lookup_pages(block_of(i))))
        plgpu.barrier_wait(q_bar)
        # NOTE: the register layout is given, so layout inference need not search for one.
        for c in range(num_cols):
            q_part = plgpu.layout_cast(q_raw[c], plgpu.Layout.WGMMA)
            if num_cols == 1:
                q_smem[...] = q_part
            else:
                q_smem[:, cols[c]] = q_part
        plgpu.commit_smem()

        row_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
        col_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
        row_pos = pos0 + lax.rem(row_ids, block_q)  # i32[ROWS, block_kv]

        def step(i, carry, *, masked):
            acc, m_i, l_i = carry
            block = block_of(i)
            slot = lax.rem(i, stages)
            # Read the page table for the block issued at the end of this step now, so the
            # scalar loads overlap this step's math.
            next_block = block_of(i + stages)
            next_pages = lookup_pages(next_block)
            plgpu.barrier_wait(k_bar.at[slot])
            k_tile = k_smem.at[slot]
            if k_deq is not None:  # fp8 -> bf16 through registers, for the wgmma
                k_deq[...] = k_smem[slot].astype(jnp.float32).astype(k_deq.dtype)
                plgpu.commit_smem()
                k_tile = k_deq

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, block_kv), jnp.float32))
            if soft_cap is not None:
                s = jnp.tanh(s * (k_scale * (sm_scale / soft_cap))) * (soft_cap * LOG2E)
            else:
                s = s * (k_scale * (sm_scale * LOG2E))
            if masked:
                kv_pos = block * block_kv + col_ids
                mask = (kv_pos <= row_pos) & (kv_pos < kv_len)
                if sliding_window is not None:
                    mask = mask & (kv_pos > row_pos - sliding_window)
                s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            p_smem[...] = p.astype(p_smem.dtype)
            v_tile = v_smem.at[slot]
            if v_deq is None:
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])
            else:
                plgpu.barrier_wait(v_bar.at[slot])
                v_deq[...] = v_smem[slot].astype(jnp.float32).astype(v_deq.dtype)
                plgpu.commit_smem()  # P and the converted V
                v_tile = v_deq

            def pv_scope(acc_ref, c):  # (an fp8 cache has one column chunk: v_tile is whole)
                v = v_tile if num_cols == 1 else v_smem.at[slot, :, cols[c]]
                plgpu.wgmma(acc_ref, p_smem, v)
                return acc_ref[...]

            # NOTE: the accumulator is kept in column chunks of at most 128 and PV is computed a
            # chunk at a time, so at head_dim 256 only half of a second f32 [64, D] array is live.
            acc = tuple(
                a * lax.broadcast_in_dim(alpha, a.shape, [0])
                + pl.run_scoped(
                    functools.partial(pv_scope, c=c), plgpu.ACC((ROWS, col_width), jnp.float32)
                )
                for c, a in enumerate(acc)
            )
            pl.when(i + stages < num_steps)(lambda: issue(next_block, slot, next_pages))
            return acc, m_new, l_i

        acc_0 = tuple(
            plgpu.layout_cast(jnp.zeros((ROWS, col_width), jnp.float32), plgpu.Layout.WGMMA)
            for _ in range(num_cols)
        )
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        if has_sinks:  # the sink as a first column with no value: max = sink, sum = 1
            sink = jnp.full((ROWS, block_kv), scales_ref[2 + head * group] * LOG2E, jnp.float32)
            sink = plgpu.layout_cast(sink, plgpu.Layout.WGMMA)  # f32[ROWS, block_kv]
            for g in range(1, group):  # rows g * block_q ... belong to query head g
                sink_g = scales_ref[2 + head * group + g] * LOG2E
                sink = jnp.where(row_ids >= g * block_q, sink_g, sink)
            m_0 = sink.max(axis=1)  # f32[ROWS]
            l_0 = plgpu.layout_cast(jnp.ones((ROWS,), jnp.float32), row_layout)
        else:
            m_0 = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row_layout)
            l_0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
        carry = (acc_0, m_0, l_0)
        masked_step = functools.partial(step, masked=True)
        open_step = functools.partial(step, masked=False)
        carry = lax.fori_loop(0, num_masked, masked_step, carry)
        acc, m_i, l_i = lax.fori_loop(num_masked, num_steps, open_step, carry)

        is_empty = l_i == 0.0
        inv_l = v_scale / jnp.where(is_empty, 1.0, l_i)
        for c, a in enumerate(acc):
            o = (a * lax.broadcast_in_dim(inv_l, a.shape, [0])).astype(o_smem.dtype)
            o_smem[c] = plgpu.layout_cast(o, plgpu.Layout.WGMMA)
        if lse_smem is not None:
            lse = jnp.where(is_empty, MASK_VALUE, m_i + jnp.log2(l_i))
            lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [0])
        plgpu.commit_smem()
        o_dst = o_ref.at[split] if lse_ref is not None else o_ref
        outs = [(o_smem.at[c], o_dst, cols[c]) for c in range(num_cols)]
        if lse_ref is not None:
            outs.append((lse_smem, lse_ref.at[split], slice(None)))
        for g in range(group):
            start = jnp.int32(0)
            chunk = block_q
            while chunk:
                # TMA boxes have static shapes: store `size` rows as a sum of powers of two.
                @pl.when(size & chunk != 0)
                def _(start=start, chunk=chunk, g=g):
                    for src, dst, col in outs:
                        plgpu.copy_smem_to_gmem(
                            src.at[pl.ds(g * block_q + start, chunk)],
                            dst.at[pl.ds(t0 + start, chunk), head * group + g, col],
                        )

                start = start + (size & chunk)
                chunk //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


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
    k_scale: jax.Array | float | None = None,  # f32[]: the fp8 cache holds k / k_scale
    v_scale: jax.Array | float | None = None,
    sinks: jax.Array | None = None,  # [Hq]  a logit per query head in each row's denominator
    config: KernelConfig = KernelConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Mosaic GPU ragged paged attention; see the module docstring for the work layout."""
    _check_call(q, k_pages, sliding_window, sinks, config)
    launch = _launch_for(q, k_pages, page_indices, config)
    is_split = launch.num_splits > 1
    plan = plan_tiles(
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        num_tokens=q.shape[0],
        block_q=launch.block_q,
        max_tiles=launch.max_tiles,
        with_padding=not is_split,
    )
    has_sinks = sinks is not None and not is_split  # (a split launch leaves them to the merge)
    scales = _scales_operand(k_scale, v_scale, sinks if has_sinks else None)
    body = functools.partial(
        _attention_kernel,
        cfg=config,
        is_scaled=k_scale is not None or v_scale is not None,
        has_sinks=has_sinks,
        num_splits=launch.num_splits,
        group=launch.group,
        block_q=launch.block_q,
        page_size=launch.page_size,
        num_pages=launch.num_pages,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    outs = plgpu.kernel(
        body if is_split else _with_no_lse(body),
        out_type=_out_types(q, launch.num_splits),
        scratch_types=_scratch_types(q, k_pages, launch, config),
        grid=(launch.max_tiles, launch.num_splits, launch.num_kv_heads),
        grid_names=("tile", "split", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="ragged_paged_attention",
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret,
    )(plan, page_indices.astype(jnp.int32), q, k_pages, v_pages, scales)
    if not is_split:
        return outs[0]
    return merge_splits(outs[0], outs[1], cu_q_lens, num_seqs, out_dtype=q.dtype, sinks=sinks)


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    block_q: int  # query tokens per tile
    num_splits: int  # of each tile's KV range
    max_tiles: int  # the grid's tile axis: every tile the plan may hold


def _launch_for(q, k_pages, page_indices, config: KernelConfig) -> _Launch:
    """Tiles, KV splits and grid for this call (``config.num_splits`` or the default)."""
    num_tokens, num_q_heads, _ = q.shape
    num_pages, page_size, num_kv_heads = _kv_geometry(k_pages, config.head_major_kv)
    num_slots, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    block_q = block_q_for(group)
    num_splits = config.num_splits or default_num_splits(
        num_tokens, num_slots, num_kv_heads, pages_per_seq * page_size, config.block_kv
    )
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    return _Launch(num_pages, page_size, num_kv_heads, group, block_q, num_splits, max_tiles)


def _kv_geometry(k_pages, head_major_kv: bool) -> tuple[int, int, int]:
    """``(num_pages, page_size, num_kv_heads)`` of a cache laid out ``[P, page_size, Hkv, D]``
    (or ``[P, Hkv, page_size, D]``, head-major)."""
    if head_major_kv:
        num_pages, num_kv_heads, page_size, _ = k_pages.shape
    else:
        num_pages, page_size, num_kv_heads, _ = k_pages.shape
    return num_pages, page_size, num_kv_heads


def _check_call(q, k_pages, sliding_window, sinks, config: KernelConfig) -> None:
    """Raise ValueError for a call the kernel does not take, or whose tiles do not fit."""
    reason = unsupported_reason(q, k_pages, head_major_kv=config.head_major_kv)
    if reason is not None:
        raise ValueError(f"ragged_paged_attention on Mosaic GPU: {reason}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1")
    _, num_q_heads, head_dim = q.shape
    _, page_size, _ = _kv_geometry(k_pages, config.head_major_kv)
    block_kv, stages = config.block_kv, config.num_stages
    if page_size > block_kv and page_size % block_kv:
        raise ValueError(f"{page_size=} must be a multiple of {block_kv=}")
    smem = smem_bytes(head_dim, jnp.dtype(q.dtype).itemsize, block_kv, stages)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"{head_dim=} with {block_kv=} and num_stages={stages} needs {smem:,} bytes of "
            f"shared memory; the limit is {SMEM_BYTES:,}: lower block_kv or num_stages"
        )
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"{sinks.shape=} must be ({num_q_heads},): one logit per query head")


def _scales_operand(k_scale, v_scale, sinks: jax.Array | None) -> jax.Array:
    """The kernel's small f32 GMEM operand: ``[k_scale, v_scale]`` (1.0 for None), then, for a
    launch that takes them, the sink logits: f32[2] or f32[2 + Hq]."""
    scales = jnp.stack(
        [jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(()) for x in (k_scale, v_scale)]
    )  # f32[2]
    if sinks is not None:
        scales = jnp.concatenate([scales, sinks.astype(jnp.float32)])  # f32[2 + Hq]
    return scales


def _out_types(q: jax.Array, num_splits: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``(o,)`` in q's dtype; or, when the KV is split, ``(o, lse)`` per split in float32."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct(q.shape, q.dtype),)
    num_tokens, num_q_heads, head_dim = q.shape
    return (
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads, LSE_COLS), jnp.float32),
    )


def _scratch_types(q: jax.Array, k_pages: jax.Array, launch: _Launch, config: KernelConfig) -> list:
    """The kernel body's shared memory and barriers, in its argument order (``q_smem`` to
    ``v_deq``); ``smem_bytes`` counts the same buffers."""
    head_dim = q.shape[-1]
    itemsize = jnp.dtype(q.dtype).itemsize
    swizzle = swizzle_for(head_dim, itemsize)
    # jax 0.11.2: these subclass the Transform protocol without overriding transform_array,
    # whose body only raises, so mypy takes them for abstract classes; jax uses them as here.
    tiled = (
        plgpu.TilingTransform((8, swizzle // itemsize)),  # type: ignore[abstract]
        plgpu.SwizzleTransform(swizzle),  # type: ignore[abstract]
    )
    block_kv, stages = config.block_kv, config.num_stages
    is_split = launch.num_splits > 1
    o_dtype = jnp.float32 if is_split else q.dtype
    is_fp8 = k_pages.dtype in FP8_DTYPES
    # fp8 stages land untiled: only the conversion to bf16 reads them, the wgmmas do not.
    kv_stage = plgpu.SMEM(
        (stages, block_kv, head_dim), k_pages.dtype, transforms=() if is_fp8 else tiled
    )
    kv_deq = plgpu.SMEM((block_kv, head_dim), q.dtype, transforms=tiled) if is_fp8 else None
    col_width = min(head_dim, 128)
    num_cols = head_dim // col_width
    copies = block_kv // min(launch.page_size, block_kv)  # TMA copies per KV step (pages)
    return [
        plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=tiled),
        plgpu.RefUnion((kv_stage, kv_stage), plgpu.SMEM((num_cols, ROWS, col_width), o_dtype)),
        plgpu.RefUnion(
            plgpu.SMEM((num_cols, ROWS, col_width), q.dtype),
            plgpu.SMEM((ROWS, block_kv), q.dtype, transforms=tiled),
        ),
        plgpu.SMEM((ROWS, LSE_COLS), jnp.float32) if is_split else None,
        plgpu.Barrier(num_arrivals=launch.group * num_cols),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        kv_deq,
        kv_deq,
    ]


def _with_no_lse(body):
    """Adapt the kernel body to the single-output launch (no lse output, no lse scratch)."""

    def wrapped(plan, pages, q, k, v, scales, o, *scratch):
        return body(plan, pages, q, k, v, scales, o, None, *scratch)

    return wrapped
