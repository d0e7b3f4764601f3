"""What an encoder's hidden states become: an embedding per sequence (``encoder_pool``: CLS or
mean pooling, then L2 normalization, as sentence-transformers' Pooling and Normalize modules
compute them) or a cross-encoder's logits and scores (``classify``, ``scores``, as
``CrossEncoder.predict`` gives them).

All take the flat ragged batch of ``forward.py``: ``hidden`` [T, H] and ``cu_seq_lens``
i32[S + 1]; each returns one float32 row per sequence slot, padding slots included (their rows
are garbage). This pooling is the encoder's own; decoder pooling (last token) is the runner's.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxserve.models.encoder.forward import segment_ids
from jaxserve.models.encoder.weights import ClassifierHead

EncoderPooling = Literal["cls", "mean"]
ENCODER_POOLINGS = ("cls", "mean")


def first_token_rows(cu_seq_lens: jax.Array, num_tokens: int) -> jax.Array:  # i32[S]
    """The row of each sequence's first token (CLS / <s>), clipped into the batch."""
    return jnp.minimum(cu_seq_lens[:-1], num_tokens - 1)


def pool_cls(hidden: jax.Array, cu_seq_lens: jax.Array) -> jax.Array:  # [T, H] -> f32[S, H]
    return hidden[first_token_rows(cu_seq_lens, hidden.shape[0])].astype(jnp.float32)


def pool_mean(hidden: jax.Array, cu_seq_lens: jax.Array) -> jax.Array:  # [T, H] -> f32[S, H]
    """The mean of each sequence's tokens (all of them, special tokens included, as
    sentence-transformers averages every token its attention mask keeps)."""
    num_seqs = cu_seq_lens.shape[0] - 1
    segments = segment_ids(cu_seq_lens, hidden.shape[0])
    sums = jax.ops.segment_sum(hidden.astype(jnp.float32), segments, num_segments=num_seqs + 1)
    lens = jnp.maximum(cu_seq_lens[1:] - cu_seq_lens[:-1], 1).astype(jnp.float32)
    return sums[:num_seqs] / lens[:, None]


def normalize(x: jax.Array) -> jax.Array:  # f32[S, H] -> f32[S, H]
    """Each row over its L2 norm (at least 1e-12), as torch's ``F.normalize``."""
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x / jnp.maximum(norm, 1e-12)


def encoder_pool(
    hidden: jax.Array,  # [T, H]
    cu_seq_lens: jax.Array,  # i32[S + 1]
    pooling: EncoderPooling,
    is_normalized: bool,
) -> jax.Array:  # f32[S, H]
    """One embedding per sequence: its first token's (``cls``) or its tokens' mean, L2
    normalized when ``is_normalized``."""
    if pooling not in ENCODER_POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not one of {', '.join(ENCODER_POOLINGS)}")
    pooled = pool_cls(hidden, cu_seq_lens) if pooling == "cls" else pool_mean(hidden, cu_seq_lens)
    return normalize(pooled) if is_normalized else pooled


def classify(
    head: ClassifierHead,
    hidden: jax.Array,  # [T, H]
    cu_seq_lens: jax.Array,  # i32[S + 1]
) -> jax.Array:  # f32[S, L]
    """A sequence classifier's logits from each sequence's first token: BERT's pooler (dense,
    tanh) then classifier, or XLM-R's classification head (dense, tanh, out_proj)."""
    first = pool_cls(hidden, cu_seq_lens)
    x = jnp.tanh(first @ head.w_dense.astype(jnp.float32) + head.b_dense.astype(jnp.float32))
    return x @ head.w_out.astype(jnp.float32) + head.b_out.astype(jnp.float32)


def scores(logits: jax.Array, activation: str) -> jax.Array:  # f32[S, L] -> f32[S, L]
    """The scores ``CrossEncoder.predict`` reports: its activation on the logits (sigmoid by
    default for one label, identity otherwise; ``EncoderConfig.score_activation``)."""
    if activation == "sigmoid":
        return jax.nn.sigmoid(logits)
    if activation == "tanh":
        return jnp.tanh(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation={activation!r} is not one of sigmoid, tanh, identity")
