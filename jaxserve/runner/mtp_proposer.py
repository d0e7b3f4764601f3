"""The MTP drafter (``method: mtp``): DeepSeek-V3's own next-token layers (``models/mtp.py``)
over recomputed target states, their pages, and the compiled program that drafts k tokens.

It runs as the EAGLE-3 drafter runs (``eagle3_proposer.py``, whose catch-up and page rules it
inherits): the target's final hidden states for the tokens each sequence gained since its last
run are recomputed with the TARGET's weights (the runner's, read at each call) over a copy of
the target's cache of its own (``decoder.forward``), then the first MTP layer runs over the
same positions with the tokens shifted by one (position i reads the token at i + 1) and its
last row proposes the token at n; k - 1 chained one-token steps follow, each fed the previous
draft and the previous step's output row. Step j runs MTP layer j mod n (n =
``num_nextn_predict_layers``): with k > n the layers are reused, as vLLM reuses them. Drafts
are greedy (argmax). The target's cache copy and every MTP layer's latent pages are indexed by
one ``drafting.PagePool``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, KVCache
from jaxserve.models.layers import Weights
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.models.mtp import MtpWeights, Pages, make_mtp_kv_cache, mtp_step
from jaxserve.runner.buckets import MIN_TOKEN_BUCKET
from jaxserve.runner.drafting import CatchUp, catch_up_batch, decode_batch
from jaxserve.runner.eagle3_proposer import TargetStatesDrafter


def mtp_chain(
    target: Weights,
    layers: list[MtpWeights],
    kv: KVCache,  # the drafter's copy of the target's cache
    mtp_kv: list[Pages],  # each MTP layer's pages
    batch: Batch,  # the target's tokens [s, n - 1) of each sequence
    next_ids: jax.Array,  # i32[T]  each row's next token
    target_config: ModelConfig,
    k: int,
    page_size: int,
    pad_slot: int,
) -> tuple[KVCache, list[Pages], jax.Array]:  # (kv, mtp_kv, i32[S, k] drafts)
    """The target's final hidden states over the catch-up, the first MTP layer over them,
    then k - 1 chained steps from each sequence's last row (layer j mod n at step j)."""
    kv, hidden = decoder.forward(target, kv, batch, target_config)
    shifted = dataclasses.replace(batch, input_ids=next_ids)
    mtp_kv = list(mtp_kv)
    mtp_kv[0], logits, out = mtp_step(layers[0], mtp_kv[0], shifted, hidden, target_config)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S]
    rows = out[batch.logits_indices]  # [S, H]
    drafts = [tokens]
    s_pad = tokens.shape[0]
    for j in range(1, k):
        i = j % len(layers)
        step = decode_batch(batch, tokens, j, page_size, pad_slot)
        padded = jnp.pad(rows, ((0, max(s_pad, MIN_TOKEN_BUCKET) - s_pad), (0, 0)))
        mtp_kv[i], logits, out = mtp_step(layers[i], mtp_kv[i], step, padded, target_config)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        rows = out[:s_pad]
        drafts.append(tokens)
    return kv, mtp_kv, jnp.stack(drafts, axis=1)


class MtpProposer(TargetStatesDrafter):
    """Greedy drafts of the target's MTP layers over recomputed target states (module
    docstring); the catch-up, pages and warm-up are those of every target-states drafter."""

    def __init__(
        self,
        layers: list[MtpWeights],
        target_config: ModelConfig,
        target_weights: Callable[[], Weights],  # the runner's weights, now
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
    ) -> None:
        super().__init__(target_config, target_weights, engine, max_model_len, max_seqs, k, dtype)
        self.layers = layers
        page = engine.block_size
        self.mtp_kv: Any = make_mtp_kv_cache(
            target_config, len(layers), self.pool.num_pages, page, dtype
        )
        self._mtp_chain = jax.jit(
            functools.partial(
                mtp_chain,
                target_config=target_config,
                k=k,
                page_size=page,
                pad_slot=self.pad_slot,
            ),
            donate_argnums=(2, 3),
        )

    def describe(self) -> str:
        size = sum(x.nbytes for layer in self.layers for x in _own_leaves(layer))
        cache = sum(x.nbytes for x in jax.tree_util.tree_leaves((self.kv, self.mtp_kv)))
        return (
            f"{len(self.layers)} MTP layer(s) of the target's checkpoint "
            f"({format_bytes(size)} of weights besides the shared embedding), a cache of "
            f"{self.pool.num_pages} pages of its own for the target's recomputed states and "
            f"the MTP layers ({format_bytes(cache)})"
        )

    def _run(self, call: list[CatchUp], bucket: int | None = None) -> np.ndarray:
        batch = catch_up_batch(call, self.pool, self.buckets, bucket)
        next_ids = self._head_ids(call, batch.input_ids.shape[0])
        self.kv, self.mtp_kv, drafts = self._mtp_chain(
            self.target_weights(),
            self.layers,
            self.kv,
            self.mtp_kv,
            jax.device_put(batch),
            jax.device_put(next_ids),
        )
        return np.asarray(drafts)


def _own_leaves(layer: MtpWeights) -> list[jax.Array]:
    """A layer's arrays less the target's embedding it shares."""
    return jax.tree_util.tree_leaves(dataclasses.replace(layer, embed=jnp.zeros(())))
