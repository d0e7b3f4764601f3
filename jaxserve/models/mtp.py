"""DeepSeek-V3's multi-token prediction (MTP) layers: their weights and their step, as pure
functions (speculative decoding's ``mtp`` method, ``runner/mtp_proposer.py``).

A checkpoint with ``num_nextn_predict_layers`` = n > 0 stores n more layers after the model's L
at ``model.layers.{L + i}.`` (``loading/mtp_checkpoint.py`` reads them when asked; the target's
loader leaves them). Each is run as vLLM's ``deepseek_mtp.py`` and SGLang's
``deepseek_nextn.py`` run it:

1. ``enorm`` of the embedding of the token at i + 1 (zero at position 0) and ``hnorm`` of the
   target's final hidden state at i (``decoder.forward``'s, after its norm), joined [T, 2H]
   and projected to H by ``eh_proj``;
2. one full decoder layer of the target's kind (latent attention over the MTP layer's own
   latent pages, experts), ``decoder.decoder_layer``'s code;
3. ``shared_head.norm`` then ``shared_head.head`` (the target's ``lm_head`` where the
   checkpoint has none) give the logits of the token at i + 2; the layer's output before that
   norm is the ``hidden`` of the next chained step.

The embedding is the target's (the checkpoint's copy at ``model.layers.{L}.embed_tokens`` is
the same tensor, as vLLM shares it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import moe, rope
from jaxserve.models.batch import Batch, kv_page_shapes
from jaxserve.models.decoder import AttentionFn, decoder_layer
from jaxserve.models.layers import LayerWeights, rms_norm
from jaxserve.models.quant import linear
from pallas_kernels.ragged_paged_attention import dispatch

Pages = tuple[jax.Array, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpWeights:
    """One MTP layer (``model.layers.{L + i}.*``)."""

    embed: jax.Array  # [V, H]  the target's embed_tokens
    enorm: jax.Array  # [H]
    hnorm: jax.Array  # [H]
    eh_proj: jax.Array  # [2H, H]  reads [enorm(embed), hnorm(hidden)]
    layer: LayerWeights  # the decoder layer, in the target's layout
    head_norm: jax.Array  # [H]  shared_head.norm
    lm_head: jax.Array  # [H, V]  shared_head.head, or the target's lm_head


def make_mtp_kv_cache(
    config: ModelConfig, num_layers: int, num_pages: int, page_size: int, dtype: jnp.dtype
) -> list[Pages]:
    """Each MTP layer's pages (the target's page shapes: MLA's latent and rotary key), zeroed."""
    k_shape, v_shape = kv_page_shapes(config, num_pages, page_size)
    return [(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)) for _ in range(num_layers)]


def mtp_forward(
    weights: MtpWeights,
    pages: Pages,  # this MTP layer's (make_mtp_kv_cache)
    batch: Batch,  # input_ids: the token after each position's; positions: the target's
    hidden: jax.Array,  # [T, H]  the target's final hidden states, or the previous step's
    config: ModelConfig,  # the target's
    attention_fn: AttentionFn | None = None,  # under TP: the op per device (tp.attention_fn)
    experts_fn: moe.ExpertsFn | None = None,  # under TP: the experts per device (tp.experts_fn)
) -> tuple[Pages, jax.Array]:  # (pages, the layer's output [T, H] before shared_head.norm)
    """The MTP layer over a ragged batch; writes its latent at ``batch.slot_mapping``."""
    eps = config.rms_norm_eps
    embeds = weights.embed[batch.input_ids]  # [T, H]
    embeds = jnp.where((batch.positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
    joined = jnp.concatenate(
        [
            rms_norm(embeds, weights.enorm, eps),
            rms_norm(hidden.astype(embeds.dtype), weights.hnorm, eps),
        ],
        axis=-1,
    )  # [T, 2H]
    x = linear(joined, weights.eh_proj, "TX,XH->TH")
    # The layer is of the target's last layer's kind (its rope; MLA has no window).
    layer = config.num_layers - 1
    freqs, scale = rope.rotary_angles(batch.positions, config.head_dim, *config.layer_rope(layer))
    rotary = rope.cos_sin(freqs, scale, x.dtype)
    attention_fn = attention_fn or dispatch.ragged_paged_attention
    x, pages = decoder_layer(
        weights.layer,
        x,
        pages,
        batch,
        config,
        rotary,
        attention_fn,
        layer,
        None,  # kv_scale: the pages are in the weights' dtype
        experts_fn,
        None,  # lora
        None,  # row_tile
    )
    return pages, x


def mtp_step(
    weights: MtpWeights,
    pages: Pages,
    batch: Batch,
    hidden: jax.Array,  # [T, H]
    config: ModelConfig,
    attention_fn: AttentionFn | None = None,
    experts_fn: moe.ExpertsFn | None = None,
) -> tuple[Pages, jax.Array, jax.Array]:  # (pages, f32[S, V], hidden [T, H])
    """One draft step: (the layer's pages, the logits at each sequence's
    ``batch.logits_indices`` row, the layer's output for the next chained step's ``hidden``)."""
    pages, out = mtp_forward(weights, pages, batch, hidden, config, attention_fn, experts_fn)
    normed = rms_norm(out[batch.logits_indices], weights.head_norm, config.rms_norm_eps)
    logits = linear(normed, weights.lm_head, "NH,HV->NV", jnp.float32)
    return pages, logits, out
