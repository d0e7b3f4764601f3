"""The draft-model drafter (``method: draft_model``): a small decoder of the target's tokenizer,
its weights and KV cache, and the compiled program that drafts k tokens greedily.

``load_draft`` reads the draft's directory with the target's loader and dtype (quantized as
``speculative_config`` ``quantization`` or its checkpoint says, else not) and refuses, naming
both models, a draft of another vocabulary or tokenizer (``models/draft_check.py``). On one
device its projections are fused as the target's are; under tensor parallelism it is split on
the target's mesh as a model of its shapes would be (``drafting.drafter_parallel``; unfused:
the specs are per projection), its cache on KV heads, and its program runs the attention op per
device (``tp.attention_fn``).
``DraftModelProposer`` implements the engine's ``Proposer``: for the
sequences of a step it catches the draft's cache up on the tokens each gained since its last
run (a prefill of them, the whole prompt the first time), then runs k - 1 greedy one-token steps,
all in one compiled program per token bucket, and returns each sequence's k drafts (one
device-to-host copy a call).

The draft's cache is a page pool of its own (``drafting.PagePool``), not the target's block
table: drafting runs before the scheduler allocates the target's blocks for the step, and the
draft writes k - 1 positions past the sequence's known tokens, so the target's table may not
hold them yet; with its own pool the draft needs nothing of the target's allocator, prefix
cache or preemption. The pool holds ``disable_by_batch_size`` sequences of ``max_model_len`` (no
more sequences draft in one step); a sequence that does not draft in a step keeps its pages
until a drafting sequence needs them (its tokens never change, so its draft KV stays valid), and
one that still finds no pages drafts nothing that step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder, moe
from jaxserve.models.batch import Batch, KVCache, make_kv_cache_for
from jaxserve.models.decoder import AttentionFn
from jaxserve.models.draft_check import DraftTokenizer, check_draft
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.layers import Weights
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner.drafting import (
    CatchUp,
    ChainArgs,
    PagedDrafter,
    TokenSource,
    VerifiedIds,
    ahead_batch,
    catch_up_batch,
    decode_batch,
    drafter_parallel,
)
from jaxserve.runner.model_weights import as_served
from jaxserve.runner.packing import Layout
from jaxserve.runner.parallel.sharding import TensorParallel
from jaxserve.runner.programs import step_attention
from jaxserve.runner.sleep import free
from jaxserve.runner.weight_update import committed

_LOG = logging.getLogger(__name__)


def check_one_host(runner: Any, method: str) -> None:
    """A model drafter runs its programs from the engine's process alone: a multi-host
    replica (whose other processes only follow the runner's steps) is refused."""
    if runner is not None and runner.multihost:
        raise ValueError(
            f"speculative_config method={method!r} on a multi-host replica: its drafter's "
            "programs would span processes that only follow the target's steps; serve it on "
            "one host"
        )


def load_draft(
    draft_dir: str,
    target_config: ModelConfig,
    target_tokenizer: DraftTokenizer,
    draft_tokenizer: DraftTokenizer,
    dtype: jnp.dtype,
    target_tp: TensorParallel | None = None,
    scheme: QuantScheme | None = None,  # speculative_config quantization, or the checkpoint's
) -> tuple[ModelConfig, Weights, TensorParallel | None]:
    """The draft's config, weights (in ``dtype``, quantized as ``scheme`` says, as the loader
    quantizes a target) and tensor parallelism: on one device with its projections fused when
    ``target_tp`` is None, else split on the target's mesh; checked against the target's
    vocabulary and tokenizer first, and under TP its head counts against the mesh (an error
    naming the draft, the field and the size)."""
    draft_config = load_model_config(draft_dir)
    draft_name = f"the draft model {Path(draft_dir).name!r}"
    check_draft(
        target_config,
        draft_config,
        target_tokenizer,
        draft_tokenizer,
        target_name=f"the target model ({target_config.model_type})",
        draft_name=draft_name,
    )
    tp = drafter_parallel(draft_config, target_tp, f"speculative_config: {draft_name}", scheme)
    if tp is None:  # (the loader joins plain projections as they load, as_served QArrays)
        weights = load_weights(draft_dir, draft_config, dtype, scheme=scheme, fuse=scheme is None)
        return draft_config, as_served(weights, one_device=True), None
    weights = load_weights(draft_dir, draft_config, dtype, placement=tp.placement, scheme=scheme)
    return draft_config, as_served(weights, one_device=False), tp


def draft_chain(
    weights: Weights,
    kv: KVCache,
    batch: Batch,
    config: ModelConfig,
    k: int,
    page_size: int,
    pad_slot: int,
    attention_fn: AttentionFn | None = None,  # under TP: the op per device (tp.attention_fn)
    experts_fn: moe.ExpertsFn | None = None,  # under TP, a draft with experts: tp.experts_fn
) -> tuple[KVCache, jax.Array]:  # (kv, i32[S, k] drafts)
    """The catch-up step, then k - 1 greedy one-token steps from each sequence's last row."""
    run = functools.partial(
        decoder.forward, config=config, attention_fn=attention_fn, experts_fn=experts_fn
    )
    kv, hidden = run(weights, kv, batch)
    logits = decoder.compute_logits(weights, hidden[batch.logits_indices])
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S]
    drafts = [tokens]
    for j in range(1, k):
        step = decode_batch(batch, tokens, j, page_size, pad_slot)
        kv, hidden = run(weights, kv, step)
        logits = decoder.compute_logits(weights, hidden[: tokens.shape[0]])
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return kv, jnp.stack(drafts, axis=1)


class DraftModelProposer(PagedDrafter):
    """Greedy drafts of a draft model, with its own paged KV cache (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
        tp: TensorParallel | None = None,  # load_draft's: the draft's layout on the mesh
        runner: Any = None,  # the ModelRunner: its step programs feed a call drafted ahead
    ) -> None:
        super().__init__(engine, max_model_len, max_seqs, k, tp)
        self.config, self.weights, self.runner = config, weights, runner
        page, num_pages = engine.block_size, self.pool.num_pages
        # committed, as the pages each call gives back are (``weight_update.committed``)
        self.kv: Any = committed(
            make_kv_cache_for(config, num_pages, page, dtype)
            if tp is None
            else tp.make_kv_cache(num_pages, page, dtype)  # split on KV heads
        )
        chain = functools.partial(
            draft_chain,
            config=config,
            k=k,
            page_size=page,
            pad_slot=self.pad_slot,
            attention_fn=step_attention(tp),  # one lowering for every layer and step
            experts_fn=None if tp is None else tp.experts_fn,
        )
        self._chain = self.jit_chain(chain, self.kv, self.weights)

        def ahead(weights, pages, batch, *feeds):  # feeds: ahead_batch's, after the batch
            batch = ahead_batch(batch, *feeds, k=k, page_size=self.pool.page_size)
            return chain(weights, pages, batch)

        self._ahead = self.jit_chain(ahead, self.kv, self.weights)

    def arrays(self) -> Any:
        return self.weights, self.kv

    def describe(self) -> str:
        size = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.weights))
        cache = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.kv))
        split = "" if self.tp is None else f", split over {self.tp.tensor_parallel_size} devices"
        return (
            f"{self.config.num_layers} layers, {format_bytes(size)} of weights, a cache of "
            f"{self.pool.num_pages} pages of its own ({format_bytes(cache)}){split}"
        )

    def _catch_up(self, seqs: Sequence[TokenSource], seq: TokenSource) -> CatchUp | None:
        """The sequence's part of this call, its pages taken (None: no pages, no draft)."""
        if not self._take_pages(seqs, seq):
            return None
        n = seq.num_tokens
        start = min(self.computed.get(seq.seq_id, 0), n - 1)  # at least the last token
        return CatchUp(seq.seq_id, seq.token_ids(start, n), start, final=True)

    def _chain_args(self, call: list[CatchUp], bucket: int | None = None) -> ChainArgs:
        batch = catch_up_batch(call, self.pool, self.buckets, bucket)
        inputs = self.put_packed({"chain": (batch,)})
        return ChainArgs((self.weights, self.kv, inputs.buffer), inputs.layout)

    def shutdown(self) -> None:
        """Give the device memory back (the engine shut down): the pages freed, the weights
        let go."""
        free(self.kv)
        self.kv = None
        del self.weights  # the last reference: nothing serves after a shutdown

    def _device_run(self, call: list[CatchUp], bucket: int | None = None) -> jax.Array:
        self.kv, drafts = self._call_chain(self._chain_args(call, bucket))
        return drafts

    def _call_ahead(self, parts: list[CatchUp], chain: tuple, ids: VerifiedIds) -> jax.Array:
        inputs = self.put_packed({"chain": chain})
        self.kv, drafts = self._ahead(
            self.weights, self.kv, inputs.buffer, *ids, layout=inputs.layout
        )
        return drafts

    def _warm_ahead(self, bucket: int) -> None:
        args, layout = self._ahead_padding_args(bucket)
        self.kv, _ = self._ahead(*args, layout=layout)

    def _ahead_padding_args(self, bucket: int) -> tuple[tuple[Any, ...], Layout]:
        inputs = self.put_packed({"chain": self._ahead_padding_chain(bucket)})
        ids = self.runner.programs.no_previous_ids
        return (self.weights, self.kv, inputs.buffer, ids, ids, ids), inputs.layout
