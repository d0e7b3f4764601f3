"""The device side of a verify step scheduled before the last one is read back
(``jaxserve/runner/verify_ahead.py``): a step counted on the host as if every draft in flight
were accepted is moved, on the device, to where the accepted drafts put it. Each function
against the host's own construction at the true positions, on fresh random inputs. The served
behaviour (the same tokens as without speculation) is in test_spec_models.py and test_mtp.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.spec_decode import accepted_run
from jaxserve.models.batch import Batch
from jaxserve.runner import verify_ahead
from jaxserve.runner.packing import pack, unpack
from jaxserve.runner.sampling import SamplingInputs
from jaxserve.runner.step import PENDING_TOKEN

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 4, 8, 64
PAD_SLOT = NUM_PAGES * PAGE_SIZE


def host_batch(
    rng: np.random.Generator, starts: list[int], q_lens: list[int], tables: np.ndarray
) -> Batch:
    """A step's batch built on the host as ``InputBuilder.build_batch`` builds it (padded
    to 16 tokens and 4 sequences): each sequence's tokens from ``starts``, in its pages."""
    t_pad, s_pad = 16, 4
    ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.full(t_pad, PAD_SLOT, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    cu = np.zeros(s_pad + 1, np.int32)
    row = 0
    for s, (start, n) in enumerate(zip(starts, q_lens, strict=True)):
        pos = np.arange(start, start + n)
        ids[row : row + n] = rng.integers(0, 1000, n)
        positions[row : row + n] = pos
        slots[row : row + n] = tables[s, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        kv_lens[s] = start + n
        row += n
        cu[s + 1 :] = row
    pages = np.zeros((s_pad, PAGES_PER_SEQ), np.int32)
    pages[: len(starts)] = tables[: len(starts)]
    return Batch(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        kv_lens=kv_lens,
        page_indices=pages,
        cu_q_lens=cu,
        num_seqs=np.array([len(starts)], np.int32),
        logits_indices=np.maximum(cu[1:] - 1, 0),
    )


def random_tables(rng: np.random.Generator) -> np.ndarray:
    return (
        rng.permutation(NUM_PAGES)[: 4 * PAGES_PER_SEQ].reshape(4, PAGES_PER_SEQ).astype(np.int32)
    )


def assert_batches_equal(got: Batch, want: Batch, *fields: str) -> None:
    for name in fields or [f.name for f in dataclasses.fields(Batch)]:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), getattr(want, name), name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shifted_batch_is_the_batch_built_at_the_shifted_starts(seed) -> None:
    """Positions, KV slots (from each sequence's own pages, across page boundaries) and
    cached lengths move by each sequence's shift; padding rows and the rest stay."""
    rng = np.random.default_rng(seed)
    tables = random_tables(rng)
    q_lens = [4, 3, 5]
    shifts = [-int(rng.integers(0, 4)), 0, -int(rng.integers(0, 5))]
    starts = [int(rng.integers(8, 20)) for _ in q_lens]
    counted = host_batch(np.random.default_rng(9), starts, q_lens, tables)
    true = host_batch(
        np.random.default_rng(9),
        [s + d for s, d in zip(starts, shifts, strict=True)],
        q_lens,
        tables,
    )
    shift = jnp.asarray(shifts + [5] * 13, jnp.int32)  # rows past the batch's are ignored
    moved = jax.jit(verify_ahead.shift_batch, static_argnums=2)(counted, shift, PAGE_SIZE)
    assert_batches_equal(moved, true)


def test_the_accepted_drafts_are_the_hosts_accepted_run() -> None:
    """``accepted_drafts`` counts each sequence's leading drafts equal to the tokens sampled at
    their rows, as the host's ``accepted_run`` does, for every count of drafts."""
    rng = np.random.default_rng(3)
    k, num_seqs = 4, 6
    num_drafts = rng.integers(0, k + 1, num_seqs)
    first_sample = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]]).astype(np.int32)
    first_draft = np.arange(num_seqs, dtype=np.int32) * k
    drafts = rng.integers(0, 3, num_seqs * k).astype(np.int32)  # few values: runs of matches
    sampled = np.zeros(64, np.int32)
    for s in range(num_seqs):
        n = int(num_drafts[s])
        sampled[first_sample[s] : first_sample[s] + n + 1] = rng.integers(0, 3, n + 1)
    got = verify_ahead.accepted_drafts(
        jnp.asarray(sampled),
        jnp.asarray(np.pad(drafts, (0, 64 - drafts.size))),
        jnp.asarray(first_sample),
        jnp.asarray(first_draft),
        jnp.asarray(num_drafts, jnp.int32),
        k,
    )
    for s in range(num_seqs):
        d = drafts[first_draft[s] : first_draft[s] + num_drafts[s]].tolist()
        assert int(got[s]) == len(accepted_run(d, sampled, int(first_sample[s]))) - 1


def test_repack_is_the_host_s_pack() -> None:
    """A pytree of int32 and float32 leaves, unpacked and packed again on the device, is the
    buffer ``pack`` made (the gaps between leaves zero)."""
    rng = np.random.default_rng(4)
    tree = {
        "a": rng.integers(-5, 5, (3, 7)).astype(np.int32),
        "b": rng.standard_normal(70).astype(np.float32),
        "c": (np.arange(1, dtype=np.int32),),
    }
    buffer, layout = pack(tree)
    again = jax.jit(lambda b: verify_ahead.repack(unpack(b, layout), layout))(jnp.asarray(buffer))
    np.testing.assert_array_equal(np.asarray(again), buffer)


def test_a_step_advanced_on_the_device_is_the_step_scheduled_after_reading_back() -> None:
    """The next verify step, counted as if every draft of the last were accepted: each
    sequence's first input (pending on the host) becomes the token the last step sampled after
    its last accepted draft, and it moves back by its rejected drafts; a sequence that was not
    in the last step (a prompt's chunk) stays as scheduled. The shift comes back per sequence."""
    rng = np.random.default_rng(5)
    tables = random_tables(rng)
    k = 3
    # the last step: sequence 0 verified 3 drafts (2 accepted), 1 verified 2 (0 accepted)
    sampled = np.zeros(32, np.int32)
    feed = np.zeros(32, np.int32)
    sampled[0:4] = [11, 12, 99, 98]  # drafts 11, 12, 13: the first two accepted, then 99
    feed[0:3] = [11, 12, 13]
    sampled[4:7] = [21, 97, 96]  # drafts 55, 56: none accepted, the target's 21
    feed[3:5] = [55, 56]
    meta = np.zeros((verify_ahead.META_ROWS, 4), np.int32)
    meta[:, 0] = (0, 3, 0, 1)
    meta[:, 1] = (4, 2, 3, 1)
    counted_starts, q_lens = [14, 9, 3], [4, 3, 5]
    counted = host_batch(np.random.default_rng(8), counted_starts, q_lens, tables)
    counted.input_ids[[0, 4]] = PENDING_TOKEN
    source = np.full(16, -1, np.int32)
    packed, layout = pack((counted, source))
    moved, shift = jax.jit(verify_ahead.advance_step, static_argnames=("layout", "k", "page_size"))(
        jnp.asarray(packed),
        jnp.asarray(sampled),
        jnp.asarray(feed),
        jnp.asarray(meta),
        layout=layout,
        k=k,
        page_size=PAGE_SIZE,
    )
    np.testing.assert_array_equal(np.asarray(shift)[:4], [-1, -2, 0, 0])
    assert shift.shape == (32,)
    true = host_batch(np.random.default_rng(8), [13, 7, 3], q_lens, tables)
    true.input_ids[[0, 4]] = [99, 21]
    got, got_source = unpack(moved, layout)
    assert_batches_equal(got, true)
    np.testing.assert_array_equal(np.asarray(got_source), source)


def test_the_sampler_rows_move_with_their_sequences() -> None:
    """``shift_rows``: each sampler row's position moves by its sequence's shift; rows of no
    sequence stay; every other input is as packed."""
    rows = 8
    inputs = SamplingInputs.padding(rows, 100, 0, 0, use_mask=False)
    inputs.positions = np.arange(10, 10 + rows, dtype=np.int32)
    inputs.temperature = np.linspace(0, 1, rows, dtype=np.float32)
    packed, layout = pack(inputs)
    leaf = [f.name for f in dataclasses.fields(SamplingInputs)].index("positions")
    row_seq = np.array([0, 0, 0, 1, 1, 2, -1, -1], np.int32)
    shift = jnp.asarray([-2, 0, -1] + [0] * 5, jnp.int32)
    moved = jax.jit(verify_ahead.shift_rows, static_argnames=("layout", "leaf"))(
        jnp.asarray(packed), jnp.asarray(row_seq), shift, layout=layout, leaf=leaf
    )
    got = unpack(moved, layout)
    np.testing.assert_array_equal(np.asarray(got.positions), [8, 9, 10, 13, 14, 14, 16, 17])
    np.testing.assert_array_equal(np.asarray(got.temperature), inputs.temperature)
