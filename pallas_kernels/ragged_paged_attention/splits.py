"""Combining a KV-split attention's partial results, shared by the GPU kernels: each split of a
tile's KV range writes its normalised partial output and its log-sum-exp, and the splits are
merged here in XLA. Attention sinks (GPT-OSS) join here, once per row: the splits leave them out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.env_choice import env_choice

LOG2E = math.log2(math.e)
# Finite, so fully masked rows never produce inf - inf; the log-sum-exp the GPU kernels write
# for an empty split, which the merge weighs 0.
MASK_VALUE = -1e30

# The split rules count a launch's rows (its tiles of one KV head) as live, but a bucket's rows
# are padded: a batch of one decodes in the 16-token bucket, where the rules saw 16 sequences
# and split each KV head's range 2 ways, so 16 programs read the one live sequence, each at the
# pace of one SM. Measured: the batch-1 step's attention took 10 us a layer at 1,024 context
# (H100, 2026-12-06), and Llama-3-8B's batch-1 step grew 0.79 ms from 1,024 to 4,096 context
# where its bytes grew by 0.08 ms (H200, 2026-12-03). Launches of at most SMALL_LAUNCH_ROWS rows
# are planned for SMALL_LAUNCH_LIVE_ROWS live ones instead: 8 splits of 8 KV heads on 132 SMs
# (64 programs at batch 1). A full 16-row decode then runs 8 splits where 2 would do: four
# times the programs, each with a quarter of the KV.
SMALL_LAUNCH_ROWS = 16
SMALL_LAUNCH_LIVE_ROWS = 4
# ``live`` (the default: the plan above) or ``bucket`` (every row counted as live, the rule
# before it), to compare the two in one benchmark run. Read at trace time.
SPLIT_PLAN_ENV = "JAXSERVE_ATTENTION_SPLITS"


def planned_rows(rows: int) -> int:
    """The live rows a kernel's KV-split rule plans for, of a launch of ``rows`` rows."""
    if rows > SMALL_LAUNCH_ROWS or env_choice(SPLIT_PLAN_ENV, ("live", "bucket"), "live") != "live":
        return rows
    return min(rows, SMALL_LAUNCH_LIVE_ROWS)


def with_live_splits(
    plan: jax.Array,  # i32[5, max_tiles]  ``mosaic_gpu.plan_tiles``' (row 2: each tile's tokens)
    num_kv_heads: int,
    num_splits: int,  # the launch's (its grid's split axis)
    num_sms: int,
    planned: bool,  # the split count came from ``planned_rows`` (not a config's)
) -> jax.Array:  # i32[6, max_tiles]: the plan, then the splits each tile's KV range takes
    """The plan with the splits a tile's KV range is cut into at run time: a launch planned for
    fewer live rows than it has (``planned_rows``) counts its live tiles when it runs and takes
    the most splits, a power of two up to the launch's, whose programs stay within two per SM,
    the rule ``default_num_splits`` applies to a launch's rows at trace time; the programs of
    the splits past it return at once, writing nothing, and the merge weighs their parts 0
    (``merge_splits``' ``live_splits``; before, each loaded its Q and wrote an empty part).
    Measured on an H100 (2026-12-06) with 8 splits at every row count: batch 1 at 4,096 context
    6.93 -> 6.22 ms a Llama-3-8B step, but a full 16-row decode 0.26-0.31 ms slower; a full
    launch runs the 2 splits it did before this plan. With the early return the same bucket
    measured 0.12 / -0.02 / 0.12 ms slower than the bucket plan at 256 / 1,024 / 4,096 context
    (before it, the same machine minutes earlier: 0.31 / 0.27 / 0.50); batch 1 x 4,096 still
    6.97 -> 6.29 ms.
    ``planned`` False: every tile takes all."""
    splits = jnp.int32(num_splits)
    if planned:
        programs = jnp.sum(plan[2] > 0, dtype=jnp.int32) * num_kv_heads
        splits, candidate = jnp.int32(1), 1
        while candidate * 2 <= num_splits:
            candidate *= 2
            splits = jnp.where(programs * candidate <= 2 * num_sms, candidate, splits)
    return jnp.concatenate([plan, jnp.broadcast_to(splits, (1, plan.shape[1]))])


def split_range(
    kb_lo: jax.Array, num_blocks: jax.Array, split: jax.Array, splits: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """KV blocks [lo, hi) of split ``split`` when a tile's ``num_blocks`` from ``kb_lo`` are cut
    ``splits`` ways (``with_live_splits``' count); empty for a split past them."""
    lo = kb_lo + num_blocks * jnp.minimum(split, splits) // splits
    hi = kb_lo + num_blocks * jnp.minimum(split + 1, splits) // splits
    return lo, hi


# Up to this many splits the merge is written out split by split (one fusion, no max); its terms
# grow as the square of the count: at 32 splits (the MLA kernel's batch-1 decode at 32K context,
# one program an SM) 6,458 lines of HLO that took 4.8 s to compile on the CPU and more than 45
# on an H100 (its native test was stopped there, 2026-12-07), at 64 splits 23 s on the CPU.
# More splits take the max over the split axis (``_merge_over_axis``), linear in the count.
UNROLLED_MERGE_MAX_SPLITS = 8


def _merge_over_axis(
    o_parts: jax.Array,  # f32[NS, T, Hq, D]
    lse_parts: jax.Array,  # f32[NS, T, Hq, C]
    sinks: jax.Array | None,
    live_splits: jax.Array | None,
) -> jax.Array:  # f32[T, Hq, D]
    """``merge_splits``' weighting as reductions over the split axis: each split's share
    ``2^(lse_s - m) / sum_t 2^(lse_t - m)`` with ``m`` the largest log-sum-exp (and the sink's)."""
    lse = lse_parts[..., :1]  # [NS, T, Hq, 1]
    if live_splits is not None:  # parts from ``live_splits`` on were never written
        live = (jnp.arange(lse.shape[0]) < jnp.maximum(live_splits, 1))[:, None, None, None]
        lse = jnp.where(live, lse, MASK_VALUE)
        o_parts = jnp.where(live, o_parts, 0.0)
    top = jnp.max(lse, axis=0)  # [T, Hq, 1]
    sink = None
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, -1, 1) * LOG2E  # [1, Hq, 1]
        top = jnp.maximum(top, sink)
    terms = jnp.exp2(lse - top)  # [NS, T, Hq, 1]
    total = jnp.sum(terms, axis=0)
    if sink is not None:
        total = total + jnp.exp2(sink - top)
    return jnp.sum(terms / total * o_parts, axis=0)


def merge_splits(
    o_parts: jax.Array,  # f32[NS, T, Hq, D]
    lse_parts: jax.Array,  # f32[NS, T, Hq, C]  log2-domain, its C columns all equal
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    out_dtype,
    sinks: jax.Array | None = None,  # [Hq]  natural-log sink logits, added to each denominator
    live_splits: jax.Array | None = None,  # i32[]  the parts written (``with_live_splits``')
) -> jax.Array:  # [T, Hq, D]
    """Weight each split's partial output by its share of the softmax mass (the sink's mass,
    when given, counted once in the total and contributing no value).

    Written as elementwise ops over the (small, static) split axis so that XLA emits one
    fusion: each share is 1 / sum_t 2^(lse_t - lse_s), with no running max for the splits to
    share (with 8 splits XLA made the max a kernel of its own, a layer's 32 more in the batch-1
    Llama-3-8B step of a deviceless H100 compile, 486 against 454). The kernels' empty splits
    write a finite -1e30, so no difference is inf - inf. Rows past cu_q_lens[num_seqs] were
    never written and come back as zeros. With ``live_splits``, the parts from it on were
    never written either (their programs returned at once): whatever they hold weighs nothing.
    """
    num_splits, num_tokens = o_parts.shape[:2]
    if num_splits > UNROLLED_MERGE_MAX_SPLITS:
        out = _merge_over_axis(o_parts, lse_parts, sinks, live_splits)
        is_valid = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]
        return jnp.where(is_valid[:, None, None], out, 0.0).astype(out_dtype)

    def written(s: int, x: jax.Array, empty: float) -> jax.Array:  # split s's x, if written
        return x if live_splits is None or s == 0 else jnp.where(s < live_splits, x, empty)

    lse = [written(s, lse_parts[s, :, :, :1], MASK_VALUE) for s in range(num_splits)]
    others = list(lse)
    if sinks is not None:
        others.append(sinks.astype(jnp.float32).reshape(1, -1, 1) * LOG2E)  # f32[1, Hq, 1]
    # Each split's share 1 / sum_t 2^(lse_t - lse_s): no running max to share between the
    # splits' terms (a share far below another's overflows its sum to inf: a share of 0).
    shares = [1.0 / functools.reduce(jnp.add, [jnp.exp2(t - x) for t in others]) for x in lse]
    out = functools.reduce(jnp.add, [written(s, w * o_parts[s], 0.0) for s, w in enumerate(shares)])
    is_valid = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]  # bool[T]
    return jnp.where(is_valid[:, None, None], out, 0.0).astype(out_dtype)
