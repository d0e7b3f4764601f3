"""The next verify step dispatched before the host reads the last one back (speculative decoding
with asynchronous scheduling and a model drafter; ``JAXSERVE_ASYNC_VERIFY=0`` turns it off;
docs/speculative_decoding.md).

A verify step n gives each sequence 1 to k + 1 tokens: its accepted drafts and the target's
next token. The host learns how many only when it reads step n back. To queue step n + 1
behind step n, the host schedules it as if every draft of step n were accepted (its token
counts, positions and blocks: the most step n can give, so the blocks always suffice), and the
device corrects the step before it runs: each sequence's shift ``accepted - drafts`` (zero or
negative) moves its positions, KV slots and cached length, and its first input token is the
one step n sampled after its last accepted draft. The sampler's positions (its random keys)
move the same way, and so does the catch-up of the drafter's call queued behind step n + 1.
When the host reads step n back it takes the rejected drafts back from its counts, as a step
read back at once does (``Scheduler.reject_drafts``), and its counts are exact again.

Pure device functions; ``StepPrograms`` jits them.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxserve.models.batch import Batch
from jaxserve.runner.packing import Layout, unpack

# "0" turns it off; on by default (with asynchronous scheduling, a model drafter, one device).
ASYNC_VERIFY_ENV = "JAXSERVE_ASYNC_VERIFY"


def enabled() -> bool:
    """``JAXSERVE_ASYNC_VERIFY``: on unless "0"."""
    return os.environ.get(ASYNC_VERIFY_ENV, "1").strip() != "0"


# Rows of the per-sequence metadata ``advance_step`` reads (i32[META_ROWS, S]): each sequence's
# first row among the last step's sampled ids, the drafts it verified there, its first draft's
# index in that step's drafts feed, and 1 where it was in that step (0: it is not shifted).
META_ROWS = 4


def accepted_drafts(
    sampled: jax.Array,  # i32[S_max]  a verify step's sampled ids
    drafts: jax.Array,  # i32[S_max]  the drafts it verified (``programs.flat_drafts``)
    first_sample: jax.Array,  # i32[S]  each sequence's first row of ``sampled``
    first_draft: jax.Array,  # i32[S]  its first draft's index in ``drafts``
    num_drafts: jax.Array,  # i32[S]  the drafts it verified
    k: int,  # drafts a sequence verifies at most
) -> jax.Array:  # i32[S]
    """How many of each sequence's drafts the step accepted: the leading ones equal to the
    tokens it sampled at their rows (the host's ``accepted_run`` counts them the same way)."""
    j = jnp.arange(k)[None, :]  # [1, k]
    got = sampled[jnp.clip(first_sample[:, None] + j, 0, sampled.shape[0] - 1)]
    drafted = drafts[jnp.clip(first_draft[:, None] + j, 0, drafts.shape[0] - 1)]
    matches = (got == drafted) & (j < num_drafts[:, None])
    return jnp.cumprod(matches.astype(jnp.int32), axis=1).sum(axis=1)


def shift_batch(batch: Batch, shift: jax.Array, page_size: int) -> Batch:
    """``batch`` with sequence s's tokens ``shift[s]`` positions along (its rows of ``shift``
    past the batch's sequences are ignored): positions, cached lengths and KV slots (from its
    page table); padding rows keep theirs."""
    s_pad, t_pad = batch.kv_lens.shape[0], batch.input_ids.shape[0]
    shift = _fit(shift, s_pad)
    live_seq = jnp.arange(s_pad) < batch.num_seqs[0]
    per_seq = jnp.where(live_seq, shift, 0)
    token = jnp.arange(t_pad)
    seq_of = jnp.clip(jnp.searchsorted(batch.cu_q_lens[1:], token, side="right"), 0, s_pad - 1)
    live = token < batch.cu_q_lens[batch.num_seqs[0]]
    positions = batch.positions + jnp.where(live, per_seq[seq_of], 0)
    pages = batch.page_indices[seq_of]  # [T, pages_per_seq]
    page = jnp.take_along_axis(pages, jnp.clip(positions // page_size, 0)[:, None], axis=1)[:, 0]
    slots = jnp.where(live, page * page_size + positions % page_size, batch.slot_mapping)
    return dataclasses.replace(
        batch,
        positions=positions.astype(jnp.int32),
        slot_mapping=slots.astype(jnp.int32),
        kv_lens=(batch.kv_lens + per_seq).astype(jnp.int32),
    )


def advance_step(
    packed: jax.Array,  # i32[N]  a model step's inputs (``step_programs.pack_step``)
    sampled: jax.Array,  # i32[S_max]  the last step's sampled ids
    drafts: jax.Array,  # i32[S_max]  the drafts it verified
    meta: jax.Array,  # i32[META_ROWS, S_pad]  per sequence of this step (see META_ROWS)
    *,
    layout: Layout,  # static
    k: int,
    page_size: int,
) -> tuple[jax.Array, jax.Array]:  # (packed, i32[S_max] each sequence's shift)
    """A verify step's inputs, scheduled before the last verify step was read back, corrected
    on the device: each sequence of the last step moves by ``accepted - drafts`` and its first
    input token is the one sampled after its last accepted draft (``shift_batch``)."""
    batch, *rest = unpack(packed, layout)
    first_sample, num_drafts, first_draft, was_there = meta
    accepted = accepted_drafts(sampled, drafts, first_sample, first_draft, num_drafts, k)
    shift = jnp.where(was_there > 0, accepted - num_drafts, 0).astype(jnp.int32)
    s_pad = batch.kv_lens.shape[0]
    live = (jnp.arange(s_pad) < batch.num_seqs[0]) & (was_there > 0)
    token = sampled[jnp.clip(first_sample + accepted, 0, sampled.shape[0] - 1)]
    first_row = jnp.where(live, batch.cu_q_lens[:-1], batch.input_ids.shape[0])  # out of range
    input_ids = batch.input_ids.at[first_row].set(token, mode="drop")
    batch = shift_batch(dataclasses.replace(batch, input_ids=input_ids), shift, page_size)
    out = repack((batch, *rest), layout)
    return out, _fit(shift, sampled.shape[0])


def shift_rows(
    packed: jax.Array,  # i32[N]  the sampler's inputs (``SamplingInputs``, packed)
    row_seq: jax.Array,  # i32[R]  each sampler row's sequence (-1: padding)
    shift: jax.Array,  # i32[S_max]  each sequence's shift (``advance_step``)
    *,
    layout: Layout,  # static
    leaf: int,  # static: the positions' leaf
) -> jax.Array:
    """The sampler's inputs with each row's position moved by its sequence's shift (the
    position keys the row's random draw)."""
    leaves = list(jax.tree.leaves(unpack(packed, layout)))
    rows = leaves[leaf].shape[0]
    moved = jnp.where(row_seq >= 0, shift[jnp.clip(row_seq, 0, shift.shape[0] - 1)], 0)
    leaves[leaf] = leaves[leaf] + _fit(moved, rows)
    return repack(jax.tree.unflatten(layout.treedef, leaves), layout)


def repack(tree: object, layout: Layout) -> jax.Array:
    """On the device: ``tree`` (shaped as ``layout`` says) as ``packing.pack``'s buffer: each
    leaf's 4-byte words padded to its aligned size, joined (one concatenation: written leaf by
    leaf into a zeroed buffer it took 29 small kernels a step on an H100)."""
    parts = []
    for leaf, start, end in zip(
        jax.tree.leaves(tree), layout.offsets, (*layout.offsets[1:], layout.size), strict=True
    ):
        flat = leaf.reshape(-1)
        if flat.dtype != jnp.int32:
            flat = jax.lax.bitcast_convert_type(flat, jnp.int32)
        parts.append(jnp.pad(flat, (0, end - start - flat.shape[0])))
    return jnp.concatenate(parts)


def _fit(values: jax.Array, size: int) -> jax.Array:
    """``values`` cut or zero-padded to ``size`` (static shapes)."""
    if values.shape[0] >= size:
        return values[:size]
    return jnp.pad(values, (0, size - values.shape[0]))
