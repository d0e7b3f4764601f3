"""Attention within each sequence of a flat batch, from the step's own keys and values (no KV
cache): the encoder's bidirectional attention (``encoder_runner.py``) and a decoder pooling
runner's causal attention over whole prompts (``pooling_attention.py``).

A step holds its sequences one after another in T rows; ``segments`` gives each row's sequence
(padding rows a segment of their own past the last) and ``cu_seq_lens`` the sequences' bounds.
A query sees the keys of its own sequence: all of them (bidirectional) or those at or before it
(``causal``). Keys and values may have fewer heads than the queries (grouped-query attention:
query head n reads key head n // (N / K), Hugging Face's ``repeat_kv``).

- ``packed_segment_attention``: cuDNN's fused attention over packed sequences (its THD layout:
  each sequence's start and length), on Hopper and later in bf16 or fp16: the work is the sum of
  each sequence's length squared, and no mask is in memory.
- ``windowed_segment_attention``: each query tile of the flat batch looks at its own tile of
  keys and the two beside it (a sequence no longer than a tile lies within them), the segments
  and the causal order as its mask: T times three tiles of scores, not T squared. On cuDNN
  (``implementation="cudnn"``) or as the jnp reference (``"xla"``: any backend, any dtype).

Rows past the last sequence (padding) are zeros in the packed form and garbage in the windowed
one; nothing reads them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.runner.devices import compute_capability


def segment_attention_form(dtype: Any) -> tuple[str, str | None]:
    """The fastest form that runs in this process for activations of ``dtype``: ``packed``
    (cuDNN's packed sequences: Hopper and later, bf16 or fp16), ``cudnn`` (cuDNN over windows:
    older GPUs) or ``xla`` (the jnp windows); and why it is not ``packed`` (None when it is)."""
    if jax.default_backend() != "gpu":
        return "xla", f"cuDNN is a GPU library; this is the {jax.default_backend()} backend"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla", f"cuDNN's fused attention takes bf16 or fp16, not {jnp.dtype(dtype).name}"
    capability = compute_capability(jax.devices()[0])
    if capability is None or capability < 9.0:
        return "cudnn", f"cuDNN packs sequences on Hopper and later; this GPU is sm {capability}"
    return "packed", None


def packed_segment_attention(
    q: jax.Array,  # [T, N, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    segments: jax.Array,  # i32[T]
    sm_scale: float,
    *,
    cu_seq_lens: jax.Array,  # i32[S + 1]: the segments' bounds (padding sequences: length 0)
    causal: bool = False,  # static
    zero_padding: bool = True,  # static
) -> jax.Array:  # [T, N, D]
    """Attention within each segment on cuDNN's fused attention over packed sequences: one
    batch row holding every sequence, each given by its start and length, so no score outside
    a sequence is computed and no mask is read. Padding rows are zeros, or with
    ``zero_padding=False`` whatever cuDNN left there (it writes no row outside a sequence):
    the caller must never read them.

    NOTE: the packed layout is reached through ``jax._src.cudnn`` (``jax.nn``'s entry takes
    lengths but not offsets). jax is pinned (DESIGN.md), and the GPU tests check this path
    against the reference on each upgrade.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    num_seqs = cu_seq_lens.shape[0] - 1
    lens = jnp.diff(cu_seq_lens).astype(jnp.int32)
    if num_seqs == 1:  # one segment: a plain padding mask (the packed layout needs two or more)
        out = jax.nn.dot_product_attention(
            q[None],
            k[None],
            v[None],
            scale=sm_scale,
            is_causal=causal,
            implementation="cudnn",
            query_seq_lengths=lens,
            key_value_seq_lengths=lens,
        )[0]
    else:
        real = lens > 0
        seqlen = jnp.where(real, lens, -1)[None]  # [1, S]: -1 marks an absent segment
        starts = jnp.where(real, cu_seq_lens[:-1].astype(jnp.int32), -1)
        offsets = jnp.concatenate([starts, jnp.full((1,), -1, jnp.int32)])[None]  # [1, S + 1]
        masks = cudnn_attention.MaskType
        mask = masks.PADDING_CAUSAL if causal else masks.PADDING
        out = cudnn_attention.dot_product_attention(
            q[None],
            k[None],
            v[None],
            q_seqlen=seqlen,
            kv_seqlen=seqlen,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=sm_scale,
            mask_type=mask,
            qkv_layout="BTNH",
        )[0]
    if not zero_padding:
        return out
    return jnp.where((segments < num_seqs)[:, None, None], out, jnp.zeros((), out.dtype))


def windowed_segment_attention(
    q: jax.Array,  # [T, N, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    segments: jax.Array,  # i32[T]
    sm_scale: float,
    *,
    tile: int,  # static: at least the longest sequence; T a multiple of it
    implementation: str = "xla",  # static: "cudnn" or "xla"
    causal: bool = False,  # static
) -> jax.Array:  # [T, N, D]
    """Attention within each segment with T * 3 * tile scores instead of T * T: the queries of
    tile i attend to the keys of tiles i - 1, i and i + 1 of their own sequence (a sequence of
    at most ``tile`` tokens spans at most two tiles). One window of every key when T <= 2 * tile.
    ``implementation="cudnn"``: the same on cuDNN's fused attention."""
    num_tokens = q.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    if num_tokens <= 2 * tile:  # one window: every key
        qt, kw, vw = q[None], k[None], v[None]
        seg_q, seg_k, row_q, row_k = segments[None], segments[None], rows[None], rows[None]
    else:
        n = num_tokens // tile

        def windows(x: jax.Array, fill: Any) -> jax.Array:  # [T, ...] -> [n, 3 * tile, ...]
            pad = [(tile, tile)] + [(0, 0)] * (x.ndim - 1)
            tiles = jnp.pad(x, pad, constant_values=fill).reshape(n + 2, tile, *x.shape[1:])
            return jnp.concatenate([tiles[:-2], tiles[1:-1], tiles[2:]], axis=1)

        qt = q.reshape(n, tile, *q.shape[1:])
        kw, vw, seg_k, row_k = windows(k, 0), windows(v, 0), windows(segments, -1), windows(rows, 0)
        seg_q, row_q = segments.reshape(n, tile), rows.reshape(n, tile)
    mask = seg_q[:, :, None] == seg_k[:, None, :]  # [n, t, s]
    if causal:
        mask &= row_k[:, None, :] <= row_q[:, :, None]
    mask = mask[:, None]  # [n, 1, t, s]
    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(
            qt, kw, vw, mask=mask, scale=sm_scale, implementation="cudnn"
        )
        return out.reshape(q.shape)
    group = q.shape[1] // k.shape[1]  # query heads per key head
    kw, vw = jnp.repeat(kw, group, axis=2), jnp.repeat(vw, group, axis=2)
    scores = jnp.einsum("ntND,nsND->nNts", qt, kw, preferred_element_type=jnp.float32) * sm_scale
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("nNts,nsND->ntND", probs, vw).reshape(q.shape)
