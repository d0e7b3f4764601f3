"""Ragged paged multi-head latent attention (DeepSeek-V2/V3) as a Pallas Triton kernel.

Same signature and semantics as ``reference.ragged_paged_mla_attention``: each query row scores
``q_latent . c_kv + q_pe . k_pe`` against its sequence's cached latents, causally, and returns
the probability-weighted latent. The absorbed projections stay outside (``models/mla.py``).

Work decomposition (FlashMLA's, in Triton). The latent is one KV head shared by every query
head, so a program takes a block of query heads: ``rows = block_q tokens x block_h heads``
(token-major), its ``q_latent`` [rows, L] and ``q_pe`` [rows, R] gathered with masked loads.
A decode token (``block_q = 1``) puts up to 64 of its heads in one program; a prefill chunk
takes ``block_q`` consecutive tokens of one sequence (the tile plan of the other attention
kernels, ``mosaic_gpu.plan_tiles``). The program walks the sequence's pages ``block_kv`` tokens
a step, gathering each step's c_kv [block_kv, L] and k_pe [block_kv, R] through the page table
once for all its rows, with an online (flash) softmax in registers; c_kv is both the key's
latent part and the value, so one load serves both dots. L and R are padded to powers of two in
registers (masked loads, never in memory).

The grid is (head blocks, tiles, KV splits) with the head blocks fastest: the programs of one
tile run side by side and read the same pages, so past the first the latent comes from L2 and
HBM sees it about once per (sequence, query block). Small batches split the KV range
``num_splits`` ways (partial outputs and log-sum-exps merged by ``splits.merge_splits``).

An fp8 cache (e4m3 or e5m2, per-tensor scales ``ckv_scale`` / ``kpe_scale``): each tile is
converted to the query's dtype (exact for e4m3 into bf16) and the dots run as for bf16; the
scales multiply the two score terms and the output, as the reference's ``page * scale``.
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

from pallas_kernels.kv_cache import FP8_DTYPES, Scale, stacked_scales
from pallas_kernels.ragged_paged_attention.mosaic_gpu import max_tiles_for, plan_tiles
from pallas_kernels.ragged_paged_attention.splits import merge_splits
from pallas_kernels.ragged_paged_attention.triton import default_num_splits, num_sms

LOG2E = math.log2(math.e)
MASK_VALUE = -1e30  # finite, so fully masked rows never produce inf - inf
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_LATENT = 1024  # DeepSeek-V2/V3: 512
MAX_ROPE = 256  # DeepSeek-V2/V3: 64
DECODE_BLOCK_H = 64  # query heads per decode program, as FlashMLA
PREFILL_ROWS = 64  # query rows (tokens x heads) per prefill program


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Static tuning knobs; ``None`` picks a value from the shapes (``_launch_for``)."""

    block_h: int | None = None  # query heads per program
    block_rows: int | None = None  # rows per program (block_q tokens x block_h heads)
    block_kv: int | None = None  # cached tokens a step
    num_splits: int | None = None  # of each tile's KV range
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_h", "block_rows", "block_kv"):
            value = getattr(self, name)
            low = 1 if name == "block_h" else 16
            if value is not None and (value < low or not _is_pow2(value)):
                raise ValueError(f"{name}={value} must be a power of two >= {low}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages={self.num_stages} must be in [1, 8]")


def _converts_e4m3() -> bool:
    """Whether the GPU (if this is one) converts e4m3 in Triton: Ada, Hopper or newer."""
    if jax.default_backend() != "gpu":
        return True  # interpret mode converts anywhere
    major, _, minor = str(getattr(jax.devices()[0], "compute_capability", "0.0")).partition(".")
    return (int(major or 0), int(minor or 0)) >= (8, 9)


def unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages) -> str | None:
    """Why this call cannot run on the kernel (the caller falls back to the reference); only
    shapes and dtypes count. Arrays or ``jax.ShapeDtypeStruct``s."""
    q_dtype, cache_dtype = jnp.dtype(q_latent.dtype), jnp.dtype(ckv_pages.dtype)
    if q_dtype not in DTYPES or jnp.dtype(q_pe.dtype) != q_dtype:
        return f"query dtype {q_dtype}: the kernel takes bfloat16 or float16"
    if cache_dtype != q_dtype and cache_dtype not in FP8_DTYPES:
        return f"cache dtype {cache_dtype}: the kernel takes the query's dtype or fp8"
    if cache_dtype == jnp.float8_e4m3fn and not _converts_e4m3():
        return "an e4m3 cache: Triton converts it on compute capability 8.9 or newer only"
    if jnp.dtype(kpe_pages.dtype) != cache_dtype:
        return f"k_pe cache dtype {kpe_pages.dtype} must be the latent's ({cache_dtype})"
    latent, rope_dim = ckv_pages.shape[-1], kpe_pages.shape[-1]
    if latent % 16 or not 16 <= latent <= MAX_LATENT:
        return f"kv_lora_rank={latent}: the kernel takes multiples of 16 up to {MAX_LATENT}"
    if rope_dim % 8 or not 8 <= rope_dim <= MAX_ROPE:
        return f"qk_rope_head_dim={rope_dim}: the kernel takes multiples of 8 up to {MAX_ROPE}"
    if ckv_pages.shape[2] != 1 or kpe_pages.shape[2] != 1:
        return f"latent pages {ckv_pages.shape}: one KV head expected"
    return None


def _mla_kernel(
    plan_ref,  # i32[5, max_tiles]: seq, first token, tokens, first position, kv_len
    pages_ref,  # i32[S, pages_per_seq]
    scales_ref,  # f32[2]: ckv_scale, kpe_scale (read only for an fp8 cache)
    ql_ref,  # [T, N, L]
    qpe_ref,  # [T, N, R]
    ckv_ref,  # [P, page_size, 1, L]
    kpe_ref,  # [P, page_size, 1, R]
    o_ref,  # [T, N, Lp] (q dtype), or f32[num_splits, T, N, Lp]
    lse_ref,  # f32[num_splits, T, N] or None
    *,
    block_h: int,
    rows: int,
    block_kv: int,
    num_splits: int,
    sm_scale: float,
    is_scaled: bool,
):
    head_block, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens, num_heads, latent = ql_ref.shape
    rope_dim = qpe_ref.shape[-1]
    num_pages, page_size = ckv_ref.shape[:2]
    pages_per_seq = pages_ref.shape[1]
    lp, rp = _next_pow2(latent), max(16, _next_pow2(rope_dim))  # a dot's K is >= 16

    seq, t0, size, pos0, kv_len = (plan_ref[i, tile] for i in range(5))

    r = jnp.arange(rows, dtype=jnp.int32)  # i32[rows]  row = token * block_h + h
    row_token = r // block_h
    head = head_block * block_h + r % block_h  # i32[rows]
    is_row = (row_token < size) & (head < num_heads)  # bool[rows]
    token = jnp.minimum(t0 + row_token, num_tokens - 1)[:, None]  # i32[rows, 1]
    head_c = jnp.minimum(head, num_heads - 1)[:, None]  # i32[rows, 1]
    row_pos = pos0 + row_token  # i32[rows]
    dl = jnp.arange(lp, dtype=jnp.int32)  # i32[Lp]
    dr = jnp.arange(rp, dtype=jnp.int32)  # i32[Rp]
    is_l, is_r = dl < latent, dr < rope_dim

    q_lat = pltriton.load(
        ql_ref.at[token, head_c, dl[None, :]], mask=is_row[:, None] & is_l[None, :], other=0.0
    )  # [rows, Lp]
    q_pe = pltriton.load(
        qpe_ref.at[token, head_c, dr[None, :]], mask=is_row[:, None] & is_r[None, :], other=0.0
    )  # [rows, Rp]
    score_scale = sm_scale * LOG2E  # exp2 below
    ckv_scale = scales_ref[0] if is_scaled else None
    kpe_scale = scales_ref[1] if is_scaled else None

    kv_hi = jnp.clip(pos0 + size, 0, kv_len)  # the tile's last row sees kv_hi - 1
    num_blocks = jnp.where(size > 0, (kv_hi + block_kv - 1) // block_kv, 0)
    s_lo = num_blocks * split // num_splits
    s_hi = num_blocks * (split + 1) // num_splits

    def step(block, carry):
        acc, m_i, l_i = carry
        kv_pos = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[block_kv]
        is_kv = kv_pos < kv_hi
        slot = jnp.minimum(kv_pos // page_size, pages_per_seq - 1)
        page = pltriton.load(pages_ref.at[seq, slot], mask=is_kv, other=0)
        page = jnp.clip(page, 0, num_pages - 1)[:, None]  # i32[block_kv, 1]
        offset = (kv_pos % page_size)[:, None]
        c = pltriton.load(
            ckv_ref.at[page, offset, 0, dl[None, :]],
            mask=is_kv[:, None] & is_l[None, :],
            other=0.0,
        ).astype(q_lat.dtype)  # [block_kv, Lp]: key (latent part) and value
        k_pe = pltriton.load(
            kpe_ref.at[page, offset, 0, dr[None, :]],
            mask=is_kv[:, None] & is_r[None, :],
            other=0.0,
        ).astype(q_pe.dtype)  # [block_kv, Rp]
        s_lat = pltriton.dot(q_lat, c, trans_b=True)  # f32[rows, block_kv]
        s_pe = pltriton.dot(q_pe, k_pe, trans_b=True)
        if is_scaled:
            s = (s_lat * ckv_scale + s_pe * kpe_scale) * score_scale
        else:
            s = (s_lat + s_pe) * score_scale
        mask = (kv_pos[None, :] <= row_pos[:, None]) & is_kv[None, :]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(c.dtype), c)
        return acc, m_new, l_i

    carry = (
        jnp.zeros((rows, lp), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m_i, l_i = lax.fori_loop(s_lo, s_hi, step, carry)

    is_empty = l_i == 0.0
    out = acc / jnp.where(is_empty, 1.0, l_i)[:, None]
    if is_scaled:
        out = out * ckv_scale
    # NOTE: a masked row stores to token T, past the end, as in the ragged Triton kernel: no
    # masked lane aliases a live element (interpret mode writes masked lanes back).
    out_token = jnp.where(is_row[:, None], token, num_tokens)  # i32[rows, 1]
    if lse_ref is None:
        o_view = o_ref.at[out_token, head_c, dl[None, :]]
    else:
        o_view = o_ref.at[split, out_token, head_c, dl[None, :]]
        lse = jnp.where(is_empty, MASK_VALUE, m_i + jnp.log2(jnp.where(is_empty, 1.0, l_i)))
        pltriton.store(lse_ref.at[split, out_token[:, 0], head_c[:, 0]], lse, mask=is_row)
    pltriton.store(o_view, out.astype(o_ref.dtype), mask=is_row[:, None])


class _Launch(NamedTuple):
    """The static shape of one launch, from the shapes and the config."""

    block_h: int  # query heads per program
    rows: int  # block_q tokens x block_h heads
    block_q: int  # query tokens per tile
    block_kv: int
    num_warps: int
    num_head_blocks: int
    max_tiles: int
    num_splits: int


def default_block_kv(latent: int) -> int:
    """Cached tokens a step: 64 (at DeepSeek's 512-wide latent a bf16 c_kv tile of 64 KB, two
    pipeline stages in shared memory beside k_pe), 32 above 512.

    NOTE: measured on the H200 at DeepSeek-V3's shapes (benchmarks/mla.py --sweep, 2026-12-05):
    64 tokens a step beat 32 at every decode cell of batch 64 and 256 (14-22% faster, e.g.
    564 -> 483 us at 64 x 4,096) and at the 2,048-token prefill (3.80 -> 3.07 ms)."""
    return 32 if _next_pow2(latent) > 512 else 64


def _launch_for(q_latent, ckv_pages, page_indices, config: MlaConfig) -> _Launch:
    """Head blocks, tiles, warps and KV splits for this call (``config``'s where it gives them).
    A step with no more tokens than sequences is (nearly) all decodes: one token per program,
    up to 64 heads; a prefill takes 64 rows of tokens x heads, to reuse each latent tile more."""
    num_tokens, num_heads, latent = q_latent.shape
    page_size = ckv_pages.shape[1]
    num_slots, pages_per_seq = page_indices.shape
    heads_p2 = _next_pow2(num_heads)
    is_decode = num_tokens <= num_slots
    if is_decode:
        block_h = min(config.block_h or DECODE_BLOCK_H, heads_p2)
        rows = max(config.block_rows or block_h, block_h, 16)
    else:
        rows = config.block_rows or PREFILL_ROWS
        block_h = min(config.block_h or rows, heads_p2, rows)
    block_q = rows // block_h
    block_kv = config.block_kv or default_block_kv(latent)
    num_warps = config.num_warps or (4 if rows <= 16 else 8)
    num_head_blocks = -(-num_heads // block_h)
    max_tiles = max_tiles_for(num_tokens, num_slots, block_q)
    num_splits = config.num_splits or default_num_splits(
        max_tiles * num_head_blocks, pages_per_seq * page_size, block_kv, num_sms()
    )
    return _Launch(
        block_h, rows, block_q, block_kv, num_warps, num_head_blocks, max_tiles, num_splits
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
    config: MlaConfig = MlaConfig(),
    interpret: bool = False,
) -> jax.Array:  # [T, N, L], q_latent's dtype
    """Pallas Triton latent attention; see the module docstring for the work layout."""
    reason = unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        raise ValueError(f"ragged_paged_mla_attention on Pallas Triton: {reason}")
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
    is_scaled = ckv_scale is not None or kpe_scale is not None
    scales = stacked_scales(ckv_scale, kpe_scale)
    body = functools.partial(
        _mla_kernel,
        block_h=launch.block_h,
        rows=launch.rows,
        block_kv=launch.block_kv,
        num_splits=launch.num_splits,
        sm_scale=float(sm_scale),
        is_scaled=is_scaled,
    )
    outs = pl.pallas_call(
        body if is_split else functools.partial(_unsplit, body),
        out_shape=_out_shape(q_latent, launch.num_splits),
        grid=(launch.num_head_blocks, launch.max_tiles, launch.num_splits),
        compiler_params=pltriton.CompilerParams(
            num_warps=launch.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_mla_attention_triton",
    )(plan, page_indices.astype(jnp.int32), scales, q_latent, q_pe, ckv_pages, kpe_pages)
    if is_split:
        out = merge_splits(
            outs[0], outs[1][..., None], cu_q_lens, num_seqs, out_dtype=q_latent.dtype
        )
    else:
        out = outs[0]
    return out[..., : q_latent.shape[-1]]


def _unsplit(body, *refs):
    """An unsplit launch has no lse output."""
    return body(*refs, None)


def _out_shape(q_latent: jax.Array, num_splits: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``(o,)`` in q's dtype; or, when the KV is split, ``(o, lse)`` per split in float32; o's
    latent padded to a power of two (sliced after)."""
    num_tokens, num_heads, latent = q_latent.shape
    o_shape = (num_tokens, num_heads, _next_pow2(latent))
    if num_splits == 1:
        return (jax.ShapeDtypeStruct(o_shape, q_latent.dtype),)
    return (
        jax.ShapeDtypeStruct((num_splits, *o_shape), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads), jnp.float32),
    )


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
    it for the kernel's path): the output [T, N, L] in q's dtype (and the padded one it is
    sliced from when L is not a power of two) and, when the KV range is split, the float32
    partial outputs [splits, T, N, Lp] and log-sum-exps [splits, T, N]; the pages are read in
    place. The split count is the most either layout takes for ``num_tokens`` (decodes: a
    token a tile; a prefill: 64-row tiles of one sequence), as ``_launch_for`` picks it."""
    del rope_dim, cache_itemsize  # read in place
    lp = _next_pow2(latent)
    shape = jax.ShapeDtypeStruct
    q = shape((num_tokens, num_heads, latent), jnp.bfloat16)
    pages = shape((1, page_size, 1, latent), jnp.bfloat16)
    splits = max(
        _launch_for(q, pages, shape((slots, pages_per_seq), jnp.int32), MlaConfig()).num_splits
        for slots in (num_tokens, 1)  # all decodes; one prompt
    )
    rows = num_tokens * num_heads
    out = rows * latent * q_itemsize + (rows * lp * q_itemsize if lp != latent else 0)
    return out + (splits * rows * (lp + 1) * 4 if splits > 1 else 0)
