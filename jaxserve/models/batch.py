"""The device-side inputs of one model step, and the paged KV cache they index.

The runner builds a ``Batch`` from the scheduler's per-step output (padded numpy arrays, one
shape bucket) and hands it to ``decoder.forward``. Padding tokens have ``slot_mapping`` past the
end of the cache (their K/V writes are dropped) and rows past ``cu_q_lens[num_seqs]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    input_ids: jax.Array  # i32[T]  token ids, one flattened ragged batch
    positions: jax.Array  # i32[T]  absolute position of each token in its sequence
    slot_mapping: jax.Array  # i32[T]  page * page_size + offset; padding >= num_slots
    kv_lens: jax.Array  # i32[S]  cached tokens per sequence after this step
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S + 1]  prefix sums of new tokens per sequence
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[S]  row of each sequence's last new token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def padding(cls, num_tokens: int, num_seqs: int, pages_per_seq: int, pad_slot: int) -> Batch:
        """A step of padding only (host arrays): no sequence, every K/V write dropped. Warm-up
        runs it, and a multi-host follower fills one by broadcast."""
        host: dict[str, Any] = dict(  # numpy stands in for device arrays until device_put
            input_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, pad_slot, np.int32),
            kv_lens=np.zeros(num_seqs, np.int32),
            page_indices=np.zeros((num_seqs, pages_per_seq), np.int32),
            cu_q_lens=np.zeros(num_seqs + 1, np.int32),
            num_seqs=np.zeros(1, np.int32),
            logits_indices=np.zeros(num_seqs, np.int32),
        )
        return cls(**host)


# One (k_pages, v_pages) pair per layer, each [num_pages, page_size, num_kv_heads, head_dim];
# for multi-head latent attention (c_kv [P, page_size, 1, L], k_pe [P, page_size, 1, R]).
KVCache = list[tuple[jax.Array, jax.Array]]


def kv_page_shapes(
    config: ModelConfig, num_pages: int, page_size: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The shapes of one layer's two page arrays (``config.kv_cache_dims``)."""
    (k_heads, k_width), (v_heads, v_width) = config.kv_cache_dims
    return (num_pages, page_size, k_heads, k_width), (num_pages, page_size, v_heads, v_width)


def make_kv_cache_for(
    config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype
) -> KVCache:
    """A zeroed cache of every layer, in the config's page shapes (MLA's latent included)."""
    k_shape, v_shape = kv_page_shapes(config, num_pages, page_size)
    return [
        (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(config.num_layers)
    ]


def make_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
) -> KVCache:
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize
