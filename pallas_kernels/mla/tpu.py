"""Ragged paged multi-head latent attention (DeepSeek-V2/V3) as a Pallas Mosaic TPU kernel.

Same signature and semantics as ``reference.ragged_paged_mla_attention`` (plus ``config`` and
``interpret``): each query row scores ``q_latent . c_kv + q_pe . k_pe`` against its sequence's
cached latents, causally, and returns the probability-weighted latent [T, N, L].

Work decomposition. The latent is one KV head shared by every query head, so a program owns
``rows = block_q tokens x block_h heads`` (token-major) of one query tile, the tiles being the
other kernels' tile plan (``mosaic_gpu.plan_tiles``: each sequence's new tokens, and the
padding rows, cut into tiles of ``block_q``). A decode step (no more tokens than sequences)
takes one token and up to 128 heads a program (the MXU's rows); a prefill or mixed step 256
rows (2 tokens x 128 heads, 16 x 16 at a TP-8 shard). The grid is (tiles, head blocks), both
``parallel``; a tile past the plan's end does nothing.

Data flow. Everything but the scales stays in HBM (``pl.ANY``): the program DMAs its tokens'
``q_latent`` [block_h, L] and ``q_pe`` [block_h, R] rows into VMEM (token by token: a tile
starts at any token), then walks its sequence's pages ``pages_per_block`` at a time, each page
of ``c_kv`` [page_size, L] and ``k_pe`` [page_size, R] DMA'd through the page table (scalar
prefetch: the tile plan and the flat page table, in SMEM) into one of two VMEM slots while the
other slot is in use. Only the pages below the tile's last causal position are fetched. One
load of ``c_kv`` feeds both dots on the MXU, ``s = q_latent c^T + q_pe k_pe^T`` (float32),
then ``acc += p c``, with an online softmax (running max, sum and accumulator in VMEM scratch,
float32) and the causal mask from each row's position. The result goes back through the query's
VMEM buffer and one DMA per token. ``k_pe`` and ``q_pe`` are padded to a multiple of 128 lanes
in VMEM (a zeroed scratch, written at lanes [0, R)), never in HBM; the latent must be a multiple
of 128 lanes and the page size of 16 rows (a bf16 VMEM tile), so a block of pages is one
``[block_kv, L]`` operand without a relayout.

An fp8 cache (e4m3 or e5m2, per-tensor ``ckv_scale`` / ``kpe_scale``) is fetched as stored and
converted to the query's dtype in VMEM (exact for e4m3 into bf16); the scales multiply the two
float32 score terms and the output, as the reference's ``page * scale``.

What is verified: ``tests/test_mla_tpu.py`` runs the kernel in TPU interpret mode on the CPU
(simulated HBM, VMEM, DMAs and semaphores, NaN-filled fresh VMEM, the parallel grid in random
order, the race detector) against the reference, and lowers it to Mosaic MLIR at DeepSeek-V3's
shapes. It has not been compiled by Mosaic's backend or run on a TPU: the reshapes of the VMEM
buffers, the fp8 conversion and the lane-padding stores are Mosaic's to accept, and dropping
the cache's one KV head (``[P, page_size, 1, D] -> [P, page_size, D]``) is a bitcast only if
XLA lays the 4-D page array out as the 3-D one (else a copy of the cache each call). Untuned;
not done: a program's first KV fetch does not overlap the previous program's work, the KV range
is never split (one core streams a batch-1 decode; v5p / v7x have two), the flat page table
lives in SMEM (sequences x pages_per_seq x 4 bytes must fit it), and a 16-head decode block
fills an eighth of a 128-row MXU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache import FP8_DTYPES, Scale, stacked_scales
from pallas_kernels.ragged_paged_attention.mosaic_gpu import max_tiles_for, plan_tiles

MASK_VALUE = -1e30  # finite, so fully masked rows never produce inf - inf
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
LANES = 128  # a vreg's lanes: the minor dim of every VMEM operand is a multiple of it
PAGE_ROWS = 16  # a bf16 VMEM tile's rows: pages stack into one operand without a relayout
MAX_LATENT = 2048  # DeepSeek-V2/V3: 512
MAX_ROPE = 256  # DeepSeek-V2/V3: 64
DECODE_BLOCK_H = 128  # query heads per decode program: the MXU's rows (v5e: 128 x 128)
PREFILL_ROWS = 256  # query rows (tokens x heads) per prefill program
BLOCK_KV = 256  # cached tokens per KV step (a [256, 512] bf16 c_kv tile: 256 KiB a slot)
STAT_LANES = 128  # the running max and sum, broadcast over a vreg's lanes (unmasked stores)
NUM_PLAN_ROWS = 5  # the tile plan: seq, first token, tokens, first position, kv_len


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of n that is at most limit."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class MlaTpuConfig:
    """Static tuning knobs; ``None`` picks a value from the shapes (``_launch_for``)."""

    block_h: int | None = None  # query heads per program (a divisor of the head count)
    block_rows: int | None = None  # rows per prefill program (block_q tokens x block_h heads)
    block_kv: int | None = None  # cached tokens per KV step (rounded down to whole pages)

    def __post_init__(self):
        for name in ("block_h", "block_rows", "block_kv"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")


def unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages) -> str | None:
    """Why this call cannot run on the kernel (the caller falls back to the reference); only
    shapes and dtypes count. Arrays or ``jax.ShapeDtypeStruct``s."""
    q_dtype, cache_dtype = jnp.dtype(q_latent.dtype), jnp.dtype(ckv_pages.dtype)
    if q_dtype not in DTYPES or jnp.dtype(q_pe.dtype) != q_dtype:
        return f"query dtype {q_dtype}: the TPU kernel takes bfloat16 or float32"
    if cache_dtype != q_dtype and cache_dtype not in FP8_DTYPES:
        return f"cache dtype {cache_dtype}: the TPU kernel takes the query's dtype or fp8"
    if jnp.dtype(kpe_pages.dtype) != cache_dtype:
        return f"k_pe cache dtype {kpe_pages.dtype} must be the latent's ({cache_dtype})"
    latent, rope_dim = ckv_pages.shape[-1], kpe_pages.shape[-1]
    if latent % LANES or not LANES <= latent <= MAX_LATENT:
        return (
            f"kv_lora_rank={latent}: the TPU kernel takes multiples of {LANES} up to {MAX_LATENT}"
        )
    if rope_dim % 8 or not 8 <= rope_dim <= MAX_ROPE:
        return f"qk_rope_head_dim={rope_dim}: the TPU kernel takes multiples of 8 up to {MAX_ROPE}"
    if ckv_pages.shape[2] != 1 or kpe_pages.shape[2] != 1:
        return f"latent pages {ckv_pages.shape}: one KV head expected"
    page_size = ckv_pages.shape[1]
    if page_size % PAGE_ROWS or kpe_pages.shape[1] != page_size:
        return f"page_size={page_size}: the TPU kernel takes multiples of {PAGE_ROWS}"
    return None


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    block_h: int  # query heads per program
    block_q: int  # query tokens per tile
    pages_per_block: int  # pages per KV step
    num_head_blocks: int
    max_tiles: int

    @property
    def rows(self) -> int:
        return self.block_q * self.block_h


def _launch_for(
    num_tokens: int, num_heads: int, page_size: int, page_table: tuple[int, ...], config
) -> _Launch:
    """Head blocks, tiles and KV steps for this call (``config``'s where it gives them). A step
    with no more tokens than sequences is (nearly) all decodes: one token a program; a prefill
    takes ``PREFILL_ROWS`` rows of tokens x heads, to reuse each fetched page more."""
    num_slots, pages_per_seq = page_table
    block_h = _largest_divisor(num_heads, config.block_h or DECODE_BLOCK_H)
    if num_tokens <= num_slots:
        block_q = 1
    else:
        block_q = max(1, (config.block_rows or PREFILL_ROWS) // block_h)
    pages = max(1, min((config.block_kv or BLOCK_KV) // page_size, pages_per_seq))
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    return _Launch(block_h, block_q, pages, num_heads // block_h, max_tiles)


class _Refs(NamedTuple):
    """One program's refs: HBM inputs and output, VMEM scratch, semaphores."""

    ql_hbm: Any  # [T, N, L]
    qpe_hbm: Any  # [T, N, R]
    ckv_hbm: Any  # [P, page_size, L]
    kpe_hbm: Any  # [P, page_size, R]
    scales: Any  # f32[2] SMEM: ckv_scale, kpe_scale
    o_hbm: Any  # [T, N, L]
    q_buf: Any  # [block_q, block_h, L] VMEM: the tile's q_latent, then its output
    qpe_buf: Any  # [block_q, block_h, R]
    c_buf: Any  # [2, pages_per_block, page_size, L] (the cache's dtype)
    k_buf: Any  # [2, pages_per_block, page_size, R]
    run_max: Any  # f32[rows, STAT_LANES]
    run_sum: Any  # f32[rows, STAT_LANES]
    acc: Any  # f32[rows, L] running, unnormalised output
    sems: Any  # DMA semaphores [3]: the two KV slots, the query / output rows
    qpe_pad: Any  # [rows, Rp] VMEM, q_pe with zero lanes past R; None when R % 128 == 0
    kpe_pad: Any  # [block_kv, Rp], likewise for a KV block's k_pe
    pages: Any  # i32[S * pages_per_seq] SMEM: the flat page table (scalar prefetch)


class _Tile(NamedTuple):
    """One program's scalars (i32, from SMEM) and static sizes."""

    seq: Any  # the sequence slot
    t0: Any  # its first token
    size: Any  # its tokens (0: a tile past the plan's end)
    pos0: Any  # the first token's position in its sequence
    kv_len: Any  # the sequence's cached tokens, the new ones included
    head0: Any  # the first query head of the program's block
    block_q: int
    block_h: int
    pages_per_seq: int

    @property
    def kv_hi(self):
        """One past the last position any of the tile's rows sees."""
        return jnp.clip(self.pos0 + self.size, 0, self.kv_len)


def _row_copies(refs: _Refs, tile: _Tile, *, inbound: bool):
    """(is_live, copies) per token row of the tile: the rows of q_latent and q_pe into VMEM
    (inbound), or the output's rows back to HBM."""
    num_tokens = refs.ql_hbm.shape[0]
    heads = pl.ds(tile.head0, tile.block_h)
    sem = refs.sems.at[2]
    rows = []
    for i in range(tile.block_q):
        token = jnp.minimum(tile.t0 + i, num_tokens - 1)
        copies: tuple[Any, ...]
        if inbound:
            copies = (
                pltpu.make_async_copy(refs.ql_hbm.at[token, heads], refs.q_buf.at[i], sem),
                pltpu.make_async_copy(refs.qpe_hbm.at[token, heads], refs.qpe_buf.at[i], sem),
            )
        else:
            copies = (pltpu.make_async_copy(refs.q_buf.at[i], refs.o_hbm.at[token, heads], sem),)
        rows.append((i < tile.size, copies))
    return rows


def _page_copies(refs: _Refs, tile: _Tile, block, slot):
    """(is_needed, copies) per page of KV block ``block`` into ``slot``: c_kv and k_pe. A page
    is needed when it holds a position below the tile's ``kv_hi``."""
    _, pages_per_block, page_size, _ = refs.c_buf.shape
    sem = refs.sems.at[slot]
    pages = []
    for i in range(pages_per_block):
        page = block * pages_per_block + i
        slot_in_table = jnp.minimum(page, tile.pages_per_seq - 1)
        page_id = refs.pages[tile.seq * tile.pages_per_seq + slot_in_table]
        copies = (
            pltpu.make_async_copy(refs.ckv_hbm.at[page_id], refs.c_buf.at[slot, i], sem),
            pltpu.make_async_copy(refs.kpe_hbm.at[page_id], refs.k_buf.at[slot, i], sem),
        )
        pages.append((page * page_size < tile.kv_hi, copies))
    return pages


def _start(copies) -> None:
    for is_live, group in copies:
        for copy in group:
            pl.when(is_live)(copy.start)


def _wait(copies) -> None:
    for is_live, group in copies:
        for copy in group:
            pl.when(is_live)(copy.wait)


def _query(refs: _Refs, rows: int):
    """The tile's ``q_latent`` [rows, L] and ``q_pe`` [rows, Rp] (lanes past R zero)."""
    q_lat = refs.q_buf[...].reshape(rows, refs.q_buf.shape[-1])
    q_pe = refs.qpe_buf[...].reshape(rows, refs.qpe_buf.shape[-1])
    if refs.qpe_pad is None:
        return q_lat, q_pe
    refs.qpe_pad[:, : q_pe.shape[1]] = q_pe
    return q_lat, refs.qpe_pad[...]


def _row_tokens(shape: tuple[int, ...], block_q: int, block_h: int) -> jax.Array:
    """i32[shape]: each row's token within the tile (row = token * block_h + head), without a
    vector division (the VPU has none): a shift for a power-of-two block_h, else compares."""
    if block_q == 1:
        return jnp.zeros(shape, jnp.int32)
    row = lax.broadcasted_iota(jnp.int32, shape, 0)
    if block_h & (block_h - 1) == 0:
        return lax.shift_right_logical(row, jnp.int32(block_h.bit_length() - 1))
    return sum(((row >= i * block_h).astype(jnp.int32) for i in range(1, block_q)), start=row * 0)


def _fold(refs: _Refs, tile: _Tile, block, slot, *, sm_scale: float, is_scaled: bool) -> None:
    """Fold KV block ``block`` (in ``slot``) into the online softmax of the tile's rows."""
    _, pages_per_block, page_size, latent = refs.c_buf.shape
    rope_dim = refs.k_buf.shape[-1]
    block_kv = pages_per_block * page_size
    rows = tile.block_q * tile.block_h
    q_lat, q_pe = _query(refs, rows)
    kv_start = block * block_kv
    # Positions at or past kv_hi were not fetched (stale or NaN): zero c there, since masked
    # probabilities are 0 but 0 * NaN is not. k_pe's scores are masked instead.
    c_pos = kv_start + lax.broadcasted_iota(jnp.int32, (block_kv, latent), 0)
    # fp8: converted page by page, then the pages stacked (16-row bf16 tiles: no relayout).
    c = refs.c_buf[slot].astype(q_lat.dtype).reshape(block_kv, latent)
    c = jnp.where(c_pos < tile.kv_hi, c, jnp.zeros_like(c))
    k_pe = refs.k_buf[slot].astype(q_pe.dtype).reshape(block_kv, rope_dim)
    if refs.kpe_pad is not None:
        refs.kpe_pad[:, :rope_dim] = k_pe
        k_pe = refs.kpe_pad[...]
    nt = (((1,), (1,)), ((), ()))  # a @ b.T
    s_lat = lax.dot_general(q_lat, c, nt, preferred_element_type=jnp.float32)
    s_pe = lax.dot_general(q_pe, k_pe, nt, preferred_element_type=jnp.float32)
    if is_scaled:
        s_lat, s_pe = s_lat * refs.scales[0], s_pe * refs.scales[1]
    scores = (s_lat + s_pe) * sm_scale  # f32[rows, block_kv]
    token = _row_tokens(scores.shape, tile.block_q, tile.block_h)
    col = kv_start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    mask = (token < tile.size) & (col <= tile.pos0 + token) & (col < tile.kv_len)
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_prev, l_prev = refs.run_max[...], refs.run_sum[...]  # f32[rows, STAT_LANES]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    probs = jnp.where(mask, jnp.exp(scores - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    refs.run_sum[...] = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
    refs.run_max[...] = m_next
    pv = jnp.dot(probs.astype(c.dtype), c, preferred_element_type=jnp.float32)
    refs.acc[...] = alpha[:, :1] * refs.acc[...] + pv


def _walk_kv(refs: _Refs, tile: _Tile, fold) -> None:
    """Every KV block the tile needs, double-buffered: block b + 1's pages are in flight
    while block b is folded."""
    block_kv = refs.c_buf.shape[1] * refs.c_buf.shape[2]
    num_blocks = pl.cdiv(tile.kv_hi, block_kv)

    @pl.when(num_blocks > 0)
    def _first():
        _start(_page_copies(refs, tile, 0, 0))

    def step(block, carry):
        slot = lax.rem(block, 2)

        @pl.when(block + 1 < num_blocks)
        def _next():
            _start(_page_copies(refs, tile, block + 1, 1 - slot))

        _wait(_page_copies(refs, tile, block, slot))
        fold(block, slot)
        return carry

    lax.fori_loop(0, num_blocks, step, jnp.int32(0))


def _mla_kernel(
    plan_ref,  # i32[5 * max_tiles] SMEM (scalar prefetch): the tile plan, row-major
    pages_ref,  # i32[S * pages_per_seq] SMEM (scalar prefetch)
    *refs_in,  # the _Refs fields from ql_hbm on, pads included
    block_q: int,
    block_h: int,
    pages_per_seq: int,
    sm_scale: float,
    is_scaled: bool,
):
    pads = refs_in[14:]  # (qpe_pad, kpe_pad) where R is not a multiple of 128 lanes
    refs = _Refs._make([*refs_in[:14], *(pads or (None, None)), pages_ref])
    max_tiles = plan_ref.shape[0] // NUM_PLAN_ROWS
    tile_index = pl.program_id(0)
    plan = [plan_ref[i * max_tiles + tile_index] for i in range(NUM_PLAN_ROWS)]
    tile = _Tile._make([*plan, pl.program_id(1) * block_h, block_q, block_h, pages_per_seq])

    @pl.when(tile.size > 0)
    def _program():
        inbound = _row_copies(refs, tile, inbound=True)
        _start(inbound)
        refs.run_max[...] = jnp.full(refs.run_max.shape, MASK_VALUE, jnp.float32)
        refs.run_sum[...] = jnp.zeros(refs.run_sum.shape, jnp.float32)
        refs.acc[...] = jnp.zeros(refs.acc.shape, jnp.float32)
        for pad in pads:  # the lanes past R stay zero
            pad[...] = jnp.zeros(pad.shape, pad.dtype)
        _wait(inbound)
        fold = functools.partial(_fold, refs, tile, sm_scale=sm_scale, is_scaled=is_scaled)
        _walk_kv(refs, tile, fold)
        row_sum = refs.run_sum[...][:, :1]  # f32[rows, 1]; 0 for a row that saw no position
        out = refs.acc[...] / jnp.where(row_sum == 0.0, 1.0, row_sum)
        if is_scaled:
            out = out * refs.scales[0]
        refs.q_buf[...] = out.reshape(refs.q_buf.shape).astype(refs.q_buf.dtype)
        outbound = _row_copies(refs, tile, inbound=False)
        _start(outbound)
        _wait(outbound)


def _grid_spec(launch: _Launch, q_latent, q_pe, ckv_pages) -> pltpu.PrefetchScalarGridSpec:
    """Grid (tiles, head blocks); 2 scalar-prefetch operands (the plan, the page table); the
    queries, pages and output in HBM, the scales in SMEM; the VMEM scratch of ``_Refs``."""
    _, _, latent = q_latent.shape
    rope_dim = q_pe.shape[-1]
    page_size, cache_dtype = ckv_pages.shape[1], ckv_pages.dtype
    block_kv = launch.pages_per_block * page_size
    slots = (2, launch.pages_per_block, page_size)
    rope_pad = _round_up(rope_dim, LANES)
    pads = []
    if rope_pad != rope_dim:
        pads = [pltpu.VMEM((launch.rows, rope_pad), q_pe.dtype)]
        pads.append(pltpu.VMEM((block_kv, rope_pad), q_pe.dtype))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(launch.max_tiles, launch.num_head_blocks),
        in_specs=[hbm, hbm, hbm, hbm, pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=hbm,
        scratch_shapes=[
            pltpu.VMEM((launch.block_q, launch.block_h, latent), q_latent.dtype),
            pltpu.VMEM((launch.block_q, launch.block_h, rope_dim), q_pe.dtype),
            pltpu.VMEM((*slots, latent), cache_dtype),
            pltpu.VMEM((*slots, rope_dim), cache_dtype),
            pltpu.VMEM((launch.rows, STAT_LANES), jnp.float32),
            pltpu.VMEM((launch.rows, STAT_LANES), jnp.float32),
            pltpu.VMEM((launch.rows, latent), jnp.float32),
            pltpu.SemaphoreType.DMA((3,)),
            *pads,
        ],
    )


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
    config: MlaTpuConfig = MlaTpuConfig(),
    interpret: bool | pltpu.InterpretParams = False,  # True: TPU interpret mode's defaults
) -> jax.Array:  # [T, N, L], q_latent's dtype
    """Mosaic TPU latent attention; see the module docstring for the work layout."""
    reason = unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        raise ValueError(f"ragged_paged_mla_attention on Mosaic TPU: {reason}")
    num_tokens, num_heads, _ = q_latent.shape
    num_pages, page_size = ckv_pages.shape[:2]
    launch = _launch_for(num_tokens, num_heads, page_size, page_indices.shape, config)
    plan = plan_tiles(
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        num_tokens=num_tokens,
        block_q=launch.block_q,
        max_tiles=launch.max_tiles,
        with_padding=True,  # the padding rows' tiles write their zeros
    )
    is_scaled = ckv_scale is not None or kpe_scale is not None
    kernel = functools.partial(
        _mla_kernel,
        block_q=launch.block_q,
        block_h=launch.block_h,
        pages_per_seq=page_indices.shape[1],
        sm_scale=float(sm_scale),
        is_scaled=is_scaled,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=_grid_spec(launch, q_latent, q_pe, ckv_pages),
        out_shape=jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="ragged_paged_mla_attention_tpu",
    )(
        plan.reshape(-1),
        page_indices.astype(jnp.int32).reshape(-1),
        q_latent,
        q_pe,
        # The one KV head dropped: a page is [page_size, D], rows on sublanes, D on lanes.
        ckv_pages.reshape(num_pages, page_size, ckv_pages.shape[-1]),
        kpe_pages.reshape(num_pages, page_size, kpe_pages.shape[-1]),
        stacked_scales(ckv_scale, kpe_scale),
    )


def vmem_bytes(
    num_tokens: int,
    num_heads: int,  # per device
    latent: int,  # L
    rope_dim: int,  # R
    page_size: int,
    pages_per_seq: int,
    cache_itemsize: int,
    q_itemsize: int,
    num_slots: int = 1,  # sequences: a step of no more tokens than this is a decode step
    config: MlaTpuConfig = MlaTpuConfig(),
) -> int:
    """A program's VMEM, about: its scratch (the query tile, reused for the output; the two
    KV slots; the softmax's max, sum and float32 accumulator; the lane-padded q_pe and k_pe)
    and the largest values a KV step holds (the converted, masked c_kv tile, scores and
    probabilities, the p . c product, the converted k_pe). Minor dims count as the 128 lanes
    VMEM stores them in."""
    launch = _launch_for(num_tokens, num_heads, page_size, (num_slots, pages_per_seq), config)
    rows, block_kv = launch.rows, launch.pages_per_block * page_size
    rope_lanes = _round_up(rope_dim, LANES)
    scratch = rows * (latent + rope_lanes) * q_itemsize  # q_latent, q_pe
    scratch += 2 * block_kv * (latent + rope_lanes) * cache_itemsize  # the KV slots
    scratch += rows * (2 * STAT_LANES + latent) * 4  # max, sum, accumulator
    if rope_lanes != rope_dim:
        scratch += (rows + block_kv) * rope_lanes * q_itemsize  # the padded q_pe, k_pe
    values = 2 * block_kv * latent * q_itemsize + block_kv * rope_lanes * q_itemsize
    values += 3 * rows * block_kv * 4 + rows * latent * 4
    return scratch + values


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
    it for the kernel's path): the output [T, N, L] in q's dtype and the tile plan (i32[5,
    tiles], tiles <= T, and the stack it is built from). The pages are read in place (dropping
    their one KV head is a reshape), the queries DMA'd from where they are; VMEM is not HBM."""
    del rope_dim, page_size, pages_per_seq, cache_itemsize  # read in place
    return num_tokens * num_heads * latent * q_itemsize + 2 * NUM_PLAN_ROWS * num_tokens * 4
