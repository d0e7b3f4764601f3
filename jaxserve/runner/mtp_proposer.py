"""The MTP drafter (``method: mtp``): DeepSeek-V3's own next-token layers (``models/mtp.py``)
over the target's final hidden states, their pages, and the compiled program that drafts k
tokens.

It runs as the EAGLE-3 drafter runs (``eagle3_proposer.py``, whose catch-up, page rules and
target states it inherits): the target's final hidden states of the tokens each sequence gained
since its last run come from the runner's last step, or from the target run again over the
runner's cache when that step did not compute them all. The first MTP layer runs over the
same positions with the tokens shifted by one (position i reads the token at i + 1) and its
last row proposes the token at n; k - 1 chained one-token steps follow, each fed the previous
draft and the previous step's output row. Step j runs MTP layer j mod n (n =
``num_nextn_predict_layers``): with k > n the layers are reused, as vLLM reuses them. Drafts
are greedy (argmax). Every MTP layer's latent pages are indexed by one ``drafting.PagePool``.

Under tensor parallelism the layers are laid out on the target's mesh as the target's own
layers of their kind are (``load_layers``, ``sharding.mtp_specs``: latent attention split on
the query heads, the experts as the target's; the small extras replicated, the embedding and
lm_head the target's as sharded), their latent pages are sharded as the target's latent cache
(one KV head: every device holds all of it), and the chain runs the target's attention op and
experts per device (``tp.attention_fn``, ``tp.experts_fn``); batches go in replicated and the
target's final hidden states, which its step returns replicated, are read as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import moe
from jaxserve.models.batch import Batch
from jaxserve.models.decoder import AttentionFn
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.models.loading.mtp_checkpoint import load_mtp, require_mtp_layers
from jaxserve.models.mtp import MtpWeights, Pages, make_mtp_kv_cache, mtp_step
from jaxserve.runner.drafting import StateStep, chain_from_states
from jaxserve.runner.eagle3_proposer import TargetStatesDrafter
from jaxserve.runner.parallel.sharding import TensorParallel, mtp_shardings
from jaxserve.runner.programs import step_attention
from jaxserve.runner.weight_update import committed


def mtp_chain(
    layers: list[MtpWeights],
    mtp_kv: list[Pages],  # each MTP layer's pages
    batch: Batch,  # the target's tokens [s, n - 1) of each sequence, in the layers' pages
    next_ids: jax.Array,  # i32[T]  each row's next token
    hidden: jax.Array,  # [T, H]  the target's final hidden states of the batch's rows
    target_config: ModelConfig,
    k: int,
    page_size: int,
    pad_slot: int,
    attention_fn: AttentionFn | None = None,  # under TP: the target's op per device
    experts_fn: moe.ExpertsFn | None = None,  # under TP: the target's experts per device
) -> tuple[list[Pages], jax.Array]:  # (mtp_kv, i32[S, k] drafts)
    """The first MTP layer over the target's states, then k - 1 chained steps from each
    sequence's last row (layer j mod n at step j)."""
    mtp_kv = list(mtp_kv)

    def layer_step(i: int) -> StateStep:
        def step(step_batch: Batch, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
            mtp_kv[i], logits, out = mtp_step(
                layers[i], mtp_kv[i], step_batch, rows, target_config, attention_fn, experts_fn
            )
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), out

        return step

    shifted = dataclasses.replace(batch, input_ids=next_ids)
    drafts = chain_from_states(
        layer_step(0),
        lambda j: layer_step(j % len(layers)),
        shifted,
        hidden,
        k,
        page_size,
        pad_slot,
    )
    return mtp_kv, drafts


class MtpProposer(TargetStatesDrafter):
    """Greedy drafts of the target's MTP layers over the target's final hidden states (module
    docstring); the catch-up, pages, states and warm-up are those of every target-states
    drafter."""

    def __init__(
        self,
        layers: list[MtpWeights],
        target_config: ModelConfig,
        runner: Any,  # the ModelRunner
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
        tp: TensorParallel | None = None,  # load_layers': the target's, under TP
    ) -> None:
        super().__init__(target_config, runner, engine, max_model_len, max_seqs, k, None, tp)
        self.draft_weights = layers
        page, num_pages = engine.block_size, self.pool.num_pages
        # committed, as the pages each call gives back are (``weight_update.committed``)
        self.draft_kv = committed(
            make_mtp_kv_cache(target_config, len(layers), num_pages, page, dtype)
            if tp is None
            else tp.make_kv_cache(num_pages, page, dtype, len(layers))  # as the target's latent
        )
        chain = functools.partial(
            mtp_chain,
            target_config=target_config,
            k=k,
            page_size=page,
            pad_slot=self.pad_slot,
            attention_fn=step_attention(tp),  # one lowering for every layer and step
            experts_fn=None if tp is None else tp.experts_fn,
        )
        self.jit_chains(chain)

    def describe(self) -> str:
        size = sum(x.nbytes for layer in self.draft_weights for x in _own_leaves(layer))
        cache = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.draft_kv))
        split = "" if self.tp is None else f", split over {self.tp.tensor_parallel_size} devices"
        return (
            f"{len(self.draft_weights)} MTP layer(s) of the target's checkpoint "
            f"({format_bytes(size)} of weights besides the shared embedding), over the "
            f"target's final hidden states, a cache of {self.pool.num_pages} pages of its "
            f"own for the MTP layers ({format_bytes(cache)}){split}"
        )


def load_layers(
    model_dir: str | os.PathLike[str],
    target_config: ModelConfig,
    runner: Any,  # the ModelRunner: its weights (embedding, lm_head) and its mesh
    dtype: jnp.dtype,
) -> tuple[list[MtpWeights], TensorParallel | None]:
    """The checkpoint's MTP layers in ``dtype`` and their tensor parallelism: on one device when
    the runner has none, else the runner's own (the layers are of the target's config), each
    field placed in its sharding on the runner's mesh (``mtp_shardings``)."""
    tp = runner.tp
    shardings = None
    if tp is not None:
        shardings = [mtp_shardings(tp, i) for i in range(require_mtp_layers(model_dir))]
    layers = load_mtp(model_dir, target_config, runner.weights, dtype, shardings)
    return layers, tp


def _own_leaves(layer: MtpWeights) -> list[jax.Array]:
    """A layer's arrays less the target's embedding it shares."""
    return jax.tree_util.tree_leaves(dataclasses.replace(layer, embed=jnp.zeros(())))
