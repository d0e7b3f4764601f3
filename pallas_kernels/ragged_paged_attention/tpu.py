"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same op, signature and semantics as ``reference.ragged_paged_attention``; the entry point
(``dispatch``) dispatches here on TPU backends.

Data flow. The wrapper regroups the queries head-major, ``q[T, Hq, D] -> [Hkv, T_pad * G, D]``
(row ``t * G + g`` is query head ``kv_head * G + g`` of token ``t``), so that every KV head's
query heads form one lane-dense 2-D tile, and computes for each block of query tokens the range
of sequences that own rows in it. The grid runs over query blocks; the blocks are independent,
so the grid axis is ``parallel``. Inside a block, a loop walks the (sequence, KV block) pairs
that the block needs: KV pages stay in HBM and are copied page by page into one of two VMEM
slots while the other slot is being used (double buffering, also across sequence boundaries).
Each KV block updates an online softmax (max, sum, accumulator, all float32) for the rows of
the current sequence only. KV blocks that lie wholly outside the causal range or the sliding
window of a sequence's rows are never fetched, and pages past a sequence's range are skipped.
An fp8 cache is fetched as stored and cast to the queries' dtype in VMEM before the dots; its
per-tensor scales (f32, in SMEM) multiply the float32 scores (``k_scale``) and the normalised
output (``v_scale``), which is the reference's ``page * scale`` before the dots. Attention sinks
(GPT-OSS, ``sinks[Hq]``) come in as one more VMEM block, laid out like the running max, which
starts from them (with a running sum of one, the sink's mass); without sinks there is no such
operand and the max starts as before.

What the tests run and what they do not: ``tests/test_kernel_tpu.py`` runs this kernel under
``pltpu.force_tpu_interpret_mode()`` on the CPU, which simulates HBM, VMEM, DMAs and DMA
semaphores (copies land only when waited on, fresh VMEM is NaN-filled, and the parallel grid
axis is visited in random order), against the reference. It has not been compiled by Mosaic
or run on a TPU, so what only the Mosaic compiler decides is unverified: chiefly the per-head
loads of K and V, which pick one index of the second-minor (head) axis of a
``[pages, page_size, Hkv, D]`` VMEM buffer (a sublane-strided load, most at risk for bf16, which
packs two rows per sublane) and then merge pages into rows, and the block shapes when
``num_q_tokens_per_block * G`` is small (Mosaic tiles rows by 8, or 16 for bf16). Block sizes
are untuned, and the first KV fetch of each query block does not overlap the previous block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_cache import stacked_scales
from pallas_kernels.ragged_paged_attention.reference import DEFAULT_MASK_VALUE

# NOTE: the running max and sum are kept broadcast over a full 128-lane row, the layout Mosaic
# loads and stores without masking; only lane 0 is read back.
_STAT_LANES = 128


class _SeqSpan(NamedTuple):
    """Scalars for one sequence's rows inside one query block (all i32, in SMEM)."""

    seq: jax.Array  # the sequence slot
    row_lo: jax.Array  # its token rows in this block: [row_lo, row_hi)
    row_hi: jax.Array
    pos_offset: jax.Array  # token row + pos_offset = absolute position in the sequence
    kv_lo: jax.Array  # the KV positions those rows attend to: [kv_lo, kv_hi)
    kv_hi: jax.Array
    block_lo: jax.Array  # the KV blocks to visit: [block_lo, block_hi), never empty
    block_hi: jax.Array


def _start_copies(copies) -> None:
    for copy in copies:
        copy.start()


def _wait_copies(copies) -> None:
    for copy in copies:
        copy.wait()


def _attention_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S * pages_per_seq]
    cu_q_lens_ref,  # i32[S + 1]
    seq_lo_ref,  # i32[num_q_blocks]  first sequence with rows in the block
    seq_hi_ref,  # i32[num_q_blocks]  one past the last such sequence
    # Inputs.
    q_ref,  # [Hkv, R, D] VMEM, R = tokens_per_block * G
    k_hbm_ref,  # [P, page_size, Hkv, D] HBM
    v_hbm_ref,  # [P, page_size, Hkv, D] HBM
    scales_ref,  # f32[2] SMEM: k_scale, v_scale
    sinks_ref,  # f32[Hkv, R, 128] VMEM: each row's sink logit, or None
    # Output.
    o_ref,  # [Hkv, R, D] VMEM
    # Scratch.
    k_buf,  # [2, pages_per_block, page_size, Hkv, D] VMEM
    v_buf,  # [2, pages_per_block, page_size, Hkv, D] VMEM
    sems,  # DMA semaphores [2], one per slot
    m_ref,  # f32[Hkv, R, 128]  running max
    l_ref,  # f32[Hkv, R, 128]  running sum
    acc_ref,  # f32[Hkv, R, D]  running, unnormalised output
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    pages_per_seq: int,
):
    num_kv_heads, num_rows, head_dim = q_ref.shape
    _, pages_per_block, page_size, _, _ = k_buf.shape
    kv_per_block = pages_per_block * page_size
    max_kv = pages_per_seq * page_size
    num_seq_slots = kv_lens_ref.shape[0]
    q_block = pl.program_id(0)
    block_start = q_block * (num_rows // group)  # first token row of this block
    block_end = block_start + num_rows // group
    qk_scale = sm_scale * scales_ref[0]
    seq_lo = seq_lo_ref[q_block]
    seq_hi = seq_hi_ref[q_block]

    def seq_span(seq) -> _SeqSpan:
        seq = jnp.minimum(seq, num_seq_slots - 1)  # callers may peek one past the last sequence
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        pos_offset = kv_len - (q_end - q_start) - q_start  # token row -> absolute position
        row_lo = jnp.maximum(q_start, block_start)
        row_hi = jnp.minimum(q_end, block_end)
        kv_hi = jnp.minimum(jnp.minimum(kv_len, max_kv), row_hi + pos_offset)
        kv_lo = jnp.int32(0)
        if sliding_window is not None:
            kv_lo = jnp.maximum(row_lo + pos_offset - sliding_window + 1, 0)
        kv_hi = jnp.where(row_hi > row_lo, jnp.maximum(kv_hi, kv_lo), kv_lo)
        # NOTE: a sequence with no rows here still takes one (fully masked) step, so the loop
        # below never has to search for the next non-empty sequence.
        block_lo = kv_lo // kv_per_block
        block_hi = jnp.maximum(pl.cdiv(kv_hi, kv_per_block), block_lo + 1)
        return _SeqSpan(seq, row_lo, row_hi, pos_offset, kv_lo, kv_hi, block_lo, block_hi)

    def page_copies(seq, kv_block, slot):
        """(is_needed, (k copy, v copy)) for each page of one KV block of `seq`."""
        span = seq_span(seq)
        copies = []
        for i in range(pages_per_block):
            page = kv_block * pages_per_block + i
            is_needed = (page >= span.kv_lo // page_size) & (page < pl.cdiv(span.kv_hi, page_size))
            page = jnp.minimum(page, pages_per_seq - 1)
            page_id = page_indices_ref[span.seq * pages_per_seq + page]
            k_copy = pltpu.make_async_copy(k_hbm_ref.at[page_id], k_buf.at[slot, i], sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm_ref.at[page_id], v_buf.at[slot, i], sems.at[slot])
            copies.append((is_needed, (k_copy, v_copy)))
        return copies

    def start_fetch(seq, kv_block, slot):
        for is_needed, copies in page_copies(seq, kv_block, slot):
            pl.when(is_needed)(functools.partial(_start_copies, copies))

    def wait_fetch(seq, kv_block, slot):
        for is_needed, copies in page_copies(seq, kv_block, slot):
            pl.when(is_needed)(functools.partial(_wait_copies, copies))

    def update(seq, kv_block, slot):
        """Fold one KV block into the online softmax of `seq`'s rows."""
        span = seq_span(seq)
        kv_start = kv_block * kv_per_block
        scores_shape = (num_rows, kv_per_block)
        tokens = block_start + lax.broadcasted_iota(jnp.int32, scores_shape, 0) // group
        positions = tokens + span.pos_offset  # i32[R, kv_per_block]
        cols = kv_start + lax.broadcasted_iota(jnp.int32, scores_shape, 1)
        # NOTE: rows of other sequences are fully masked, so their probabilities are 0 and the
        # update below leaves their max, sum and accumulator exactly as they were.
        mask = (tokens >= span.row_lo) & (tokens < span.row_hi)
        mask &= (cols <= positions) & (cols < span.kv_hi)
        if sliding_window is not None:
            mask &= cols > positions - sliding_window
        # Slots hold stale data (or NaN) outside [kv_lo, kv_hi): zero V there, since masked
        # probabilities are 0 but 0 * NaN is not.
        v_cols = kv_start + lax.broadcasted_iota(jnp.int32, (kv_per_block, head_dim), 0)
        is_v_valid = (v_cols >= span.kv_lo) & (v_cols < span.kv_hi)  # bool[kv_per_block, D]

        for h in range(num_kv_heads):
            k = k_buf[slot, :, :, h, :].reshape(kv_per_block, head_dim)  # [kv_per_block, D]
            v = v_buf[slot, :, :, h, :].reshape(kv_per_block, head_dim)  # [kv_per_block, D]
            q = q_ref[h]  # [R, D]
            v = v.astype(q.dtype)  # an fp8 cache: dequantized (the scale comes at the end)
            v = jnp.where(is_v_valid, v, jnp.zeros_like(v))
            scores = lax.dot_general(
                q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # f32[R, kv_per_block]
            scores = scores * qk_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            scores = jnp.where(mask, scores, DEFAULT_MASK_VALUE)

            m_prev = m_ref[h]  # f32[R, 128]
            l_prev = l_ref[h]  # f32[R, 128]
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # f32[R, 128]
            probs = jnp.where(mask, jnp.exp(scores - m_next[:, :1]), 0.0)  # f32[R, kv_per_block]
            alpha = jnp.exp(m_prev - m_next)  # f32[R, 128]
            l_next = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            pv = jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, D]
            m_ref[h] = m_next
            l_ref[h] = l_next
            acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv

    if sinks_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, DEFAULT_MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:  # the sink as a first column with no value: max = sink, sum = its mass, 1
        m_ref[...] = sinks_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first_block = seq_span(seq_lo).block_lo

    @pl.when(seq_lo < seq_hi)
    def _prefetch_first():
        start_fetch(seq_lo, first_block, 0)

    def is_pending(carry):
        seq, _, _ = carry
        return seq < seq_hi

    def step(carry):
        seq, kv_block, slot = carry
        is_last_block = kv_block + 1 >= seq_span(seq).block_hi
        next_seq = jnp.where(is_last_block, seq + 1, seq)
        next_block = jnp.where(is_last_block, seq_span(seq + 1).block_lo, kv_block + 1)
        next_slot = 1 - slot

        @pl.when(next_seq < seq_hi)
        def _prefetch_next():
            start_fetch(next_seq, next_block, next_slot)

        wait_fetch(seq, kv_block, slot)
        update(seq, kv_block, slot)
        return next_seq, next_block, next_slot

    lax.while_loop(is_pending, step, (seq_lo, first_block, jnp.int32(0)))

    for h in range(num_kv_heads):
        row_sum = l_ref[h][:, :1]  # f32[R, 1]; 0 for rows that saw no key (padding)
        row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
        o_ref[h] = (acc_ref[h] * (scales_ref[1] / row_sum)).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "num_q_tokens_per_block",
        "num_kv_pages_per_block",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # i32[S]  tokens in the cache per sequence, new ones included
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
    num_q_tokens_per_block: int = 32,
    num_kv_pages_per_block: int = 8,
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Each query row attends to its own sequence's pages, causally; float32 online softmax."""
    _check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks)
    _check_options(sliding_window, soft_cap, num_q_tokens_per_block, num_kv_pages_per_block)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    tokens_per_block = min(num_q_tokens_per_block, num_tokens)
    pages_per_block = min(num_kv_pages_per_block, page_indices.shape[1])
    num_q_blocks = pl.cdiv(num_tokens, tokens_per_block)
    padded_tokens = num_q_blocks * tokens_per_block
    num_rows = tokens_per_block * group
    q_heads = _heads_major(q, num_kv_heads, padded_tokens)  # [Hkv, padded_tokens * G, D]
    scalars = _scalar_operands(
        kv_lens, page_indices, cu_q_lens, num_seqs, num_q_blocks, tokens_per_block
    )
    scales = stacked_scales(k_scale, v_scale)  # f32[2]
    kernel = functools.partial(
        _attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        pages_per_seq=page_indices.shape[1],
    )
    sink_args: tuple[jax.Array, ...] = ()
    if sinks is not None:
        sink_args = (_sink_rows(sinks, num_kv_heads, group, tokens_per_block),)
    else:
        kernel = _with_no_sinks(kernel)
    out = pl.pallas_call(
        kernel,
        grid_spec=_grid_spec(q_heads, k_pages, num_rows, pages_per_block, sinks is not None),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        out_shape=jax.ShapeDtypeStruct(q_heads.shape, q.dtype),
        name="ragged_paged_attention",
    )(*scalars, q_heads, k_pages, v_pages, scales, *sink_args)  # [Hkv, padded_tokens * G, D]
    out = out.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)


def _heads_major(q: jax.Array, num_kv_heads: int, padded_tokens: int) -> jax.Array:
    """``q[T, Hq, D]`` padded to ``padded_tokens`` and regrouped ``[Hkv, T_pad * G, D]``: row
    ``t * G + g`` of KV head h is query head ``h * G + g`` of token t."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    q_heads = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_heads = jnp.pad(q_heads, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    return q_heads.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group, head_dim)


def _check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks) -> None:
    """Raise ValueError for arrays whose shapes do not fit together."""
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    num_seq_slots = page_indices.shape[0]
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    if kv_head_dim != head_dim:
        raise ValueError(f"{k_pages.shape=} must have head_dim {head_dim} like {q.shape=}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if kv_lens.shape != (num_seq_slots,) or cu_q_lens.shape != (num_seq_slots + 1,):
        raise ValueError(f"{kv_lens.shape=} and {cu_q_lens.shape=} must be (S,) and (S + 1,)")
    if num_seqs.shape != (1,):
        raise ValueError(f"{num_seqs.shape=} must be (1,)")
    if sinks is not None and sinks.shape != (num_q_heads,):
        raise ValueError(f"{sinks.shape=} must be ({num_q_heads},): one logit per query head")


def _check_options(
    sliding_window: int | None,
    soft_cap: float | None,
    num_q_tokens_per_block: int,
    num_kv_pages_per_block: int,
) -> None:
    """Raise ValueError for a static option out of its range."""
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive")
    if soft_cap is not None and soft_cap <= 0.0:
        raise ValueError(f"{soft_cap=} must be positive")
    if num_q_tokens_per_block <= 0 or num_kv_pages_per_block <= 0:
        raise ValueError(f"{num_q_tokens_per_block=} and {num_kv_pages_per_block=} must be > 0")


def _scalar_operands(
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    num_q_blocks: int,
    tokens_per_block: int,
) -> tuple[jax.Array, ...]:
    """The kernel's five scalar-prefetch operands (SMEM): ``kv_lens``, the flat page table,
    ``cu_q_lens``, and for each query block the sequences that own rows in it,
    ``[seq_lo, seq_hi)``."""
    num_seq_slots = kv_lens.shape[0]
    block_starts = jnp.arange(num_q_blocks, dtype=jnp.int32)[:, None] * tokens_per_block
    is_live = jnp.arange(num_seq_slots, dtype=jnp.int32)[None, :] < num_seqs[0]  # bool[1, S]
    seq_lo = jnp.sum(is_live & (cu_q_lens[None, 1:] <= block_starts), axis=1, dtype=jnp.int32)
    seq_hi = jnp.sum(
        is_live & (cu_q_lens[None, :-1] < block_starts + tokens_per_block),
        axis=1,
        dtype=jnp.int32,
    )
    seq_hi = jnp.maximum(seq_hi, seq_lo)  # i32[num_q_blocks]
    return (
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        seq_lo,
        seq_hi,
    )


def _sink_rows(
    sinks: jax.Array,  # [Hq]
    num_kv_heads: int,
    group: int,
    tokens_per_block: int,
) -> jax.Array:  # f32[Hkv, R, 128], laid out like the running max
    """Row t * G + g of KV head h: query head h * G + g's sink."""
    num_rows = tokens_per_block * group
    sink_rows = jnp.tile(
        sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), (1, tokens_per_block, 1)
    ).reshape(num_kv_heads, num_rows, 1)
    return jnp.broadcast_to(sink_rows, (num_kv_heads, num_rows, _STAT_LANES))


def _grid_spec(
    q_heads: jax.Array,  # [Hkv, T_pad * G, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    num_rows: int,  # query rows of a block: tokens_per_block * G
    pages_per_block: int,
    has_sinks: bool,
) -> pltpu.PrefetchScalarGridSpec:
    """One program per query block: 5 scalar-prefetch operands, Q's block, K and V left in HBM,
    the scales in SMEM (and the sinks' block); two VMEM slots of KV pages, their DMA semaphores
    and the online softmax's max, sum and accumulator as scratch."""
    num_kv_heads, padded_rows, head_dim = q_heads.shape
    _, page_size, _, _ = k_pages.shape
    q_spec = pl.BlockSpec((num_kv_heads, num_rows, head_dim), lambda b, *_: (0, b, 0))
    page_buf = pltpu.VMEM((2, pages_per_block, page_size, num_kv_heads, head_dim), k_pages.dtype)
    stat_shape = (num_kv_heads, num_rows, _STAT_LANES)
    stat_buf = pltpu.VMEM(stat_shape, jnp.float32)
    sink_specs = [pl.BlockSpec(stat_shape, lambda b, *_: (0, 0, 0))] if has_sinks else []
    num_q_blocks = padded_rows // num_rows
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_q_blocks,),
        in_specs=[
            q_spec,
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pltpu.SMEM),
            *sink_specs,
        ],
        out_specs=q_spec,
        scratch_shapes=[
            page_buf,
            page_buf,
            pltpu.SemaphoreType.DMA((2,)),
            stat_buf,
            stat_buf,
            pltpu.VMEM((num_kv_heads, num_rows, head_dim), jnp.float32),
        ],
    )


def _with_no_sinks(kernel):
    """Adapt the kernel to a launch without the sinks operand (5 scalar-prefetch refs, then
    q, k, v and the scales)."""

    def wrapped(*refs):
        return kernel(*refs[:9], None, *refs[9:])

    return wrapped
