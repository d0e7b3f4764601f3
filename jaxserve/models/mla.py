"""Multi-head latent attention (DeepSeek-V2/V3) over the compressed paged KV cache, as a pure
function ``decoder.forward`` calls for a family with ``config.mla``.

Per token and layer the cache holds the normalized latent c_kv [kv_lora_rank] and the rotated
shared key k_pe [qk_rope_head_dim] (``config.kv_cache_dims``: the two page arrays of the
layer's pair), nothing per head. Head n's key is ``[c_kv @ W_UK[n], k_pe]`` and its value
``c_kv @ W_UV[n]``, where W_UK and W_UV are kv_b_proj's two parts; attention runs in the latent
space instead: the query's non-rotary part is multiplied by W_UK (absorbed), the scores are
``q_latent . c_kv + q_pe . k_pe``, and the weighted latent is multiplied by W_UV afterwards
(``pallas_kernels.mla``: the dispatch picks its kernel or reference).

Einsum letters: T tokens, H hidden, N heads, Q the query's low rank, L latent, C a head's key
part without rope, R rotary dims, U a head's value, A = C + R, B = C + U.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import rope
from jaxserve.models.batch import Batch
from jaxserve.models.layers import LayerWeights, rms_norm
from jaxserve.models.quant import linear
from pallas_kernels.kv_cache import write_latent
from pallas_kernels.mla.dispatch import ragged_paged_mla_attention

# NOTE: the absorbed form, not expanding K and V from the latent inside the step: it keeps
# the cache at the latent's size and reads it as one KV head (the reference's MQA semantics
# with K = V = the latent, which the tests check it against), while expanding would run every
# cached token through kv_b_proj in every layer of every step. vLLM and SGLang decode this way.


def deinterleave(x: jax.Array) -> jax.Array:  # [..., R] -> [..., R]
    """DeepSeek's rotary pairs (x0, x1), (x2, x3), ... as halves (x0, x2, ..., x1, x3, ...):
    the rotate-half layout ``rope.apply_rotary`` turns. As transformers does for
    ``rope_interleave``; q and k get the same permutation, so their dot product is unchanged."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def mla_attention_block(
    lw: LayerWeights,  # with the MLA fields
    x: jax.Array,  # [T, H]
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    batch: Batch,
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],  # (cos, sin), each [T, 1, R] in x's dtype
    kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (c_kv, k_pe) scales
    attention_fn: Callable[..., jax.Array] | None = None,  # the runner's attention op
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (out [T, H], ckv_pages, kpe_pages)
    mla = config.mla
    assert mla is not None
    assert lw.wkv_a is not None and lw.wk_pe is not None and lw.kv_a_norm is not None
    assert lw.w_kv_b is not None
    eps = config.rms_norm_eps
    if lw.wq_a is not None:  # the low-rank query
        assert lw.q_a_norm is not None and lw.wq_b is not None
        q_low = rms_norm(jnp.einsum("TH,HQ->TQ", x, lw.wq_a), lw.q_a_norm, eps)  # [T, Q]
        q = jnp.einsum("TQ,QNA->TNA", q_low, lw.wq_b)
    else:
        assert lw.wq is not None
        q = linear(x, lw.wq, "TH,HNA->TNA")
    q_nope, q_pe = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
    c_kv = rms_norm(jnp.einsum("TH,HL->TL", x, lw.wkv_a), lw.kv_a_norm, eps)  # [T, L]
    k_pe = jnp.einsum("TH,HR->TR", x, lw.wk_pe)[:, None, :]  # [T, 1, R]
    if mla.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe = rope.apply_rotary(q_pe, *rotary)  # [T, N, R]
    k_pe = rope.apply_rotary(k_pe, *rotary)[:, 0]  # [T, R]

    scales = {} if kv_scale is None else {"ckv_scale": kv_scale[0], "kpe_scale": kv_scale[1]}
    ckv_pages, kpe_pages = write_latent(
        ckv_pages, kpe_pages, c_kv, k_pe, batch.slot_mapping, **scales
    )
    # NOTE: W_UK and W_UV are slices of the one kv_b_proj tensor, as the checkpoint has it.
    w_uk = lw.w_kv_b[..., : mla.qk_nope_head_dim]  # [L, N, C]
    w_uv = lw.w_kv_b[..., mla.qk_nope_head_dim :]  # [L, N, U]
    q_latent = jnp.einsum("TNC,LNC->TNL", q_nope, w_uk)
    out = latent_attention(
        q_latent, q_pe, ckv_pages, kpe_pages, batch, config.sm_scale, kv_scale, attention_fn
    )  # [T, N, L]
    out = jnp.einsum("TNL,LNU->TNU", out, w_uv)
    return linear(out, lw.wo, "TNU,NUH->TH"), ckv_pages, kpe_pages


def latent_attention(
    q_latent: jax.Array,  # [T, N, L]
    q_pe: jax.Array,  # [T, N, R]
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    batch: Batch,
    sm_scale: float,
    kv_scale: tuple[float, float] | None,  # an fp8 cache's (c_kv, k_pe) scales
    attention_fn: Callable[..., jax.Array] | None,
) -> jax.Array:  # [T, N, L]
    """The weighted latent. ``attention_fn``: the runner's attention op
    (``ragged_paged_attention.dispatch``'s signature, or its ``shard_map`` over the heads under
    tensor parallelism), called with ``q_pe`` (latent attention: the pages as K and V, their
    scales as k_scale / v_scale); None: ``mla.dispatch`` directly."""
    args = (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
    if attention_fn is None:
        ckv_scale, kpe_scale = (None, None) if kv_scale is None else kv_scale
        return ragged_paged_mla_attention(
            q_latent,
            q_pe,
            ckv_pages,
            kpe_pages,
            *args,
            sm_scale=sm_scale,
            ckv_scale=ckv_scale,
            kpe_scale=kpe_scale,
        )
    op_scales = {} if kv_scale is None else dict(k_scale=kv_scale[0], v_scale=kv_scale[1])
    return attention_fn(
        q_latent, ckv_pages, kpe_pages, *args, sm_scale=sm_scale, q_pe=q_pe, **op_scales
    )
