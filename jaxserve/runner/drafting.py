"""What the model-based drafters share: the sequences they read, their page pool and batches.

A drafter with a KV cache of its own (``PagedDrafter``: ``draft_model.py``,
``eagle3_proposer.py``, ``mtp_proposer.py``) keeps each sequence's pages in a
``PagePool`` (a free list on the host, one page table per sequence) and runs, per call, one
``catch_up_batch``: the tokens a sequence gained since the drafter last saw it, each sequence's
pages, padded to a token bucket (``Buckets``) so that few programs compile. The chained
one-token steps run on the device, inside the same compiled program (``decode_batch``; a
drafter over the target's states: ``chain_from_states``).
The engine's ``Sequence`` is read through ``TokenSource`` (the runner imports no engine).

Warm-up compiles a drafter's programs on threads first (``compile_ahead``), then calls each
once (which compiles nothing more): one after another, a draft model's 7 programs took 101 s on
the H200 (each unrolls k forward passes).

A call's host inputs go to the device as one buffer (``packing.pack``: one copy, where an
EAGLE-3 call sent ten arrays, ten copies, and spent 718 us of host time against 480 on a 2-core
host), under the key ``"chain"`` of a dict the subclass may add to (an EAGLE-3 head's state
rows); the compiled programs take it apart (``unpack``) with its ``Layout`` as a static
argument.

Under tensor parallelism (the runner has a ``TensorParallel``) a drafter lays its layers out on
the target's mesh as a model of its own shapes would be (``drafter_parallel``: its weights
split on heads and the MLP's intermediate dim, its pages on KV heads); its batches go in
replicated (``PagedDrafter.put``) and its drafts come back replicated.

A call's drafts stay on the device when the engine asks (``propose(..., on_device=True)``: no
grammar or penalty reads them before the step) and one call drafts them all: the verify step
takes them there (``DeviceDrafts``), and the host reads them with that step's results.
Otherwise they come to the host at the end of the call, one copy a call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.batch import Batch
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner import verify_ahead
from jaxserve.runner.buckets import MIN_TOKEN_BUCKET, Buckets
from jaxserve.runner.in_flight import InFlight
from jaxserve.runner.packing import Layout, pack, unpack
from jaxserve.runner.parallel.sharding import TensorParallel, prepare_tp
from jaxserve.runner.programs import compiler_options, holds_fp8
from jaxserve.runner.step import DeviceDrafts, SchedulerOutput
from jaxserve.runner.verify_ahead import accepted_drafts, shift_batch
from jaxserve.runner.warmup import check_program_memory
from jaxserve.units import cdiv

_LOG = logging.getLogger(__name__)

COMPILE_AHEAD_WORKERS = 8

# "1": a model drafter drafts the next step's tokens right behind every verify step, on the
# device, before the host reads the step back (``PagedDrafter.draft_ahead``). By default only
# behind the verify steps the engine keeps in flight, whose next step is scheduled before they
# are read back (``verify_ahead``): behind a step read back at once it was slower (an H100,
# 2026-12-07: EAGLE-3 at batch 1 10.85 against 10.14 ms a step; benchmarks/spec_decode.py).
DRAFT_AHEAD_ENV = "JAXSERVE_DRAFT_AHEAD"


class TokenSource(Protocol):
    """A sequence as a drafter reads it (the engine's ``Sequence``)."""

    @property
    def seq_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    def token_ids(self, start: int, stop: int) -> list[int]: ...
    @property
    def block_ids(self) -> list[int]: ...  # its pages of the target's cache


@dataclasses.dataclass
class TargetStates:
    """The target's states of its last step, on the device, and where each sequence's rows
    are: what an EAGLE-3 head (the aux layers' states, joined) or DeepSeek-V3's MTP layers
    (the final hidden states) draft from without running the target again."""

    states: jax.Array  # [T, D]
    rows: dict[str, tuple[int, int, int]]  # seq id -> (first row, its position, row count)

    def rows_for(self, seq_id: str, start: int, stop: int) -> range | None:
        """The rows of positions [start, stop) of the sequence, if this step computed them
        all; else None."""
        first_row, first_pos, count = self.rows.get(seq_id, (0, 0, 0))
        if not count or start < first_pos or stop > first_pos + count:
            return None
        return range(first_row + start - first_pos, first_row + stop - first_pos)


def drafter_parallel(
    config: ModelConfig,
    target_tp: TensorParallel | None,
    name: str,
    quant: QuantScheme | None = None,  # the drafter's own (its QArrays' shardings)
) -> TensorParallel | None:
    """A drafter's tensor parallelism: the shardings of ``config`` (the drafter's layers,
    quantized as ``quant`` says) on the target's mesh; None when the target has none. A
    ValueError names the drafter (``name``), the field and the size when its head counts do
    not split over the mesh."""
    if target_tp is None:
        return None
    try:
        return prepare_tp(config, mesh=target_tp.mesh, quant=quant)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def per_device_bytes(tree: Any) -> int:
    """Bytes the arrays of ``tree`` hold on one device: each array's shard (the whole of a
    replicated one)."""
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
    )


def put_on(tp: TensorParallel | None, tree: Any) -> Any:
    """Host arrays on the device(s): replicated over ``tp``'s mesh, else the default device."""
    return tp.put_replicated(tree) if tp is not None else jax.device_put(tree)


class PagePool:
    """A drafter's own pages: a free list, and each sequence's pages in order."""

    def __init__(self, num_pages: int, page_size: int, pages_per_seq: int) -> None:
        self.num_pages, self.page_size, self.pages_per_seq = num_pages, page_size, pages_per_seq
        self._free = list(range(num_pages - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` tokens of the sequence (False, nothing taken: too few)."""
        table = self.tables.setdefault(seq_id, [])
        need = min(cdiv(num_tokens, self.page_size), self.pages_per_seq) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return True

    def release(self, seq_id: str) -> None:
        self._free += reversed(self.tables.pop(seq_id, []))

    def row(self, seq_id: str) -> np.ndarray:  # i32[pages_per_seq]
        row = np.zeros(self.pages_per_seq, np.int32)
        table = self.tables[seq_id]
        row[: len(table)] = table
        return row


@dataclasses.dataclass
class CatchUp:
    """One sequence's part of a drafting call: its tokens [start, stop) (the ones it gained
    since the drafter's last run); ``final``: its last tokens, so its drafts are wanted."""

    seq_id: str
    tokens: list[int]
    start: int
    final: bool


def catch_up_batch(
    parts: list[CatchUp], pool: PagePool, buckets: Buckets, min_tokens: int | None = None
) -> Batch:
    """The step that writes each part's tokens at its positions in its own pages, padded to a
    token bucket (at least ``min_tokens``: warm-up's); ``logits_indices``: each part's last
    row."""
    num_tokens = sum(len(p.tokens) for p in parts)
    t_pad = buckets.token_bucket(max(num_tokens, len(parts), min_tokens or MIN_TOKEN_BUCKET))
    s_pad = buckets.seq_bucket(t_pad)
    pad_slot = pool.num_pages * pool.page_size
    ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.full(t_pad, pad_slot, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    pages = np.zeros((s_pad, pool.pages_per_seq), np.int32)
    cu = np.zeros(s_pad + 1, np.int32)
    row = 0
    for s, part in enumerate(parts):
        n = len(part.tokens)
        pos = np.arange(part.start, part.start + n, dtype=np.int32)
        table = pool.row(part.seq_id)
        ids[row : row + n] = part.tokens
        positions[row : row + n] = pos
        slots[row : row + n] = table[pos // pool.page_size] * pool.page_size + pos % pool.page_size
        kv_lens[s] = part.start + n
        pages[s] = table
        row += n
        cu[s + 1 :] = row
    return Batch(
        input_ids=ids,  # type: ignore[arg-type]  # host arrays until the program's call
        positions=positions,  # type: ignore[arg-type]
        slot_mapping=slots,  # type: ignore[arg-type]
        kv_lens=kv_lens,  # type: ignore[arg-type]
        page_indices=pages,  # type: ignore[arg-type]
        cu_q_lens=cu,  # type: ignore[arg-type]
        num_seqs=np.asarray([len(parts)], np.int32),  # type: ignore[arg-type]
        logits_indices=np.maximum(cu[1:] - 1, 0),  # type: ignore[arg-type]
    )


def decode_batch(batch: Batch, tokens: jax.Array, j: int, page_size: int, pad_slot: int) -> Batch:
    """On the device: the j-th chained step after ``batch`` (j >= 1), one token a sequence,
    ``tokens[s]`` at position j after its logits row's (``logits_indices``: the catch-up's
    last row, at kv_lens[s] - 1; a call drafted ahead picks an earlier one) in the sequence's
    pages; padded to at least ``MIN_TOKEN_BUCKET`` rows."""
    s_pad = batch.kv_lens.shape[0]
    t_pad = max(s_pad, MIN_TOKEN_BUCKET)
    live = jnp.arange(s_pad) < batch.num_seqs[0]
    pos = jnp.where(live, batch.positions[batch.logits_indices] + j, 0)
    page = jnp.take_along_axis(batch.page_indices, (pos // page_size)[:, None], axis=1)[:, 0]
    slot = jnp.where(live, page * page_size + pos % page_size, pad_slot)
    pad = t_pad - s_pad
    return Batch(
        input_ids=jnp.pad(tokens.astype(jnp.int32), (0, pad)),
        positions=jnp.pad(pos, (0, pad)),
        slot_mapping=jnp.pad(slot, (0, pad), constant_values=pad_slot),
        kv_lens=jnp.where(live, pos + 1, 0),
        page_indices=batch.page_indices,
        cu_q_lens=jnp.minimum(jnp.arange(s_pad + 1), batch.num_seqs[0]).astype(jnp.int32),
        num_seqs=batch.num_seqs,
        logits_indices=jnp.arange(s_pad, dtype=jnp.int32),
    )


# A drafting layer's step over a batch and a state per row: (i32[S] the greedy token of each of
# the batch's logits rows, each row's state for the next step [T, H]).
StateStep = Callable[[Batch, jax.Array], tuple[jax.Array, jax.Array]]


def chain_from_states(
    first: StateStep,  # the step over the catch-up
    later: Callable[[int], StateStep],  # the step of chained step j >= 1
    batch: Batch,  # the catch-up
    states: jax.Array,  # [T, H]  each row's input state
    k: int,
    page_size: int,
    pad_slot: int,
) -> jax.Array:  # i32[S, k] greedy drafts
    """The catch-up step, then k - 1 chained one-token steps, each fed the previous draft and
    the previous step's state of the sequence's last row (EAGLE-3's head, MTP layers)."""
    tokens, out = first(batch, states)  # i32[S]
    rows = out[batch.logits_indices]  # [S, H]
    drafts = [tokens]
    s_pad = tokens.shape[0]
    for j in range(1, k):
        step = decode_batch(batch, tokens, j, page_size, pad_slot)
        padded = jnp.pad(rows, ((0, max(s_pad, MIN_TOKEN_BUCKET) - s_pad), (0, 0)))
        tokens, out = later(j)(step, padded)
        rows = out[:s_pad]
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1)


def plan_calls(parts: list[CatchUp], max_tokens: int, max_seqs: int) -> list[list[CatchUp]]:
    """The parts cut into calls of at most ``max_tokens`` tokens and ``max_seqs`` sequences; a
    part longer than a call is split, only its last piece ``final``."""
    calls: list[list[CatchUp]] = [[]]
    used = 0
    for part in parts:
        start = 0
        while start < len(part.tokens):
            if used == max_tokens or len(calls[-1]) == max_seqs:
                calls.append([])
                used = 0
            n = min(len(part.tokens) - start, max_tokens - used)
            final = part.final and start + n == len(part.tokens)
            piece = part.tokens[start : start + n]
            calls[-1].append(CatchUp(part.seq_id, piece, part.start + start, final))
            used += n
            start += n
    return [c for c in calls if c]


def drafts_of(calls: list[list[CatchUp]], run: Callable[[list[CatchUp]], np.ndarray]) -> dict:
    """seq id -> its drafts: ``run`` each call (i32[S, k] drafts per row), kept for the
    sequences whose last piece was in it."""
    drafts: dict[str, list[int]] = {}
    for call in calls:
        out = run(call)
        for s, part in enumerate(call):
            if part.final:
                drafts[part.seq_id] = [int(t) for t in out[s]]
    return drafts


def ahead_batch(
    batch: Batch,  # the verify step's rows again (``PagedDrafter.draft_ahead``)
    sample_rows: jax.Array,  # i32[T]  each row's row of the verify step's sampled ids
    first_sample: jax.Array,  # i32[S]  each sequence's first row of them
    first_draft: jax.Array,  # i32[S]  its first draft's index in the drafts' feed
    num_drafts: jax.Array,  # i32[S]  the drafts it verified
    sampled: jax.Array,  # i32[S_max]  the verify step's sampled ids (on the device)
    drafts: jax.Array,  # i32[S_max]  the drafts it verified (``draft_feed``'s layout)
    shift: jax.Array,  # i32[S_max]  each sequence's shift (``verify_ahead``; zeros: none)
    k: int,  # drafts a sequence verifies at most
    page_size: int,  # the drafter's pages'
) -> Batch:
    """On the device, the catch-up of a call drafted ahead of the host: each row's token
    (``input_ids``) is the one the verify step sampled at that row (a draft model's: the token
    at the row's position; a drafter over the target's states: the token after it), and each
    sequence's chain starts from the row of its last accepted draft (``logits_indices``): the
    drafts that equal the sampled tokens, in order, as the host's ``accepted_run`` counts
    them. A verify step scheduled before the one ahead of it was read back moved on the device
    (``verify_ahead``): its catch-up moves by the same ``shift``."""
    accepted = accepted_drafts(sampled, drafts, first_sample, first_draft, num_drafts, k)
    live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs[0]
    last = jnp.where(live, batch.cu_q_lens[:-1] + accepted, batch.logits_indices)
    batch = dataclasses.replace(
        batch, input_ids=sampled[sample_rows], logits_indices=last.astype(jnp.int32)
    )
    return shift_batch(batch, shift, page_size)


class VerifiedIds(NamedTuple):
    """What a call drafted ahead reads of its verify step, on the device, each i32[S_max]
    (laid out as the step's pending ids, ``no_previous_ids``): the ids it sampled, the drafts
    it verified (``draft_feed``) and each sequence's shift (``verify_ahead``; zeros: none)."""

    sampled: jax.Array
    drafts: jax.Array
    shift: jax.Array


@dataclasses.dataclass
class AheadDrafts:
    """A call drafted ahead of the host (``PagedDrafter.draft_ahead``): its drafts on the
    device, and for each sequence the verify step's (first position, drafts verified)."""

    drafts: DeviceDrafts
    expected: dict[str, tuple[int, int]]


class PackedInputs(NamedTuple):
    """A call's inputs on the device, packed (``PagedDrafter.put_packed``)."""

    buffer: jax.Array  # i32[n]
    layout: Layout  # static: what the programs unpack


class ChainArgs(NamedTuple):
    """The arguments of a call's ``_chain``: (weights, pages, buffer, states...) and the
    buffer's layout (the call's static argument)."""

    args: tuple[Any, ...]
    layout: Layout


class PagedDrafter:
    """What every drafter with a paged cache of its own does the same way: its token buckets
    and ``PagePool`` (``max_seqs`` sequences of ``max_model_len + k`` tokens), a sequence's
    pages taken for a call (idle sequences' pages given back when none are free), the calls
    planned and run, warm-up and ``free``. A subclass builds its ``CatchUp`` (``_catch_up``)
    and runs a call's compiled program (``_chain``, jitted by ``jit_chain``, on the
    arguments ``_chain_args`` makes: ``_run``); ``tp``: its layers' tensor parallelism
    (``drafter_parallel``), None on one device."""

    _chain: jax.stages.Wrapped
    _ahead: jax.stages.Wrapped  # the chain of a call drafted ahead (``draft_ahead``)

    def __init__(
        self,
        engine: Any,
        max_model_len: int,
        max_seqs: int,
        k: int,
        tp: TensorParallel | None = None,
    ) -> None:
        self.k, self.tp = k, tp
        self.buckets = Buckets.of(
            max_num_batched_tokens=max(engine.max_num_batched_tokens, max_seqs),
            max_num_seqs=max_seqs,
            max_model_len=max_model_len + k,
            block_size=engine.block_size,
        )
        pages_per_seq = self.buckets.pages_per_seq
        self.pool = PagePool(max_seqs * pages_per_seq, engine.block_size, pages_per_seq)
        self.computed: dict[str, int] = {}  # seq id -> tokens the drafter's cache holds
        # Calls drafted ahead of the host (``draft_ahead``): on (a subclass with a runner;
        # behind every verify step with JAXSERVE_DRAFT_AHEAD=1, ``ahead_always``; else behind
        # those verified ahead, on one device), made, and taken by a step (``take_ahead``).
        self.ahead_always = os.environ.get(DRAFT_AHEAD_ENV, "0").strip() == "1"
        self.drafts_ahead = self.ahead_always or (verify_ahead.enabled() and tp is None)
        self.ahead_calls = self.ahead_taken = 0

    @property
    def pad_slot(self) -> int:
        """The slot padding rows write to: past every page."""
        return self.pool.num_pages * self.pool.page_size

    def put(self, tree: Any) -> Any:
        """A call's host inputs on the drafter's device(s) (replicated under TP)."""
        return put_on(self.tp, tree)

    def put_packed(self, inputs: dict[str, Any]) -> PackedInputs:
        """A call's host inputs (``"chain"``: the chain's, after the pages; other keys: what
        another of the drafter's programs reads) on the device as one buffer."""
        buffer, layout = pack(inputs)
        return PackedInputs(self.put(buffer), layout)

    def jit_chain(
        self, chain: Callable[..., Any], pages: Any, weights: Any = None
    ) -> jax.stages.Wrapped:
        """``chain``: (weights, pages, inputs..., states...) -> (pages, i32[S, k] drafts),
        jitted to take its inputs packed: (weights, pages, buffer, states..., layout=) with
        the buffer's ``"chain"`` entry as the inputs (``put_packed``). The pages are donated;
        under TP they keep the shardings of ``pages`` (the drafter's cache) and the drafts
        come back replicated. fp8 ``weights`` compile under the fp8 programs' XLA options
        (``programs.compiler_options``), as the target's model step does."""
        options = compiler_options(False, fp8_weights=holds_fp8(weights))

        def drafting_chain(
            weights: Any, pages: Any, buffer: jax.Array, *rest: Any, layout: Layout
        ) -> Any:  # (its name is the program's in traces and errors: jit(drafting_chain))
            return chain(weights, pages, *unpack(buffer, layout)["chain"], *rest)

        if self.tp is None:
            return jax.jit(
                drafting_chain,
                donate_argnums=(1,),
                static_argnames=("layout",),
                compiler_options=options,
            )
        shardings = jax.tree.map(lambda page: page.sharding, pages)
        return jax.jit(
            drafting_chain,
            donate_argnums=(1,),
            static_argnames=("layout",),
            out_shardings=(shardings, self.tp.replicated),
            compiler_options=options,
        )

    def device_bytes(self, target_weights: Any = None) -> int:
        """What the drafter holds on a device besides the target's: its weights and pages
        less any array of ``target_weights`` it reads (an EAGLE-3 head's or an MTP layer's
        embedding and head), and what the runner keeps for it (``kept_bytes``). The runner
        takes it out of the KV cache's budget (``Runner.reserve_for_drafter``)."""
        shared = {id(leaf) for leaf in jax.tree.leaves(target_weights)}
        own = [leaf for leaf in jax.tree.leaves(self.arrays()) if id(leaf) not in shared]
        return per_device_bytes(own) + self.kept_bytes()

    def arrays(self) -> Any:
        """The drafter's weights and pages (the target's arrays among them where it reads
        them)."""
        raise NotImplementedError

    def kept_bytes(self) -> int:
        """Per device, what the runner keeps for the drafter beyond its own step (none)."""
        return 0

    def free(self, seq_id: str) -> None:
        self.pool.release(seq_id)
        self.computed.pop(seq_id, None)

    def warmup(self, headroom_bytes: int | None = None) -> int:
        """Compiles the program of every token bucket (padding steps), ahead on threads, then
        runs each once; returns their count. ``headroom_bytes``: the activation headroom beside
        the KV cache, which the programs' temporaries come out of (a warning where the largest
        plans more: ``warmup.check_program_memory``)."""
        compiled: list[Any] = []
        compile_ahead(self._lowerings(), compiled)
        check_program_memory("The drafter's", compiled, headroom_bytes)
        for bucket in self.buckets.token_buckets:
            self._run([], bucket)
        if self.ahead_on:  # each bucket's call drafted ahead, once
            for bucket in self.buckets.token_buckets:
                self._warm_ahead(bucket)
        return len(self.buckets.token_buckets) * (2 if self.ahead_on else 1)

    @property
    def ahead_on(self) -> bool:
        """Whether calls are drafted ahead (``draft_ahead``): asked for, with a runner whose
        step programs feed drafts to its steps."""
        runner = getattr(self, "runner", None)
        return self.drafts_ahead and getattr(runner, "programs", None) is not None

    def drafts_shapes(self) -> list[tuple[int, int]]:
        """The shapes of a call's drafts (i32[S, k]: S the sequence rows of its token bucket),
        one per distinct S: what a verify step that reads them on the device takes."""
        rows = {self.buckets.seq_bucket(bucket) for bucket in self.buckets.token_buckets}
        return [(s, self.k) for s in sorted(rows)]

    def _lowerings(self) -> list[Callable[[], Any]]:
        """What warm-up compiles ahead: for each program, a thunk that lowers it against the
        arguments of its warm-up call (``compile_ahead``)."""
        buckets = self.buckets.token_buckets
        thunks: list[Callable[[], Any]] = [functools.partial(self._lower_chain, b) for b in buckets]
        if self.ahead_on:
            thunks += [functools.partial(self._lower_ahead, b) for b in buckets]
        return thunks

    def _lower_chain(self, bucket: int) -> Any:
        args = self._chain_args([], bucket)
        return self._chain.lower(*args.args, layout=args.layout)

    def propose(
        self, seqs: Sequence[TokenSource], k: int, on_device: bool = False
    ) -> dict[str, list[int]] | DeviceDrafts:
        """seq id -> up to ``k`` drafts; ``on_device``: left on the device when one call
        drafts them all (``DeviceDrafts``: the verify step reads them there)."""
        parts = [part for seq in seqs if (part := self._catch_up(seqs, seq)) is not None]
        if not parts:
            return {}
        calls = plan_calls(parts, self.buckets.token_buckets[-1], self.buckets.max_seq_bucket)
        drafts: dict[str, list[int]] | DeviceDrafts
        if on_device and len(calls) == 1 and all(part.final for part in calls[0]):
            rows = {part.seq_id: s for s, part in enumerate(calls[0])}
            drafts = DeviceDrafts(self._device_run(calls[0]), rows, min(k, self.k))
        else:
            drafts = {seq_id: d[:k] for seq_id, d in drafts_of(calls, self._run).items()}
        for part in parts:  # the drafted positions are written over by the next catch-up
            self.computed[part.seq_id] = part.start + len(part.tokens)
        self._end_call()
        return drafts

    def draft_ahead(self, sched: SchedulerOutput, step: InFlight) -> AheadDrafts | None:
        """The next step's drafts, queued on the device right behind a verify step that took
        its drafts there (``sched.device_drafts``), before the host reads it back: the call
        the next ``propose`` would run once the host knew the accepted tokens. Its catch-up
        covers every row the step verified: each sequence's d + 1 rows (its last token and
        drafts), from the verify step's first position (``AHEAD_OFFSET`` after it: a draft
        model has the last token in its cache already), each row's token the one the step
        sampled there, and the chain starts from the row of the last accepted draft
        (``ahead_batch``). Rows past the accepted ones write K/V at positions the chain and
        the next catch-up write over, never read. None where it does not apply: a sequence
        of the step verified no drafts (a prompt's chunk), the pages or one call do not fit,
        a subclass's own rule (``_ahead_applies``). ``step``: the verify step in flight, its
        rows (``InFlight.verified``), drafts feed and shift (``verify_ahead``; the catch-up
        moves with it)."""
        # (``verified`` and ``drafts_feed`` are set together, for a step with device drafts)
        if not self.ahead_on or step.verified is None or step.drafts_feed is None:
            return None
        programs = self.runner.programs  # type: ignore[attr-defined]
        parts, expected = [], {}
        offset = self.AHEAD_OFFSET
        for item in sched.scheduled:
            seq_id, d = item.seq.seq_id, len(item.draft_token_ids)
            if seq_id not in step.verified or not self._ahead_applies(item.start, seq_id, d):
                return None
            total = item.start + offset + d + 1 + self.k  # the chain's last position, all accepted
            if total > self.buckets.pages_per_seq * self.pool.page_size:
                return None
            if not self.pool.ensure(seq_id, total):
                return None
            parts.append(CatchUp(seq_id, [0] * (d + 1), item.start + offset, final=True))
            expected[seq_id] = (item.start, d)
        calls = plan_calls(parts, self.buckets.token_buckets[-1], self.buckets.max_seq_bucket)
        if len(calls) != 1 or len(calls[0]) != len(parts):
            return None
        batch = catch_up_batch(parts, self.pool, self.buckets)
        num_rows, num_seqs = batch.input_ids.shape[0], batch.kv_lens.shape[0]
        sample_rows = np.zeros(num_rows, np.int32)
        first_sample = np.zeros(num_seqs, np.int32)
        first_draft = np.zeros(num_seqs, np.int32)
        num_drafts = np.zeros(num_seqs, np.int32)
        row = 0
        for s, part in enumerate(parts):
            first_sample[s], num_drafts[s], first_draft[s] = step.verified[part.seq_id]
            n = len(part.tokens)
            sample_rows[row : row + n] = np.arange(first_sample[s], first_sample[s] + n)
            row += n
        chain = (batch, sample_rows, first_sample, first_draft, num_drafts)
        shift = programs.no_previous_ids if step.shift is None else step.shift  # zeros: none
        ids = self._call_ahead(parts, chain, VerifiedIds(step.sampled_ids, step.drafts_feed, shift))
        self.ahead_calls += 1
        rows = {part.seq_id: s for s, part in enumerate(parts)}
        return AheadDrafts(DeviceDrafts(ids, rows, self.k), expected)

    def take_ahead(
        self, ahead: AheadDrafts, seqs: Sequence[TokenSource], k: int
    ) -> DeviceDrafts | None:
        """``ahead``'s drafts for the sequences that decode now (``seqs``), when it drafted
        for each of them (those that finished since are left out) and each gained 1 to d + 1
        tokens (its accepted drafts and the target's token) since; else None (the caller
        proposes as usual: the catch-up from ``computed`` writes over what the call ahead
        wrote). The drafter's cache then holds each one's tokens as after a call of its own
        (``computed``)."""
        if not seqs or any(seq.seq_id not in ahead.expected for seq in seqs):
            return None
        for seq in seqs:
            start, d = ahead.expected[seq.seq_id]
            if not 2 <= seq.num_tokens - start <= d + 2:
                return None
        for seq in seqs:
            self.computed[seq.seq_id] = seq.num_tokens - 1 + self.AHEAD_OFFSET
        return self.take_in_flight(ahead, seqs, k)

    def take_in_flight(
        self, ahead: AheadDrafts, seqs: Sequence[TokenSource], k: int
    ) -> DeviceDrafts | None:
        """``ahead``'s drafts for the next verify step scheduled before the step they were
        drafted behind is read back (``verify_ahead``): for each of ``seqs`` when it drafted for
        each of them, else None. What the host cannot check yet (how many tokens each gained)
        the device corrects; the drafter's ``computed`` follows on the read back
        (``caught_up``)."""
        if not seqs or any(seq.seq_id not in ahead.expected for seq in seqs):
            return None
        self.ahead_taken += 1
        rows = {seq.seq_id: ahead.drafts.rows[seq.seq_id] for seq in seqs}
        return DeviceDrafts(ahead.drafts.ids, rows, min(k, self.k))

    def caught_up(self, seq_id: str, num_tokens: int) -> None:
        """A verify step of the sequence's, scheduled ahead (``take_in_flight``), was read back
        and it has ``num_tokens`` known tokens: the drafter's cache holds them, as after
        ``take_ahead``."""
        if seq_id in self.pool.tables:
            self.computed[seq_id] = num_tokens - 1 + self.AHEAD_OFFSET

    # Where a call drafted ahead starts its catch-up, after the verify step's first position:
    # 1 for a draft model (the step's first token is in its cache), 0 for a drafter over the
    # target's states (its catch-up ends a position before the last known token).
    AHEAD_OFFSET = 1

    def _ahead_applies(self, start: int, seq_id: str, num_drafts: int) -> bool:
        """A subclass's own condition for drafting ahead for a sequence whose verified rows
        start at ``start``."""
        return True

    def _call_ahead(self, parts: list[CatchUp], chain: tuple, ids: VerifiedIds) -> jax.Array:
        """Run the call drafted ahead (``chain``: ``ahead_batch``'s inputs, the batch first)
        on the verify step's ``ids``; its drafts i32[S, k]."""
        raise NotImplementedError

    def _lower_ahead(self, bucket: int) -> Any:
        args, layout = self._ahead_padding_args(bucket)
        return self._ahead.lower(*args, layout=layout)

    def _warm_ahead(self, bucket: int) -> None:
        """Run a padding call drafted ahead of ``bucket`` rows (warm-up)."""
        raise NotImplementedError

    def _ahead_padding_args(self, bucket: int) -> tuple[tuple[Any, ...], Layout]:
        """A padding call drafted ahead (``_ahead``) of ``bucket`` rows: its arguments (the
        verify step's sampled ids, its drafts' feed and its shift, each shaped and laid out as
        the step's pending ids, ``no_previous_ids``) and its packed inputs' layout."""
        raise NotImplementedError

    def _ahead_padding_chain(self, bucket: int) -> tuple:
        """``ahead_batch``'s inputs of a padding call of ``bucket`` rows."""
        batch = catch_up_batch([], self.pool, self.buckets, bucket)
        rows, seqs = np.zeros(bucket, np.int32), np.zeros(batch.kv_lens.shape[0], np.int32)
        return (batch, rows, seqs, seqs, seqs)

    def _take_pages(self, seqs: Sequence[TokenSource], seq: TokenSource) -> bool:
        """Pages for the sequence's tokens and drafts; False: no room (it drafts nothing)."""
        n = seq.num_tokens
        if n + self.k > self.buckets.pages_per_seq * self.pool.page_size:
            return False  # no room for the drafts' positions
        if self.pool.ensure(seq.seq_id, n + self.k):
            return True
        drafting = {s.seq_id for s in seqs}
        for idle in [i for i in self.pool.tables if i not in drafting]:
            self.free(idle)
        return self.pool.ensure(seq.seq_id, n + self.k)

    def _end_call(self) -> None:
        """What a subclass forgets once a call's drafts are read."""

    def _catch_up(self, seqs: Sequence[TokenSource], seq: TokenSource) -> CatchUp | None:
        raise NotImplementedError

    def _chain_args(self, call: list[CatchUp], bucket: int | None = None) -> ChainArgs:
        """The arguments of the call's ``_chain`` (a padding call of ``bucket`` tokens when
        ``call`` is empty)."""
        raise NotImplementedError

    def _run(self, call: list[CatchUp], bucket: int | None = None) -> np.ndarray:
        """The call's drafts (i32[S, k]) on the host."""
        return np.asarray(self._device_run(call, bucket))

    def _device_run(self, call: list[CatchUp], bucket: int | None = None) -> jax.Array:
        """The call's drafts (i32[S, k]) on the device, the drafter's pages given back by its
        chain."""
        raise NotImplementedError

    def _call_chain(self, args: ChainArgs) -> tuple[Any, jax.Array]:
        """(pages, drafts) of the compiled chain on ``args``."""
        return self._chain(*args.args, layout=args.layout)


def compile_ahead(lowerings: list[Callable[[], Any]], compiled_out: list | None = None) -> int:
    """Lower each program here and compile them on up to ``COMPILE_AHEAD_WORKERS`` threads;
    returns how many compiled (and appends each to ``compiled_out``, if given). A jitted
    function keeps what ``lower(...).compile()`` made for its arguments, so the calls that
    follow with the same shapes compile nothing. A program that fails here (e.g. out of device
    memory beside the KV cache while XLA tunes its kernels) compiles at its call as it would
    have: its error, if it has one, is raised there."""
    if not lowerings:
        return 0
    lowered = [lower() for lower in lowerings]
    compiled = 0
    workers = min(COMPILE_AHEAD_WORKERS, len(lowered))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="drafter") as pool:
        for future in [pool.submit(program.compile) for program in lowered]:
            try:
                program = future.result()
                compiled += 1
                if compiled_out is not None:
                    compiled_out.append(program)
            except Exception as exc:  # compiled again, alone, at the call
                _LOG.debug("A drafter program did not compile ahead: %s", exc)
    return compiled
