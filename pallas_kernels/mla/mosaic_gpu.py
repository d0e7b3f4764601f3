"""Ragged paged multi-head latent attention (DeepSeek-V2/V3) as a Pallas Mosaic GPU kernel
(Hopper wgmma).

Same signature and semantics as ``reference.ragged_paged_mla_attention``: each query row scores
``q_latent . c_kv + q_pe . k_pe`` against its sequence's cached latents, causally, and returns
the probability-weighted latent.

Work decomposition (FlashMLA's). A program owns 64 query rows, one wgmma M tile: a decode token's
``block_h`` heads (64 of 128; 16 of a TP-8 shard, the other rows idle), or ``block_q`` tokens x
``block_h`` heads of one sequence's prefill tile (token-major, tiled by
``ragged_paged_attention.mosaic_gpu.plan_tiles``). Its ``q_latent`` [64, L] and ``q_pe`` [64, R]
stay in shared memory; the sequence's ``c_kv`` [block_kv, L] and ``k_pe`` [block_kv, R] pages
stream through a ``num_stages`` ring by TMA, gathered through the page table. ``c_kv`` is both
the key's latent part and the value.

Three warpgroups. The third (the producer) issues the TMA copies: Q once, then each KV step
into the ring once both consumers have released its slot. The two consumers each own half of
the f32 output accumulator ([64, L / 2], 128 registers a thread at L = 512) and take the KV
steps in turns (ping-pong): the owner of step i computes the scores ``S = q_latent c^T + q_pe
k_pe^T`` [64, block_kv] with two wgmmas (K = L, then R), the online softmax from the running
max and sum the other consumer left in shared memory after step i - 1, writes ``P`` (q dtype)
and the new max and sum to shared memory and signals; then both multiply ``P`` by their half of
``c_kv`` (wgmma, N = L / 2) into their accumulator. While one consumer runs its softmax, the
other's wgmmas keep the tensor cores busy; the owner of step i + 1 issues its score wgmma before
it waits for step i's ``P``. One ``P`` buffer serves both: its next owner overwrites it only
after the previous owner's ``P c`` product is done (``p_free``).

The grid is (tiles, KV splits, head blocks), head blocks fastest: the programs of one tile read
the same pages side by side (the second from L2). Small batches split each tile's KV range
(``num_splits``); partial outputs and log-sum-exps are merged by ``splits.merge_splits``.

Shared memory at DeepSeek-V3's shapes (L 512, R 64, bf16, block_kv 64, 2 stages): Q 72 KB, the
ring 2 x 72 KB (the output, 64 x 512 f32 when split, reuses it after the loop), P 8 KB, the
running max and sum 1 KB (aligned): 225 KB of the 227 KB.

Takes bf16 or fp16 queries over a cache of their dtype; latent widths 128, 256, 384 or 512 (each
consumer's half whole 64-column swizzle tiles, at most a wgmma's N of 256), rope widths 16, 32 or
multiples of 64 up to 256, head counts multiple of 8, page sizes powers of two >= 8. An fp8 cache
is refused (``unsupported_reason``; the dispatch takes the Triton kernel, which converts it):
a bf16 copy of a converted 64 x 576 tile does not fit beside two fp8 stages and Q.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_cache import Scale
from pallas_kernels.ragged_paged_attention.mosaic_gpu import (
    max_tiles_for,
    plan_tiles,
    swizzle_for,
)
from pallas_kernels.ragged_paged_attention.splits import merge_splits
from pallas_kernels.ragged_paged_attention.triton import default_num_splits, num_sms

ROWS = 64  # query rows per program: one wgmma M tile
LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # finite, so fully masked rows never produce inf - inf
LSE_COLS = 32  # the log-sum-exp is stored 32 times per row: TMA wants 128-byte smem rows
SMEM_BYTES = 227 * 1024  # shared memory one block may use on H100 / H200
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LATENTS = (128, 256, 384, 512)  # each consumer's half: whole 64-column tiles, N <= 256
MAX_ROPE = 256
HEAD_BLOCKS = (64, 32, 16, 8)  # query heads per program, the largest dividing the head count
CONSUMERS = 2  # warpgroups that own half of the accumulator each
PRODUCER = 2  # the TMA warpgroup's index
CONSUMER_REGISTERS = 232  # setmaxnreg: 2 x 232 + 40 registers x 128 threads <= 64K
PRODUCER_REGISTERS = 40
INTERPRETER_THREADS = 4  # of the XLA CPU client that interpret mode needs (see below)


@dataclasses.dataclass(frozen=True)
class MlaMosaicConfig:
    """Static tuning knobs; ``num_splits=None`` picks the KV split count from the shapes."""

    block_kv: int = 64  # cached tokens a step (a P tile and each consumer's K of P c)
    num_stages: int = 2  # KV steps in flight in the ring
    num_splits: int | None = None  # of each tile's KV range
    # Latent columns a score wgmma, looped over (``_scores``); the latent's width (512): one
    # wgmma, unrolled, as before (its descriptors spilled), to time both.
    latent_chunk: int = 128

    def __post_init__(self):
        if self.block_kv not in (64, 128):
            raise ValueError(f"block_kv={self.block_kv} must be 64 or 128")
        if self.latent_chunk % 64 or self.latent_chunk < 64:
            raise ValueError(f"latent_chunk={self.latent_chunk} must be a multiple of 64")
        if not 2 <= self.num_stages <= 8:
            raise ValueError(f"num_stages={self.num_stages} must be in [2, 8]")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1")


def smem_bytes(
    latent: int, rope_dim: int, itemsize: int, block_kv: int, num_stages: int, is_split: bool
) -> int:
    """Shared memory of one program; ``_scratch_types`` allocates the same buffers."""
    q = ROWS * (latent + rope_dim) * itemsize
    ring = num_stages * block_kv * (latent + rope_dim) * itemsize
    out = ROWS * latent * (4 if is_split else itemsize) + ROWS * LSE_COLS * 4
    p = ROWS * block_kv * itemsize
    stats = 1024  # running max and sum, f32[2, 64], aligned
    return q + max(ring, out) + p + stats


def _block_h(num_heads: int) -> int | None:
    return next((b for b in HEAD_BLOCKS if num_heads % b == 0), None)


def unsupported_reason(
    q_latent, q_pe, ckv_pages, kpe_pages, config: MlaMosaicConfig = MlaMosaicConfig()
) -> str | None:
    """Why this call cannot run on the kernel (the dispatch then takes the Triton kernel or the
    reference); only shapes and dtypes count. Arrays or ``jax.ShapeDtypeStruct``s."""
    q_dtype, cache_dtype = jnp.dtype(q_latent.dtype), jnp.dtype(ckv_pages.dtype)
    if q_dtype not in DTYPES or jnp.dtype(q_pe.dtype) != q_dtype:
        return f"query dtype {q_dtype}: the kernel takes bfloat16 or float16"
    if cache_dtype != q_dtype or jnp.dtype(kpe_pages.dtype) != q_dtype:
        return f"cache dtype {cache_dtype}: the Mosaic GPU kernel takes the query's dtype"
    num_heads, latent, rope_dim = q_latent.shape[1], ckv_pages.shape[-1], kpe_pages.shape[-1]
    if latent not in LATENTS:
        return f"kv_lora_rank={latent}: the Mosaic GPU kernel takes {', '.join(map(str, LATENTS))}"
    if rope_dim not in (16, 32) and (rope_dim % 64 or rope_dim > MAX_ROPE):
        return f"qk_rope_head_dim={rope_dim}: the Mosaic GPU kernel takes 16, 32 or 64k <= 256"
    if _block_h(num_heads) is None:
        return f"{num_heads} query heads: the Mosaic GPU kernel takes multiples of 8"
    page_size = ckv_pages.shape[1]
    if page_size < 8 or page_size & (page_size - 1):
        return f"page_size={page_size}: the Mosaic GPU kernel takes powers of two >= 8"
    if ckv_pages.shape[2] != 1 or kpe_pages.shape[2] != 1:
        return f"latent pages {ckv_pages.shape}: one KV head expected"
    if latent % min(config.latent_chunk, latent):  # the score loop's chunks tile the latent
        return f"latent_chunk={config.latent_chunk} does not divide kv_lora_rank={latent}"
    smem = smem_bytes(
        latent, rope_dim, q_dtype.itemsize, config.block_kv, config.num_stages, is_split=True
    )
    if smem > SMEM_BYTES:
        return (
            f"block_kv={config.block_kv} x num_stages={config.num_stages} needs {smem:,} bytes "
            f"of shared memory at L={latent}, R={rope_dim}; the limit is {SMEM_BYTES:,}"
        )
    return None


def interpreter_threads() -> int:
    """The threads of the XLA CPU client's pool: ``NPROC`` where set, else this process's CPUs
    (``xla/pjrt/utils.cc``, ``DefaultThreadPoolSize``)."""
    nproc = os.environ.get("PORTABLE_NPROC") or os.environ.get("NPROC")
    if nproc and nproc.isdigit():
        return int(nproc)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def interpreter_unsupported_reason() -> str | None:
    """Why Mosaic GPU interpret mode would hang here, if it would: it runs the 3 warpgroups of
    a program as threads whose barrier waits block host callbacks on the XLA CPU client's pool;
    with fewer than INTERPRETER_THREADS threads, two blocked waits starve the third warpgroup.
    """
    threads = interpreter_threads()
    if threads < INTERPRETER_THREADS:
        return (
            f"interpret mode runs 3 warpgroups on the XLA CPU client's {threads} threads, "
            f"fewer than {INTERPRETER_THREADS}: set NPROC={INTERPRETER_THREADS} before JAX starts"
        )
    return None


class _Static(NamedTuple):
    """The launch's static shape, closed over by the kernel body."""

    block_h: int  # query heads per program
    block_q: int  # query tokens per tile (1 for decode)
    block_kv: int
    num_stages: int
    num_splits: int
    page_size: int
    num_pages: int
    sm_scale: float
    interpret: bool  # P c as a scoped product added to the accumulator (no run_state there)
    latent_chunk: int  # latent columns a score wgmma (MlaMosaicConfig.latent_chunk)


class _Refs(NamedTuple):
    """Operands, outputs and scratch of one program."""

    plan: Any  # i32[5, max_tiles] (GMEM): seq, first token, tokens, first position, kv_len
    pages: Any  # i32[S, pages_per_seq] (GMEM)
    ql: Any  # [T, N, L]
    qpe: Any  # [T, N, R]
    ckv: Any  # [P, page_size, 1, L]
    kpe: Any  # [P, page_size, 1, R]
    o: Any  # [T, N, L] (q dtype) or f32[num_splits, T, N, L]
    lse: Any  # f32[num_splits, T, N, LSE_COLS] or None
    ql_s: Any  # [64, L] tiled
    qpe_s: Any  # [64, R] tiled
    ckv_s: Any  # [num_stages, block_kv, L] tiled
    kpe_s: Any  # [num_stages, block_kv, R] tiled
    o_s: Any  # [2, 64, L / 2] tiled (a half per consumer), over the ring after the loop
    lse_s: Any  # f32[64, LSE_COLS], over the ring after the loop
    p_s: Any  # [64, block_kv] tiled: the probabilities of the latest step
    stats_s: Any  # f32[2, 64]: the running max and sum after the latest step
    q_bar: Any  # Q landed
    kv_bar: Any  # [num_stages]: a step's c_kv and k_pe landed
    free_bar: Any  # [num_stages]: both consumers are done with a slot (2 arrivals)
    ready_bar: Any  # [2]: consumer w's P, max and sum are written
    pfree_bar: Any  # [2]: consumer w's P c product is done (P may be overwritten)
    done_bar: Any  # both consumers are past the loop (the ring may hold the output)


class _Tile(NamedTuple):
    """This program's tile and KV range (traced scalars)."""

    seq: Any
    t0: Any  # first token
    size: Any  # tokens
    pos0: Any  # the first token's position
    kv_len: Any
    kv_hi: Any  # positions the tile's last token sees
    head0: Any  # first query head
    split: Any
    s_lo: Any  # first KV step of this split
    num_steps: Any  # KV steps of this split


def _tile_of(r: _Refs, st: _Static) -> _Tile:
    tile, split = lax.axis_index("tile"), lax.axis_index("split")
    seq, t0, size, pos0, kv_len = (r.plan[i, tile] for i in range(5))
    kv_hi = jnp.clip(pos0 + size, 0, kv_len)
    total = (kv_hi + st.block_kv - 1) // st.block_kv
    s_lo = total * split // st.num_splits
    s_hi = total * (split + 1) // st.num_splits
    head0 = lax.axis_index("head") * st.block_h
    return _Tile(seq, t0, size, pos0, kv_len, kv_hi, head0, split, s_lo, s_hi - s_lo)


def _mla_kernel(
    plan, pages, ql, qpe, ckv, kpe, o, lse, ql_s, qpe_s, ring_or_out, p_s, stats_s, *bars, st
):
    (ckv_s, kpe_s), (o_s, lse_s) = ring_or_out
    operands = (plan, pages, ql, qpe, ckv, kpe, o, lse)
    r = _Refs(*operands, ql_s, qpe_s, ckv_s, kpe_s, o_s, lse_s, p_s, stats_s, *bars)
    t = _tile_of(r, st)
    wg = lax.axis_index("wg")

    @pl.when(t.size > 0)
    def _():
        pl.when(wg == PRODUCER)(functools.partial(_producer, r, st, t))
        for w in range(CONSUMERS):
            pl.when(wg == w)(functools.partial(_consumer, r, st, t, w))


def _producer(r: _Refs, st: _Static, t: _Tile) -> None:
    """The TMA warpgroup: Q, then the KV steps into the ring as the consumers free its slots."""
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    num_tokens = r.ql.shape[0]
    heads = pl.ds(t.head0, st.block_h)
    for j in range(st.block_q):  # tokens past the tile's: rows that are never stored
        token = jnp.minimum(t.t0 + j, num_tokens - 1)
        rows = pl.ds(j * st.block_h, st.block_h)
        plgpu.copy_gmem_to_smem(r.ql.at[token, heads], r.ql_s.at[rows], r.q_bar)
        plgpu.copy_gmem_to_smem(r.qpe.at[token, heads], r.qpe_s.at[rows], r.q_bar)
    for i in range(st.num_stages):
        pl.when(i < t.num_steps)(functools.partial(_issue_first, r, st, t, i))

    def refill(i, pages):
        # Step i's pages were read from the page table during the previous wait; step i + 1's
        # are read now, so their loads overlap the wait for the next free slot.
        slot = lax.rem(i, st.num_stages)
        plgpu.barrier_wait(r.free_bar.at[slot])
        _issue(r, st, t, i, slot, pages)
        return _pages_of(r, st, t, i + 1)

    first = _pages_of(r, st, t, st.num_stages)
    lax.fori_loop(st.num_stages, t.num_steps, refill, first)


def _issue_first(r: _Refs, st: _Static, t: _Tile, i: int) -> None:
    """Step ``i`` of the first ``num_stages`` into slot ``i``, its pages read now."""
    _issue(r, st, t, i, i, _pages_of(r, st, t, i))


def _pages_of(r: _Refs, st: _Static, t: _Tile, i) -> tuple:
    """The page of each copy of KV step ``i`` (of this split): a page past the sequence (or a
    step past the split) is an out-of-range index, which TMA fills with zeros."""
    block = t.s_lo + i
    rows_per_copy = min(st.page_size, st.block_kv)
    num_seq_pages = (t.kv_len + st.page_size - 1) // st.page_size
    pages_per_seq = r.pages.shape[1]
    pages = []
    for c in range(st.block_kv // rows_per_copy):
        page_slot = (block * st.block_kv + c * rows_per_copy) // st.page_size
        page = r.pages[t.seq, jnp.clip(page_slot, 0, pages_per_seq - 1)]
        pages.append(jnp.where(page_slot < num_seq_pages, page, st.num_pages))
    return tuple(pages)


def _issue(r: _Refs, st: _Static, t: _Tile, i, slot, pages: tuple) -> None:
    """TMA copies of KV step ``i`` (of this split) into ``slot``: a copy per page it spans."""
    block = t.s_lo + i
    rows_per_copy = min(st.page_size, st.block_kv)
    first_row: Any = 0  # within the page: a page of several steps is read a step at a time
    if st.page_size > st.block_kv:
        first_row = lax.rem(block, st.page_size // st.block_kv) * st.block_kv
    for c, page in enumerate(pages):
        src, dst = pl.ds(first_row, rows_per_copy), pl.ds(c * rows_per_copy, rows_per_copy)
        plgpu.copy_gmem_to_smem(r.ckv.at[page, src, 0], r.ckv_s.at[slot, dst], r.kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(r.kpe.at[page, src, 0], r.kpe_s.at[slot, dst], r.kv_bar.at[slot])


def _consumer(r: _Refs, st: _Static, t: _Tile, w: int) -> None:
    """Consumer ``w`` (0 or 1): owns KV steps w, w + 2, ... (scores and softmax), multiplies
    every step's P by its half of c_kv. Step o's owner first reads step o - 1 (the other's)."""
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    plgpu.barrier_wait(r.q_bar)
    half = r.ckv_s.shape[-1] // CONSUMERS
    row = plgpu.Layout.WGMMA.reduce(1)
    carry = (
        plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), row),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row),
    )
    n = t.num_steps
    other = 1 - w

    def own(k, carry):  # owned step o = w + 2k, after reading step o - 1
        step = w + 2 * k
        s = _scores(r, st, t, step, wait=r.ready_bar.at[other])
        carry = _read(r, st, t, w, step - 1, carry, waited=True)
        return _own(r, st, t, w, step, s, carry)

    def first(_, carry):  # consumer 0's step 0: nothing to read before it
        return _own(r, st, t, w, 0, _scores(r, st, t, 0, wait=None), carry, is_first=True)

    def last(_, carry):  # the other's last step, after this consumer's last owned one
        return _read(r, st, t, w, n - 1, carry, waited=False)

    num_owned = jnp.maximum(n - w + 1, 0) // 2
    if w == 0:
        carry = lax.fori_loop(0, jnp.minimum(n, 1), first, carry)
    carry = lax.fori_loop(1 - w, num_owned, own, carry)
    has_last = (n > 0) & (lax.rem(n - 1, 2) != w)
    carry = lax.fori_loop(0, has_last.astype(jnp.int32), last, carry)
    _epilogue(r, st, t, w, carry)


def _scores(r: _Refs, st: _Static, t: _Tile, i, *, wait) -> jax.Array:
    """f32[64, block_kv]: step ``i``'s scores in log2 units, masked (causal, past kv_len).
    ``wait`` (a barrier) is waited for while the wgmmas run."""
    slot = lax.rem(i, st.num_stages)
    plgpu.barrier_wait(r.kv_bar.at[slot])

    def scope(acc_ref):
        # NOTE: q_latent . c^T in a loop of ``latent_chunk`` columns, not one wgmma over the
        # latent: unrolled, K = 512 is 32 wgmma instructions whose Q descriptors (loop
        # invariant) were hoisted out of the KV loop and spilled, 1,092 bytes a consumer thread
        # stored and 1,220 loaded (ptxas, DeepSeek-V3's shapes; benchmarks/probes/
        # kernel_registers.py). In the loop: none.
        chunk = min(st.latent_chunk, r.ql_s.shape[-1])

        def part(k, carry):
            cols = pl.ds(pl.multiple_of(k * chunk, chunk), chunk)
            plgpu.wgmma(acc_ref, r.ql_s.at[:, cols], r.ckv_s.at[slot, :, cols].transpose((1, 0)))
            return carry

        if chunk == r.ql_s.shape[-1]:  # one wgmma over the latent (the unrolled form)
            plgpu.wgmma(acc_ref, r.ql_s, r.ckv_s.at[slot].transpose((1, 0)))
        else:
            lax.fori_loop(0, r.ql_s.shape[-1] // chunk, part, None)
        plgpu.wgmma(acc_ref, r.qpe_s, r.kpe_s.at[slot].transpose((1, 0)))
        if wait is not None:
            plgpu.barrier_wait(wait)
        return acc_ref[...]

    s = pl.run_scoped(scope, plgpu.ACC((ROWS, st.block_kv), jnp.float32))
    s = s * (st.sm_scale * LOG2E)
    shape, layout = (ROWS, st.block_kv), plgpu.Layout.WGMMA
    kv_pos = (t.s_lo + i) * st.block_kv + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    if st.block_q == 1:  # decode: every row sees the tile's positions
        limit = t.kv_hi
    else:  # row = token * block_h + head: a token sees its own position and those before
        token = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout) // st.block_h
        limit = jnp.minimum(t.pos0 + token + 1, t.kv_len)
    return jnp.where(kv_pos < limit, s, MASK_VALUE)


def _own(r: _Refs, st: _Static, t: _Tile, w: int, i, s, carry, *, is_first: bool = False):
    """The owner's part of step ``i``: the online softmax from the running max and sum, P and
    the new max and sum to shared memory for the other consumer, then its own P c product."""
    acc, m_prev, l_prev = carry
    m_new = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_new = l_prev * alpha + p.sum(axis=1)
    if not is_first:  # the previous owner's product has read the last P
        plgpu.barrier_wait(r.pfree_bar.at[1 - w])
    r.p_s[...] = p.astype(r.p_s.dtype)
    r.stats_s[0] = m_new
    r.stats_s[1] = l_new
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.ready_bar.at[w])
    acc = _pv(r, st, w, i, acc, alpha)
    _release(r, st, t, i, pfree=r.pfree_bar.at[w])
    return acc, m_new, l_new


def _read(r: _Refs, st: _Static, t: _Tile, w: int, i, carry, *, waited: bool):
    """The other consumer's step ``i``: its max and sum from shared memory, then this consumer's
    P c product (``waited``: the ready barrier was waited for during the score wgmmas)."""
    acc, m_prev, _ = carry
    if not waited:
        plgpu.barrier_wait(r.ready_bar.at[1 - w])
    slot = lax.rem(i, st.num_stages)
    plgpu.barrier_wait(r.kv_bar.at[slot])
    row = plgpu.Layout.WGMMA.reduce(1)
    m_new = plgpu.layout_cast(r.stats_s[0], row)
    l_new = plgpu.layout_cast(r.stats_s[1], row)
    acc = _pv(r, st, w, i, acc, jnp.exp2(m_prev - m_new))
    _release(r, st, t, i, pfree=None)
    return acc, m_new, l_new


def _release(r: _Refs, st: _Static, t: _Tile, i, *, pfree) -> None:
    """After step ``i``'s P c product: its ring slot (and, for its owner, P) may be
    overwritten. Only arrivals that someone waits for: every barrier phase is observed."""
    if pfree is not None:
        pl.when(i + 1 < t.num_steps)(lambda: plgpu.barrier_arrive(pfree))
    slot = r.free_bar.at[lax.rem(i, st.num_stages)]
    pl.when(i + st.num_stages < t.num_steps)(lambda: plgpu.barrier_arrive(slot))


def _pv(r: _Refs, st: _Static, w: int, i, acc, alpha) -> jax.Array:
    """``acc * alpha + P c[:, half w]`` for step ``i``: a wgmma into the rescaled accumulator
    (interpret mode: a scoped product added to it, the interpreter has no run_state)."""
    half = r.ckv_s.shape[-1] // CONSUMERS
    c_half = r.ckv_s.at[lax.rem(i, st.num_stages), :, pl.ds(w * half, half)]
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if st.interpret:

        def scoped(acc_ref):
            plgpu.wgmma(acc_ref, r.p_s, c_half)
            return acc_ref[...]

        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))

    def product(acc_ref):
        plgpu.wgmma(acc_ref, r.p_s, c_half)

    return pl.run_state(product)(plgpu.ACC.init(acc))


def _epilogue(r: _Refs, st: _Static, t: _Tile, w: int, carry) -> None:
    """Normalise this consumer's half of the output and store it (and, consumer 0, the split's
    log-sum-exp) for the tile's tokens, through the ring's shared memory once both are done."""
    acc, m_i, l_i = carry
    plgpu.barrier_arrive(r.done_bar)
    plgpu.barrier_wait(r.done_bar)  # the other consumer's last product has read the ring
    half = acc.shape[1]
    cols = pl.ds(w * half, half)
    is_empty = l_i == 0.0
    inv_l = 1.0 / jnp.where(is_empty, 1.0, l_i)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    r.o_s[w] = out.astype(r.o_s.dtype)
    is_split = r.lse is not None
    if is_split and w == 0:
        lse = jnp.where(is_empty, MASK_VALUE, m_i + jnp.log2(l_i))
        r.lse_s[...] = lax.broadcast_in_dim(lse, r.lse_s.shape, [0])
    plgpu.commit_smem()
    o_dst = r.o.at[t.split] if is_split else r.o
    heads = pl.ds(t.head0, st.block_h)
    for j in range(st.block_q):

        @pl.when(j < t.size)
        def _(j=j):
            rows = pl.ds(j * st.block_h, st.block_h)
            plgpu.copy_smem_to_gmem(r.o_s.at[w, rows], o_dst.at[t.t0 + j, heads, cols])
            if is_split and w == 0:
                lse_dst = r.lse.at[t.split, t.t0 + j, heads]
                plgpu.copy_smem_to_gmem(r.lse_s.at[rows], lse_dst)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    block_h: int
    block_q: int
    num_head_blocks: int
    max_tiles: int
    num_splits: int


def _launch_for(q_latent, ckv_pages, page_indices, config: MlaMosaicConfig) -> _Launch:
    """Head blocks, tiles and KV splits. A step with no more tokens than sequences is (nearly)
    all decodes: one token per program; a prefill puts 64 // block_h tokens in a program."""
    num_tokens, num_heads, _ = q_latent.shape
    page_size = ckv_pages.shape[1]
    num_slots, pages_per_seq = page_indices.shape
    block_h = _block_h(num_heads) or HEAD_BLOCKS[-1]
    block_q = 1 if num_tokens <= num_slots else ROWS // block_h
    num_head_blocks = num_heads // block_h
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    # One program an SM: its shared memory (225 KB at DeepSeek's latent) holds no second.
    # Counted as two, a 64-sequence decode split in two and ran 243 us against one split's 211
    # (H100, 4,096 cached tokens, benchmarks/mla.py --sweep, 2026-12-07).
    num_splits = config.num_splits or default_num_splits(
        max_tiles * num_head_blocks,
        pages_per_seq * page_size,
        config.block_kv,
        num_sms(),
        programs_per_sm=1,
    )
    return _Launch(block_h, block_q, num_head_blocks, max_tiles, num_splits)


def ragged_paged_mla_attention(
    q_latent: jax.Array,  # [T, N, L]
    q_pe: jax.Array,  # [T, N, R]
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
    config: MlaMosaicConfig = MlaMosaicConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:  # [T, N, L], q_latent's dtype
    """Mosaic GPU latent attention; see the module docstring for the work layout."""
    reason = unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages, config)
    if reason is None and (ckv_scale is not None or kpe_scale is not None):
        reason = "fp8 scales given: the Mosaic GPU kernel takes no fp8 cache"
    if reason is not None:
        raise ValueError(f"ragged_paged_mla_attention on Mosaic GPU: {reason}")
    launch = _launch_for(q_latent, ckv_pages, page_indices, config)
    is_split = launch.num_splits > 1
    plan = plan_tiles(
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        num_tokens=q_latent.shape[0],
        block_q=launch.block_q,
        max_tiles=launch.max_tiles,
        with_padding=not is_split,
    )
    st = _static_for(launch, config, ckv_pages, sm_scale, interpret is not False)
    body = functools.partial(_mla_kernel, st=st)
    outs = plgpu.kernel(
        body if is_split else _with_no_lse(body),
        out_type=_out_types(q_latent, launch.num_splits),
        scratch_types=_scratch_types(q_latent, q_pe, st),
        grid=(launch.max_tiles, launch.num_splits, launch.num_head_blocks),
        grid_names=("tile", "split", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        # NOTE: no reduction scratch (2 KB by default, past the 227 KB here): the row max and
        # sum of the wgmma layout reduce within a warp, by shuffles.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        kernel_name="ragged_paged_mla_attention",
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret,
    )(plan, page_indices.astype(jnp.int32), q_latent, q_pe, ckv_pages, kpe_pages)
    if not is_split:
        return outs[0]
    return merge_splits(outs[0], outs[1], cu_q_lens, num_seqs, out_dtype=q_latent.dtype)


def _static_for(launch: _Launch, config: MlaMosaicConfig, ckv_pages, sm_scale, interpret: bool):
    """The kernel body's static shape."""
    num_pages, page_size = ckv_pages.shape[:2]
    return _Static(
        block_h=launch.block_h,
        block_q=launch.block_q,
        block_kv=config.block_kv,
        num_stages=config.num_stages,
        num_splits=launch.num_splits,
        page_size=page_size,
        num_pages=num_pages,
        sm_scale=float(sm_scale),
        interpret=interpret,
        latent_chunk=config.latent_chunk,
    )


def _with_no_lse(body):
    """Adapt the kernel body to the unsplit launch (no lse output)."""

    def wrapped(plan, pages, ql, qpe, ckv, kpe, o, *scratch):
        return body(plan, pages, ql, qpe, ckv, kpe, o, None, *scratch)

    return wrapped


def _out_types(q_latent: jax.Array, num_splits: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``(o,)`` in q's dtype; or, when the KV is split, ``(o, lse)`` per split in float32."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype),)
    num_tokens, num_heads, latent = q_latent.shape
    return (
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads, latent), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads, LSE_COLS), jnp.float32),
    )


def _tiled(width: int, dtype) -> tuple:
    """Tiling and swizzle for wgmma operands (and TMA) of rows ``width`` elements wide."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle_for(width, itemsize)
    # jax 0.11.2: these subclass the Transform protocol without overriding transform_array,
    # whose body only raises, so mypy takes them for abstract classes; jax uses them as here.
    return (
        plgpu.TilingTransform((8, swizzle // itemsize)),  # type: ignore[abstract]
        plgpu.SwizzleTransform(swizzle),  # type: ignore[abstract]
    )


def _scratch_types(q_latent: jax.Array, q_pe: jax.Array, st: _Static) -> list:
    """The kernel body's shared memory and barriers, in its argument order (``ql_s`` to
    ``done_bar``); ``smem_bytes`` counts the same buffers."""
    dtype, latent, rope_dim = q_latent.dtype, q_latent.shape[-1], q_pe.shape[-1]
    o_dtype = jnp.float32 if st.num_splits > 1 else dtype
    stages, block_kv = st.num_stages, st.block_kv
    half = latent // CONSUMERS
    copies = 2 * (block_kv // min(st.page_size, block_kv))  # c_kv and k_pe, a copy per page
    ring = (
        plgpu.SMEM((stages, block_kv, latent), dtype, transforms=_tiled(latent, dtype)),
        plgpu.SMEM((stages, block_kv, rope_dim), dtype, transforms=_tiled(rope_dim, dtype)),
    )
    out = (
        plgpu.SMEM((CONSUMERS, ROWS, half), o_dtype, transforms=_tiled(half, o_dtype)),
        plgpu.SMEM((ROWS, LSE_COLS), jnp.float32),
    )
    return [
        plgpu.SMEM((ROWS, latent), dtype, transforms=_tiled(latent, dtype)),
        plgpu.SMEM((ROWS, rope_dim), dtype, transforms=_tiled(rope_dim, dtype)),
        plgpu.RefUnion(ring, out),
        plgpu.SMEM((ROWS, block_kv), dtype, transforms=_tiled(block_kv, dtype)),
        plgpu.SMEM((2, ROWS), jnp.float32),
        plgpu.Barrier(num_arrivals=2 * st.block_q),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),
        plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),
        plgpu.Barrier(num_arrivals=CONSUMERS),
    ]


def temporary_bytes(
    num_tokens: int,
    num_heads: int,  # per device
    latent: int,  # L
    rope_dim: int,  # R
    page_size: int,
    pages_per_seq: int,
    cache_itemsize: int,  # the page arrays' element size (read in place: no copy)
    q_itemsize: int,  # the query's and output's
) -> int:
    """What one call allocates besides its inputs, at most (``runner/capacity.py`` reserves
    it for the kernel's path): the output [T, N, L] in q's dtype and, when the KV range is
    split, the float32 partial outputs [splits, T, N, L] and log-sum-exps [splits, T, N, 32];
    the pages are read in place. The split count is the most either layout takes for
    ``num_tokens`` (decodes: a token a tile; a prefill: tiles of 64 // block_h tokens)."""
    del rope_dim, cache_itemsize  # read in place
    shape = jax.ShapeDtypeStruct
    q = shape((num_tokens, num_heads, latent), jnp.bfloat16)
    pages = shape((1, page_size, 1, latent), jnp.bfloat16)
    splits = max(
        _launch_for(
            q, pages, shape((slots, pages_per_seq), jnp.int32), MlaMosaicConfig()
        ).num_splits
        for slots in (num_tokens, 1)  # all decodes; one prompt
    )
    rows = num_tokens * num_heads
    out = rows * latent * q_itemsize
    return out + (splits * rows * (latent + LSE_COLS) * 4 if splits > 1 else 0)
