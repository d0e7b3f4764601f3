"""The EAGLE-3 drafter (``method: eagle3``): a head (``models/eagle3.py``) over the target's aux
hidden states, its own pages, and the compiled program that drafts k tokens greedily.

The head reads the target's hidden states at ``head_config.aux_layers(L)`` for every token the
target accepted. The target's step does not return them: this drafter recomputes them with the
TARGET's weights (the runner's, shared, read at each call so that a weight update reaches it)
over a copy of the target's KV cache of its own, ``decoder.forward_with_aux`` over the tokens
each sequence gained since its last run. That leaves the runner's step untouched and costs one
more target prefill of every drafted sequence's tokens (once each: a prompt, then the tokens a
verify step accepted) and that copy's cache (docs/eagle3.md, "Served").

Per call, in one compiled program per token bucket: the target over each sequence's new tokens
[s, n - 1) (the last known token has no hidden state yet), ``fuse_aux_hidden``, one
``eagle3_step`` over the same positions with the tokens shifted by one (position i reads the
token at i + 1) whose last row proposes the token at n, then k - 1 chained one-token steps, each
fed the previous draft and the previous step's pre-norm row. Drafts are argmaxes over target
ids (``d2t`` mapped). Both caches, the target's copy and the head's one layer, are indexed by one
``drafting.PagePool`` (the same page table), sized as the draft model's
(``runner/draft_model.py``), with the same rules for idle sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, KVCache, make_kv_cache_for
from jaxserve.models.eagle3 import (
    Eagle3Config,
    Eagle3Weights,
    eagle3_step,
    fuse_aux_hidden,
    make_eagle3_kv_cache,
)
from jaxserve.models.layers import Weights
from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.runner.buckets import MIN_TOKEN_BUCKET
from jaxserve.runner.drafting import (
    CatchUp,
    PagedDrafter,
    TokenSource,
    catch_up_batch,
    decode_batch,
)

_LOG = logging.getLogger(__name__)

HeadKV = tuple[jax.Array, jax.Array]


def eagle3_chain(
    target: Weights,
    head: Eagle3Weights,
    kv: KVCache,  # the drafter's copy of the target's cache
    head_kv: HeadKV,
    batch: Batch,  # the target's tokens [s, n - 1) of each sequence
    head_ids: jax.Array,  # i32[T]  each row's next token (the head's input_ids)
    target_config: ModelConfig,
    head_config: Eagle3Config,
    aux_layers: tuple[int, ...],
    k: int,
    page_size: int,
    pad_slot: int,
) -> tuple[KVCache, HeadKV, jax.Array]:  # (kv, head_kv, i32[S, k] drafts)
    """The target's aux states over the catch-up, the head's step over them, then k - 1
    chained head steps from each sequence's last row."""
    kv, _, aux = decoder.forward_with_aux(target, kv, batch, target_config, aux_layers)
    hidden = fuse_aux_hidden(head, aux)
    shifted = dataclasses.replace(batch, input_ids=head_ids)
    head_kv, logits, prenorm = eagle3_step(head, head_kv, shifted, hidden, head_config)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S] target ids
    rows = prenorm[batch.logits_indices]  # [S, H]
    drafts = [tokens]
    s_pad = tokens.shape[0]
    for j in range(1, k):
        step = decode_batch(batch, tokens, j, page_size, pad_slot)
        padded = jnp.pad(rows, ((0, max(s_pad, MIN_TOKEN_BUCKET) - s_pad), (0, 0)))
        head_kv, logits, prenorm = eagle3_step(head, head_kv, step, padded, head_config)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        rows = prenorm[:s_pad]
        drafts.append(tokens)
    return kv, head_kv, jnp.stack(drafts, axis=1)


class TargetStatesDrafter(PagedDrafter):
    """A drafter over the target's hidden states, recomputed with the target's weights over a
    copy of the target's KV cache of its own (module docstring): its catch-up reads tokens
    [start, n - 1) for the target and keeps each row's next token for the drafting layers
    (``_head_ids``). EAGLE-3's head and DeepSeek-V3's MTP layers draft from it."""

    def __init__(
        self,
        target_config: ModelConfig,
        target_weights: Callable[[], Weights],  # the runner's weights, now
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
    ) -> None:
        super().__init__(engine, max_model_len, max_seqs, k)
        self.target_config, self.target_weights = target_config, target_weights
        page = engine.block_size
        self.kv: Any = make_kv_cache_for(target_config, self.pool.num_pages, page, dtype)
        self._next: dict[str, tuple[int, list[int]]] = {}  # seq id -> (start, tokens from it)

    def _end_call(self) -> None:
        self._next.clear()

    def _catch_up(self, seqs: Sequence[TokenSource], seq: TokenSource) -> CatchUp | None:
        """The sequence's part of this call, tokens [start, n - 1) for the target, its pages
        taken (None: too short, or no pages: no draft)."""
        n = seq.num_tokens
        if n < 2 or not self._take_pages(seqs, seq):
            return None  # no hidden state to read yet, or no room: no draft
        start = min(self.computed.get(seq.seq_id, 0), n - 2)  # at least the last row
        tokens = seq.token_ids(start, n)
        self._next[seq.seq_id] = (start, tokens)
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


class Eagle3Proposer(TargetStatesDrafter):
    """Greedy drafts of an EAGLE-3 head over the target's recomputed aux hidden states
    (module docstring)."""

    def __init__(
        self,
        head_config: Eagle3Config,
        head: Eagle3Weights,
        target_config: ModelConfig,
        target_weights: Callable[[], Weights],  # the runner's weights, now
        engine: EngineConfig,
        max_model_len: int,
        max_seqs: int,
        k: int,
        dtype: jnp.dtype,
    ) -> None:
        super().__init__(target_config, target_weights, engine, max_model_len, max_seqs, k, dtype)
        self.head_config, self.head = head_config, head
        page = engine.block_size
        self.head_kv: Any = make_eagle3_kv_cache(head_config, self.pool.num_pages, page, dtype)
        self._chain = jax.jit(
            functools.partial(
                eagle3_chain,
                target_config=target_config,
                head_config=head_config,
                aux_layers=head_config.aux_layers(target_config.num_layers),
                k=k,
                page_size=page,
                pad_slot=self.pad_slot,
            ),
            donate_argnums=(2, 3),
        )

    def describe(self) -> str:
        size = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.head))
        cache = sum(x.nbytes for x in jax.tree_util.tree_leaves((self.kv, self.head_kv)))
        aux = list(self.head_config.aux_layers(self.target_config.num_layers))
        return (
            f"{format_bytes(size)} of weights (the embedding shared with the target when the "
            f"head has none), aux layers {aux}, a cache of {self.pool.num_pages} pages of its "
            f"own for the target's recomputed states and the head ({format_bytes(cache)})"
        )

    def _run(self, call: list[CatchUp], bucket: int | None = None) -> np.ndarray:
        batch = catch_up_batch(call, self.pool, self.buckets, bucket)
        head_ids = self._head_ids(call, batch.input_ids.shape[0])
        self.kv, self.head_kv, drafts = self._chain(
            self.target_weights(),
            self.head,
            self.kv,
            self.head_kv,
            jax.device_put(batch),
            jax.device_put(head_ids),
        )
        return np.asarray(drafts)
