"""The EAGLE-3 drafter (``method: eagle3``): a head (``models/eagle3.py``) over the target's aux
hidden states, its own pages, and the compiled program that drafts k tokens greedily.

The head reads the target's hidden states at ``head_config.aux_layers(L)`` for every token the
target accepted. The runner's model step returns them (``ModelRunner.keep_target_states``: the
states entering those layers, joined, ``Forward.aux``) and the runner keeps the last step's
(``runner.last_states``). A call takes each sequence's rows from there when the last step
computed every position the head has not read yet: a decode or verify step after the last
call, or a prompt computed in one step; that is every call while each step drafts. Otherwise
(a prompt computed in chunks, or steps without drafts: more sequences ran than
``disable_by_batch_size``) the call runs the TARGET again over those positions, on the runner's
own KV cache (donated and given back; its writes go to no page: the target computed them
already), ``decoder.forward_with_aux`` with the runner's weights as they are now.

Under tensor parallelism the head is split on the target's mesh (``load_head``,
``sharding.eagle3_specs``), its pages on KV heads, and its attention runs per device
(``tp.attention_fn``); the target's states, which its step returns as it does on one device,
are replicated, and the call that runs the target again does so on the runner's mesh with its
attention op and KV shardings.

Per call, in one compiled program per token bucket: ``fuse_aux_hidden`` over the states of each
sequence's new positions [s, n - 1) (the last known token has no hidden state yet), one
``eagle3_step`` over the same positions with the tokens shifted by one (position i reads the
token at i + 1) whose last row proposes the token at n, then k - 1 chained one-token steps,
each fed the previous draft and the previous step's pre-norm row. Drafts are argmaxes over
target ids (``d2t`` mapped). The head's one layer of cache is indexed by a
``drafting.PagePool``, sized as the draft model's (``runner/draft_model.py``), with the same
rules for idle sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder, moe
from jaxserve.models.batch import Batch, KVCache
from jaxserve.models.decoder import AttentionFn
from jaxserve.models.eagle3 import (
    Eagle3Config,
    Eagle3Weights,
    eagle3_forward,
    fuse_aux_hidden,
    greedy_draft,
    make_eagle3_kv_cache,
)
from jaxserve.models.layers import Weights, fuse_layer
from jaxserve.models.loading.eagle3_checkpoint import (
    check_head_quantization,
    load_eagle3,
    quantized_head,
    read_eagle3_config,
)
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner.drafting import (
    CatchUp,
    ChainArgs,
    PackedInputs,
    PagedDrafter,
    TokenSource,
    VerifiedIds,
    ahead_batch,
    catch_up_batch,
    chain_from_states,
    drafter_parallel,
    put_on,
)
from jaxserve.runner.packing import Layout, unpack
from jaxserve.runner.parallel.sharding import TensorParallel, eagle3_shardings
from jaxserve.runner.programs import step_attention
from jaxserve.runner.sleep import free
from jaxserve.runner.weight_update import committed

_LOG = logging.getLogger(__name__)

HeadKV = tuple[jax.Array, jax.Array]


def eagle3_chain(
    head: Eagle3Weights,
    head_kv: HeadKV,
    batch: Batch,  # the target's tokens [s, n - 1) of each sequence, in the head's pages
    head_ids: jax.Array,  # i32[T]  each row's next token (the head's input_ids)
    states: jax.Array,  # [T, A * H_t]  the target's aux states of the batch's rows, joined
    head_config: Eagle3Config,
    k: int,
    page_size: int,
    pad_slot: int,
    attention_fn: AttentionFn | None = None,  # under TP: the op per device (tp.attention_fn)
) -> tuple[HeadKV, jax.Array]:  # (head_kv, i32[S, k] drafts)
    """The head's step over the target's aux states, then k - 1 chained head steps from each
    sequence's last row (its pre-norm state)."""
    pages = [head_kv]

    def step(step_batch: Batch, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        pages[0], normed, prenorm = eagle3_forward(
            head, pages[0], step_batch, hidden, head_config, attention_fn
        )
        return greedy_draft(head, normed[step_batch.logits_indices]), prenorm

    shifted = dataclasses.replace(batch, input_ids=head_ids)
    hidden = fuse_aux_hidden(head, [states])
    drafts = chain_from_states(step, lambda j: step, shifted, hidden, k, page_size, pad_slot)
    return pages[0], drafts


def target_states(
    weights: Weights,
    kv_cache: KVCache,  # the runner's, donated: given back as it was
    batch: Batch,  # the positions again, in the target's pages, every write to no page
    config: ModelConfig,
    aux_layers: tuple[int, ...] | None,
    kv_scales: Any,
    attention_fn: AttentionFn | None = None,  # under TP: the runner's (tp.attention_fn)
    experts_fn: moe.ExpertsFn | None = None,  # under TP, a target with experts: tp.experts_fn
) -> tuple[KVCache, jax.Array]:  # (kv_cache, [T, D])
    """The target's states over positions it computed already: the aux layers' joined
    (``aux_layers``), or the final hidden states (None)."""
    kv_cache, hidden, aux = decoder.forward_with_aux(
        weights, kv_cache, batch, config, aux_layers or (), attention_fn, kv_scales, experts_fn
    )
    return kv_cache, jnp.concatenate(aux, axis=-1) if aux_layers else hidden


def _take_rows(states: jax.Array, buffer: jax.Array, layout: Layout) -> jax.Array:
    """[T, D] -> [R, D]: the rows of a call's packed inputs (their ``"rows"``)."""
    return states[unpack(buffer, layout)["rows"]]


class TargetStatesDrafter(PagedDrafter):
    """A drafter over the target's states (module docstring): from the runner's last step
    when it computed every position a call needs, else from the target run again over the
    runner's cache. Its catch-up reads tokens [start, n - 1) and keeps each row's next token
    for the drafting layers (``_head_ids``). EAGLE-3's head and DeepSeek-V3's MTP layers draft
    from it: a subclass sets ``draft_weights`` (its layers), ``draft_kv`` (their pages) and
    ``_chain`` (the compiled program: (weights, pages, batch, next ids, states) -> (pages,
    i32[S, k] drafts), the pages donated: ``jit_chain``); ``tp``: the drafting layers' tensor
    parallelism on the runner's mesh (``drafter_parallel``), None on one device."""

    draft_weights: Any
    draft_kv: Any

    def __init__(
        self,
        target_config: ModelConfig,
        runner: Any,  # the ModelRunner: its weights, KV cache and last states, now
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        aux_layers: tuple[int, ...] | None,  # None: the final hidden states
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(engine, max_model_len, max_seqs, k, tp)
        self.target_config, self.runner = target_config, runner
        self.aux_layers = aux_layers
        self.state_dim = target_config.hidden_size * (len(aux_layers) if aux_layers else 1)
        self._next: dict[str, tuple[int, list[int]]] = {}  # seq id -> (start, tokens from it)
        self._blocks: dict[str, list[int]] = {}  # seq id -> the target's pages, this call
        self.recomputed_tokens = 0  # positions the target ran again for (module docstring)
        runner.keep_target_states(aux_layers)
        self._take, self._recompute = self._jit_target_programs()

    def jit_chains(self, chain: Callable[..., Any]) -> None:
        """``_chain`` (``jit_chain``) and ``_ahead``: the same chain on ``ahead_batch``'s
        catch-up (its inputs packed: the batch, sample rows, first samples, first drafts,
        drafts a sequence; its arguments: the rows' states, the verify step's sampled ids,
        its drafts' feed), each row's next token the one sampled there."""
        self._chain = self.jit_chain(chain, self.draft_kv, self.draft_weights)

        def ahead(weights, pages, batch, *rest):  # rest: the packed rows, states, ids, shift
            *rows, states, sampled, drafts, shift = rest  # rows: sample rows, first samples, ...
            page_size = self.pool.page_size
            batch = ahead_batch(batch, *rows, sampled, drafts, shift, k=self.k, page_size=page_size)
            return chain(weights, pages, batch, batch.input_ids, states)

        self._ahead = self.jit_chain(ahead, self.draft_kv, self.draft_weights)

    def _jit_target_programs(self) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
        """(the gather of a call's rows from a step's states, the target run again over the
        runner's cache, donated); under TP both on the runner's mesh, the target with its
        attention op per device, its cache keeping its shardings, the states replicated."""
        runner, tp = self.runner, self.runner.tp
        recompute = functools.partial(
            target_states,
            config=self.target_config,
            aux_layers=self.aux_layers,
            kv_scales=runner.kv_scales,
            attention_fn=step_attention(tp),  # one lowering for every layer (as the step's)
        )
        static = ("layout",)
        if tp is None:
            take = jax.jit(_take_rows, static_argnames=static)
            return take, jax.jit(recompute, donate_argnums=(1,))
        recompute = functools.partial(recompute, experts_fn=tp.experts_fn)
        kv = tp.kv_cache_shardings(self.target_config.num_layers)
        return (
            jax.jit(_take_rows, static_argnames=static, out_shardings=tp.replicated),
            jax.jit(recompute, donate_argnums=(1,), out_shardings=(kv, tp.replicated)),
        )

    def arrays(self) -> Any:
        return self.draft_weights, self.draft_kv

    def kept_bytes(self) -> int:
        """The states of the runner's largest step kept for the drafter, and a call's rows
        gathered from them (its largest bucket): two ``[T, state_dim]`` arrays (at 8,192
        tokens of Llama-3-8B's three aux layers, 201 MB each)."""
        rows = max(self.runner.buckets.token_buckets[-1], self.buckets.token_buckets[-1])
        return 2 * rows * self.state_dim * jnp.dtype(self.runner.dtype).itemsize

    def warmup(self, headroom_bytes: int | None = None) -> int:
        """The drafting programs of every token bucket, the target's run again over its cache
        (once the runner's cache is allocated) and the gathers from a step's states, all
        compiled ahead on threads (``PagedDrafter.warmup``)."""
        count = super().warmup(headroom_bytes)
        if self.runner.kv_cache is not None:
            for bucket in self.buckets.token_buckets:
                batch = catch_up_batch([], self.pool, self.buckets, bucket)
                self._target_states_again([], batch)
            count += len(self.buckets.token_buckets)
        # The gathers of a call's rows from a step's states: one per (step bucket, call bucket).
        padding = [self._padding_inputs(bucket) for bucket in self.buckets.token_buckets]
        for step_rows in self.runner.buckets.token_buckets:
            states = self._padding_states(step_rows)
            for inputs in padding:
                self._take(states, inputs.buffer, layout=inputs.layout)
            del states
        self.recomputed_tokens = 0
        return count

    def shutdown(self) -> None:
        """Give the device memory back (the engine shut down): the drafting layers' pages
        freed, their weights let go (an embedding shared with the target is the target's)."""
        free(self.draft_kv)
        self.draft_kv = self.draft_weights = None

    def _lowerings(self) -> list[Callable[[], Any]]:
        thunks = super()._lowerings()
        if self.runner.kv_cache is not None:
            thunks += [functools.partial(self._lower_again, b) for b in self.buckets.token_buckets]
        steps, calls = self.runner.buckets.token_buckets, self.buckets.token_buckets
        thunks += [functools.partial(self._lower_gather, n, b) for n in steps for b in calls]
        return thunks

    # A call drafted ahead (``PagedDrafter.draft_ahead``) starts at the verify step's first
    # position: this drafter's catch-up ends a position before the last known token.
    AHEAD_OFFSET = 0

    def _ahead_applies(self, start: int, seq_id: str, num_drafts: int) -> bool:
        """The verify step's states hold the sequence's verified rows."""
        last = self.runner.last_states
        return last is not None and last.rows_for(seq_id, start, start + num_drafts + 1) is not None

    def _call_ahead(self, parts: list[CatchUp], chain: tuple, ids: VerifiedIds) -> jax.Array:
        """The call drafted ahead over the verify step's states of the parts' rows."""
        last = self.runner.last_states
        state_rows = self._state_rows(parts, chain[0].input_ids.shape[0])
        assert last is not None and state_rows is not None  # (``_ahead_applies``)
        inputs = self.put_packed({"chain": chain, "rows": state_rows})
        states = self._take(last.states, inputs.buffer, layout=inputs.layout)
        args = (self.draft_weights, self.draft_kv, inputs.buffer, states, *ids)
        self.draft_kv, drafts = self._ahead(*args, layout=inputs.layout)
        return drafts

    def _warm_ahead(self, bucket: int) -> None:
        args, layout = self._ahead_padding_args(bucket)
        self.draft_kv, _ = self._ahead(*args, layout=layout)

    def _ahead_padding_args(self, bucket: int) -> tuple[tuple[Any, ...], Layout]:
        rows = np.zeros(bucket, np.int32)
        inputs = self.put_packed({"chain": self._ahead_padding_chain(bucket), "rows": rows})
        ids = self.runner.programs.no_previous_ids
        states = self._padding_states(bucket)
        args = (self.draft_weights, self.draft_kv, inputs.buffer, states, ids, ids, ids)
        return args, inputs.layout

    def _lower_again(self, bucket: int) -> Any:
        batch = catch_up_batch([], self.pool, self.buckets, bucket)
        return self._recompute.lower(*self._again_args([], batch))

    def _lower_gather(self, step_rows: int, bucket: int) -> Any:
        """The gather of a call's rows (``bucket``) from a step's states (``step_rows``)."""
        states = self._padding_states(step_rows)
        inputs = self._padding_inputs(bucket)
        return self._take.lower(states, inputs.buffer, layout=inputs.layout)

    def _padding_states(self, rows: int) -> jax.Array:
        """Zero states of ``rows`` rows, laid out and committed as a step's (``Forward.aux``,
        the output of a jitted program): a program lowered against uncommitted ones would
        compile again at its first call while serving."""
        states = put_on(self.runner.tp, np.zeros((rows, self.state_dim), self.runner.dtype))
        return committed(states)

    def _end_call(self) -> None:
        self._next.clear()
        self._blocks.clear()

    def _catch_up(self, seqs: Sequence[TokenSource], seq: TokenSource) -> CatchUp | None:
        """The sequence's part of this call, tokens [start, n - 1) for the target, its pages
        taken (None: too short, or no pages: no draft)."""
        n = seq.num_tokens
        if n < 2 or not self._take_pages(seqs, seq):
            return None  # no hidden state to read yet, or no room: no draft
        start = min(self.computed.get(seq.seq_id, 0), n - 2)  # at least the last row
        tokens = seq.token_ids(start, n)
        self._next[seq.seq_id] = (start, tokens)
        self._blocks[seq.seq_id] = seq.block_ids  # read in this call only: no copy
        return CatchUp(seq.seq_id, tokens[:-1], start, final=True)

    def _head_ids(self, call: list[CatchUp], num_rows: int) -> np.ndarray:
        """Each row's next token (the head reads the token after its position), as the rows
        of ``catch_up_batch``."""
        ids = np.zeros(num_rows, np.int32)
        row = 0
        for part in call:
            start, tokens = self._next[part.seq_id]
            offset = part.start - start + 1
            ids[row : row + len(part.tokens)] = tokens[offset : offset + len(part.tokens)]
            row += len(part.tokens)
        return ids

    def _chain_args(self, call: list[CatchUp], bucket: int | None = None) -> ChainArgs:
        """The call's batch, each row's next token and (the ``_take`` program's) each row's
        row of the last step's states, packed; and the rows' states."""
        batch = catch_up_batch(call, self.pool, self.buckets, bucket)
        num_rows = batch.input_ids.shape[0]
        rows = self._state_rows(call, num_rows)
        inputs = self._inputs(call, batch, rows)
        if not call:  # warm-up's padding
            states = self._padding_states(num_rows)
        elif rows is None:
            states = self._target_states_again(call, batch)
        else:
            assert self.runner.last_states is not None
            states = self._take(self.runner.last_states.states, inputs.buffer, layout=inputs.layout)
        return ChainArgs((self.draft_weights, self.draft_kv, inputs.buffer, states), inputs.layout)

    def _inputs(self, call: list[CatchUp], batch: Batch, rows: np.ndarray | None) -> PackedInputs:
        """The call's packed inputs: the batch and each row's next token (the chain's), and
        each row's row of the last step's states (``_take``'s; zeros when it runs again)."""
        num_rows = batch.input_ids.shape[0]
        return self.put_packed(
            {
                "chain": (batch, self._head_ids(call, num_rows)),
                "rows": np.zeros(num_rows, np.int32) if rows is None else rows,
            }
        )

    def _padding_inputs(self, bucket: int) -> PackedInputs:
        """Warm-up's: a padding call's packed inputs of ``bucket`` tokens."""
        return self._inputs([], catch_up_batch([], self.pool, self.buckets, bucket), None)

    def _device_run(self, call: list[CatchUp], bucket: int | None = None) -> jax.Array:
        self.draft_kv, drafts = self._call_chain(self._chain_args(call, bucket))
        return drafts

    def _state_rows(self, call: list[CatchUp], num_rows: int) -> np.ndarray | None:
        """Where the call's rows are in the last step's states (i32[num_rows], padding rows
        0), when that step computed them all; else None (the target runs again)."""
        last = self.runner.last_states
        if not call or last is None:
            return None
        rows = np.zeros(num_rows, np.int32)
        row = 0
        for part in call:
            found = last.rows_for(part.seq_id, part.start, part.start + len(part.tokens))
            if found is None:
                return None
            rows[row : row + len(found)] = found
            row += len(found)
        return rows

    def _target_states_again(self, call: list[CatchUp], batch: Batch) -> jax.Array:
        """The target run again over the call's positions, on the runner's cache: the same
        rows in the target's pages, every write to the slot past the last page (dropped)."""
        self.recomputed_tokens += sum(len(part.tokens) for part in call)
        self.runner.kv_cache, states = self._recompute(*self._again_args(call, batch))
        return states

    def _again_args(self, call: list[CatchUp], batch: Batch) -> tuple[Any, ...]:
        """The arguments of ``_recompute`` for the call's rows of ``batch``."""
        runner = self.runner
        pages = np.zeros_like(batch.page_indices)
        for s, part in enumerate(call):
            blocks = self._blocks[part.seq_id][: pages.shape[1]]
            pages[s, : len(blocks)] = blocks
        slots = np.full_like(batch.slot_mapping, runner.num_slots)
        # host arrays until the call, as catch_up_batch's
        again = dataclasses.replace(batch, page_indices=pages, slot_mapping=slots)  # type: ignore[arg-type]
        return runner.weights, runner.kv_cache, put_on(runner.tp, again)


class Eagle3Proposer(TargetStatesDrafter):
    """Greedy drafts of an EAGLE-3 head over the target's aux hidden states (module
    docstring)."""

    def __init__(
        self,
        head_config: Eagle3Config,
        head: Eagle3Weights,
        target_config: ModelConfig,
        runner: Any,  # the ModelRunner
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
        tp: TensorParallel | None = None,  # load_head's: the head's layout on the mesh
    ) -> None:
        aux_layers = tuple(head_config.aux_layers(target_config.num_layers))
        super().__init__(target_config, runner, engine, max_model_len, max_seqs, k, aux_layers, tp)
        self.head_config, self.draft_weights = head_config, head
        page, num_pages = engine.block_size, self.pool.num_pages
        # committed, as the pages each call gives back are (``weight_update.committed``)
        self.draft_kv = committed(
            make_eagle3_kv_cache(head_config, num_pages, page, dtype)
            if tp is None
            else tp.make_kv_cache(num_pages, page, dtype)[0]  # its one layer, on KV heads
        )
        chain = functools.partial(
            eagle3_chain,
            head_config=head_config,
            k=k,
            page_size=page,
            pad_slot=self.pad_slot,
            attention_fn=step_attention(tp),  # one lowering for every layer and step
        )
        self.jit_chains(chain)

    def describe(self) -> str:
        size = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.draft_weights))
        cache = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.draft_kv))
        source = "the target's step returns their states"
        split = "" if self.tp is None else f", split over {self.tp.tensor_parallel_size} devices"
        return (
            f"{format_bytes(size)} of weights (the embedding shared with the target when the "
            f"head has none), aux layers {list(self.aux_layers or ())} ({source}), a cache of "
            f"{self.pool.num_pages} pages of its own ({format_bytes(cache)}){split}"
        )


def load_head(
    head_dir: str | os.PathLike[str],
    target_config: ModelConfig,
    runner: Any,  # the ModelRunner: its embedding (for a head without one) and its mesh
    dtype: jnp.dtype,
    scheme: QuantScheme | None = None,  # speculative_config quantization (on one device)
) -> tuple[Eagle3Config, Eagle3Weights, TensorParallel | None]:
    """The head in ``dtype``, checked against the target, and its tensor parallelism: on one
    device when the runner has none, its Linear weights quantized where ``scheme`` says
    (``quantized_head``) and its q/k/v and gate/up joined as the target's are (one GEMM each
    at every chained draft step; ``layers.fuse_layer``), else split on the runner's mesh
    (``eagle3_specs``), its head counts checked against it (an error naming the head, the
    field and the size)."""
    tp = shardings = None
    if runner.tp is not None:
        check_head_quantization(scheme.method if scheme else None, runner.tp.tensor_parallel_size)
        config = read_eagle3_config(head_dir)
        name = f"speculative_config: the EAGLE-3 head {Path(head_dir).name!r}"
        tp = drafter_parallel(config.layer, runner.tp, name)
        assert tp is not None
        shardings = eagle3_shardings(tp, config)
    head_config, head = load_eagle3(
        head_dir, target_config, runner.weights.embed, dtype, shardings=shardings
    )
    if tp is None:
        if scheme is not None:
            head = quantized_head(head, scheme.weight_format, scheme.act_quant)
        head = dataclasses.replace(head, layer=fuse_layer(head.layer))
    return head_config, head, tp
