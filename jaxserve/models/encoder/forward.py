"""The encoder's forward pass (BERT, XLM-RoBERTa) over one flat ragged batch of whole sequences.

``forward(weights, batch, config) -> hidden [T, H]``: the tokens of several sequences are
concatenated in ``EncoderBatch`` (padded to a bucket of T tokens and S sequences, as the
decoder's ragged batch is), and every token attends to every token of its own sequence, both
ways, and to no other; padding tokens attend only among themselves, so they never change a
real token. There is no KV cache: each sequence is whole in one step. The layers are post-LN
as in BERT: embeddings (word + position + token type) then LayerNorm; per layer, attention
with q/k/v/o biases, residual, LayerNorm, then the GELU MLP, residual, LayerNorm.

Einsum letters: T tokens, S sequences, H hidden, N heads, D head dim, I intermediate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.encoder.config import EncoderConfig
from jaxserve.models.encoder.weights import EncoderLayerWeights, EncoderWeights, LayerNorm
from pallas_kernels.layer_norm import dispatch as norm_dispatch
from pallas_kernels.layer_norm import triton as norm_triton
from pallas_kernels.swiglu_matmul import dispatch as mlp_dispatch

# (q [T, N, D], k [T, N, D], v [T, N, D], segment_ids i32[T], sm_scale) -> [T, N, D]
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, float], jax.Array]


def gelu_erf(x: jax.Array) -> jax.Array:
    """Exact GELU, ``x Phi(x)``, as ``x / 2 (1 + erf(x / sqrt 2))`` in float32, the form PyTorch
    computes for BERT's "gelu". ``jax.nn.gelu``'s exact form goes through ``erfc``, which XLA
    writes as both of its branches and an exponential, after rounding ``x / sqrt 2`` to the
    input's dtype: on an H100 (2026-12-07) that pass took 208 us on a 16,384-token BGE-large
    step's [16384, 4096] product, this one 110 us, a copy of its bytes 100 us."""
    x32 = x.astype(jnp.float32)
    return (0.5 * x32 * (1.0 + jax.lax.erf(x32 * float(1 / np.sqrt(2))))).astype(x.dtype)


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu_erf,  # as Hugging Face's BERT
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EncoderBatch:
    """One step's sequences, concatenated. Padding tokens lie past ``cu_seq_lens[-1]``;
    padding sequences repeat the total in ``cu_seq_lens`` (length 0)."""

    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]  0-based position in its sequence (the model adds the offset)
    token_type_ids: jax.Array  # i32[T]  0, or 1 for the second text of a BERT pair
    cu_seq_lens: jax.Array  # i32[S + 1]  prefix sums of the sequences' lengths

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seq_lens.shape[0] - 1

    @classmethod
    def from_sequences(
        cls,
        token_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None = None,
        num_tokens: int | None = None,
        num_seqs: int | None = None,
    ) -> EncoderBatch:
        """Host arrays (numpy) of these sequences, padded to ``num_tokens`` tokens and
        ``num_seqs`` sequences (default: no padding)."""
        lens = [len(ids) for ids in token_ids]
        total = sum(lens)
        num_tokens = total if num_tokens is None else num_tokens
        num_seqs = len(lens) if num_seqs is None else num_seqs
        if total > num_tokens or len(lens) > num_seqs or min(lens, default=1) < 1:
            raise ValueError(
                f"{len(lens)} sequences of {total} tokens (each at least one) do not fit "
                f"{num_seqs=} and {num_tokens=}"
            )
        types = token_type_ids if token_type_ids is not None else [[0] * n for n in lens]
        if [len(t) for t in types] != lens:
            raise ValueError("token_type_ids must have one entry per token of each sequence")
        pad = num_tokens - total
        cu = np.cumsum([0, *lens, *[0] * (num_seqs - len(lens))])
        host: dict = dict(  # numpy stands in for device arrays until device_put
            input_ids=np.array([i for ids in token_ids for i in ids] + [0] * pad, np.int32),
            positions=np.array([p for n in lens for p in range(n)] + [0] * pad, np.int32),
            token_type_ids=np.array([t for ts in types for t in ts] + [0] * pad, np.int32),
            cu_seq_lens=cu.astype(np.int32),
        )
        return cls(**host)


def segment_ids(cu_seq_lens: jax.Array, num_tokens: int) -> jax.Array:  # i32[T]
    """Each token's sequence index; padding tokens get S (past the last sequence)."""
    tokens = jnp.arange(num_tokens, dtype=cu_seq_lens.dtype)
    return jnp.searchsorted(cu_seq_lens[1:], tokens, side="right").astype(jnp.int32)


def segment_attention(
    q: jax.Array,  # [T, N, D]
    k: jax.Array,  # [T, N, D]
    v: jax.Array,  # [T, N, D]
    segments: jax.Array,  # i32[T]
    sm_scale: float,
) -> jax.Array:  # [T, N, D]
    """Bidirectional attention within each segment, none across: the pure-jnp reference.

    It builds the dense [T, T] mask and f32[N, T, T] scores of the whole flat batch, so it costs
    2 * 2 * T² * H flops and 4 * N * T² bytes of scores per layer whatever the sequences'
    lengths (sum of len² is what a segment-aware kernel does): fine for T up to a few thousand
    (T = 4096, N = 16: 1 GiB of scores), a kernel with segment ids (flash / splash attention)
    replaces it through ``forward``'s ``attention_fn``. Every token sees itself, so no row is
    all masked.
    """
    scores = jnp.einsum("TND,SND->NTS", q, k, preferred_element_type=jnp.float32) * sm_scale
    mask = segments[:, None] == segments[None, :]  # bool[T, T]
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [N, T, T]
    return jnp.einsum("NTS,SND->TND", probs, v)


def layer_norm(x: jax.Array, norm: LayerNorm, eps: float) -> jax.Array:  # [T, H] -> [T, H]
    """LayerNorm in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * norm.scale.astype(jnp.float32) + norm.bias.astype(jnp.float32)).astype(x.dtype)


def add_layer_norm(x: jax.Array, residual: jax.Array, norm: LayerNorm, eps: float) -> jax.Array:
    """``layer_norm(x + residual)``: on the one-pass kernel where ``JAXSERVE_LAYER_NORM`` asks
    for it and the shapes fit (``pallas_kernels/layer_norm``), else XLA's add and norm."""
    mode = norm_dispatch.takes(x, residual)
    if mode is None:
        return layer_norm(x + residual, norm, eps)
    return norm_triton.add_layer_norm(
        x, residual, norm.scale, norm.bias, eps=eps, interpret=mode == "interpret"
    )


def embed(weights: EncoderWeights, batch: EncoderBatch, config: EncoderConfig) -> jax.Array:
    """Word + position + token-type embeddings, then LayerNorm: [T, H]. Positions are
    ``batch.positions + config.position_offset`` (XLM-R's start after its padding id)."""
    x = weights.word_embed[batch.input_ids]
    x = x + weights.type_embed[batch.token_type_ids]
    x = x + weights.position_embed[batch.positions + config.position_offset]
    return layer_norm(x, weights.embed_norm, config.layer_norm_eps)


def intermediate(lw: EncoderLayerWeights, x: jax.Array, config: EncoderConfig) -> jax.Array:
    """``act(x @ w_in + b_in)`` [T, I]: for exact GELU, on the GEMM kernel with the bias and
    GELU in its epilogue where ``JAXSERVE_GELU_MATMUL`` asks for it and the shapes fit
    (``pallas_kernels/swiglu_matmul``), else XLA's GEMM and a pass."""
    if config.hidden_act == "gelu":
        mode = mlp_dispatch.gelu_takes(x, lw.w_in, lw.b_in)
        if mode is not None:
            return mlp_dispatch.gelu_matmul(x, lw.w_in, lw.b_in, mode)
    return _ACTIVATIONS[config.hidden_act](jnp.einsum("TH,HI->TI", x, lw.w_in) + lw.b_in)


def encoder_layer(
    lw: EncoderLayerWeights,
    x: jax.Array,  # [T, H]
    segments: jax.Array,  # i32[T]
    config: EncoderConfig,
    attention_fn: AttentionFn,
) -> jax.Array:  # [T, H]
    q = jnp.einsum("TH,HND->TND", x, lw.wq) + lw.bq
    k = jnp.einsum("TH,HND->TND", x, lw.wk) + lw.bk
    v = jnp.einsum("TH,HND->TND", x, lw.wv) + lw.bv
    attn = attention_fn(q, k, v, segments, config.head_dim**-0.5)
    attn = jnp.einsum("TND,NDH->TH", attn, lw.wo) + lw.bo
    x = add_layer_norm(attn, x, lw.attn_norm, config.layer_norm_eps)
    h = intermediate(lw, x, config)
    h = jnp.einsum("TI,IH->TH", h, lw.w_out) + lw.b_out
    return add_layer_norm(h, x, lw.mlp_norm, config.layer_norm_eps)


def forward(
    weights: EncoderWeights,
    batch: EncoderBatch,
    config: EncoderConfig,
    attention_fn: AttentionFn | None = None,
) -> jax.Array:  # [T, H] in the weights' dtype
    """The last layer's hidden states of every token (padding rows are garbage).

    Every sequence must fit the position table (``config.max_seq_len`` tokens): the runner
    refuses longer ones, as a position past the table would silently read its last row.
    ``attention_fn``: ``segment_attention`` (the reference) unless a kernel is given.
    """
    attention_fn = attention_fn or segment_attention
    segments = segment_ids(batch.cu_seq_lens, batch.num_tokens)
    x = embed(weights, batch, config)
    # NOTE: a Python loop over per-layer weights (unrolled under jit), as the decoder's.
    for lw in weights.layers:
        x = encoder_layer(lw, x, segments, config, attention_fn)
    return x
