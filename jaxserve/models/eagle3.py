"""An EAGLE-3 draft head: its config, its weights and its step, as pure functions.

The head is the layout SpecForge and the EAGLE repository publish (``LlamaForCausalLMEagle3``,
e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``), run as vLLM's ``llama_eagle3.py`` runs it:

1. ``fuse_aux_hidden``: ``fc`` [3 H_t -> H] joins the target's low, mid and high hidden states
   (``decoder.forward_with_aux``, at ``Eagle3Config.aux_layers``) into one [T, H] row a token.
2. ``eagle3_step``: one decoder layer whose attention reads [input_layernorm(embed(token)),
   hidden_norm(hidden)] (2H wide) at each position, then ``norm`` and ``lm_head`` over the
   draft vocabulary, mapped to target ids (``d2t``). It returns the pre-norm hidden state, the
   ``hidden`` of the next chained draft step.

At position i the head reads the target's hidden state at i and the token at i + 1, and
proposes the token at i + 2: the first step of a round runs over the step's tokens shifted by
one (the last one the token just sampled); each further step is one token per sequence, the
previous draft, with the previous step's hidden row.

The head's one layer has its own K/V, paged like the target's (``make_eagle3_kv_cache``): the
same page table, slot mapping and kv_lens index it (``Batch``), so the runner allocates nothing
more per sequence, a rejected draft's K/V is out of sight once kv_lens stops before it (and is
written over next round), and the head reads the ragged attention op the target reads.

Loading from safetensors: ``loading/eagle3_checkpoint.py``. Einsum letters as ``decoder.py``'s;
W is the draft vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import rope
from jaxserve.models.batch import Batch
from jaxserve.models.decoder import AttentionFn, attention_block, mlp_block
from jaxserve.models.layers import LayerWeights, rms_norm
from jaxserve.models.quant import linear
from pallas_kernels.ragged_paged_attention import dispatch

# The architectures a head's config.json names (SpecForge / EAGLE, and vLLM's class name).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3  # low, mid, high


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice when a head names none: the stream entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json. ``layer``: its one decoder layer, read as a Llama config (the
    q/k/v projections read 2 * hidden_size, the rest is Llama's)."""

    layer: ModelConfig
    draft_vocab_size: int  # W: lm_head's rows; d2t maps them to target ids
    target_hidden_size: int  # H_t: each aux hidden state's width (fc reads 3 H_t)
    aux_layer_ids: tuple[int, ...] | None = None  # eagle_aux_hidden_state_layer_ids
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not hidden

    def __post_init__(self) -> None:
        if self.layer.num_layers != 1:
            raise ConfigError(
                f"num_hidden_layers={self.layer.num_layers}: an EAGLE-3 head has one layer"
            )
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} must be in [1, "
                f"vocab_size={self.layer.vocab_size}]"
            )
        if self.target_hidden_size <= 0:
            raise ConfigError(f"target_hidden_size={self.target_hidden_size} must be positive")
        ids = self.aux_layer_ids
        if ids is not None and (len(set(ids)) != NUM_AUX_LAYERS or min(ids) < 0):
            raise ConfigError(
                f"eagle_aux_hidden_state_layer_ids={list(ids)} must be {NUM_AUX_LAYERS} distinct "
                "layer ids >= 0"
            )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    def aux_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose input the head fuses, ascending (the order ``fc`` reads)."""
        ids = self.aux_layer_ids or default_aux_layers(target_num_layers)
        if len(set(ids)) != NUM_AUX_LAYERS or not all(0 <= i < target_num_layers for i in ids):
            raise ConfigError(
                f"eagle_aux_hidden_state_layer_ids {list(ids)} must be {NUM_AUX_LAYERS} distinct "
                f"ids in [0, the target's num_hidden_layers={target_num_layers}); name them in "
                "the head's eagle_config for a target this shallow"
            )
        return tuple(sorted(ids))

    def check_target(self, target: ModelConfig) -> None:
        """The head reads this target: its hidden states' width and its vocabulary."""
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(
                f"EAGLE-3 head: target_hidden_size={self.target_hidden_size} but the target "
                f"model's hidden_size={target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise ConfigError(
                f"EAGLE-3 head: vocab_size={self.vocab_size} but the target model's "
                f"vocab_size={target.vocab_size}"
            )
        self.aux_layers(target.num_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Weights:
    embed: jax.Array  # [V, H]  the head's embed_tokens, or the target's when it has none
    fc: jax.Array  # [3 H_t, H]
    hidden_norm: jax.Array  # [H]
    layer: LayerWeights  # attn_norm: input_layernorm (of the embedding); wq/wk/wv [2H, *, D]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, W]
    draft_to_target: jax.Array  # i32[W]  the target id of each draft id (id + d2t[id])


def make_eagle3_kv_cache(
    config: Eagle3Config, num_pages: int, page_size: int, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:  # ([P, page_size, K, D], [P, page_size, K, D])
    """The head's layer's pages, zeroed; indexed by the target's page table."""
    shape = (num_pages, page_size, config.layer.num_kv_heads, config.layer.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def fuse_aux_hidden(
    weights: Eagle3Weights,
    aux: Sequence[jax.Array],  # the target's states at aux_layers, ascending: 3 x [T, H_t]
) -> jax.Array:  # [T, H]
    """The first draft step's ``hidden``: ``fc`` over the target's three states, joined."""
    joined = jnp.concatenate(list(aux), axis=-1)  # [T, 3 H_t]
    # (in the head's dtype, its norms': fc may be a QArray, speculative_config quantization)
    return linear(joined.astype(weights.hidden_norm.dtype), weights.fc, "TX,XH->TH")


def eagle3_forward(
    weights: Eagle3Weights,
    kv: tuple[jax.Array, jax.Array],  # the head's pages (make_eagle3_kv_cache)
    batch: Batch,  # input_ids: the token after each position's; positions: the target's
    hidden: jax.Array,  # [T, H]  fuse_aux_hidden's, or the previous step's pre-norm rows
    config: Eagle3Config,
    attention_fn: AttentionFn | None = None,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array, jax.Array]:  # (kv, normed, pre-norm [T, H])
    """The head's layer over a ragged batch; writes its K/V at ``batch.slot_mapping``."""
    lc, lw = config.layer, weights.layer
    eps = lc.rms_norm_eps
    embeds = rms_norm(weights.embed[batch.input_ids], lw.attn_norm, eps)  # [T, H]
    hidden = hidden.astype(embeds.dtype)
    normed_hidden = rms_norm(hidden, weights.hidden_norm, eps)
    residual = normed_hidden if config.norm_before_residual else hidden
    x = jnp.concatenate([embeds, normed_hidden], axis=-1)  # [T, 2H]
    freqs, scale = rope.rotary_angles(batch.positions, lc.head_dim, *lc.layer_rope(0))
    rotary = rope.cos_sin(freqs, scale, x.dtype)
    attention_fn = attention_fn or dispatch.ragged_paged_attention
    attn, k_pages, v_pages = attention_block(
        lw, x, kv[0], kv[1], batch, lc, rotary, attention_fn, lc.layer_window(0)
    )
    residual = residual + attn
    prenorm = residual + mlp_block(lw, rms_norm(residual, lw.mlp_norm, eps))  # [T, H]
    return (k_pages, v_pages), rms_norm(prenorm, weights.final_norm, eps), prenorm


def draft_logits(weights: Eagle3Weights, normed: jax.Array) -> jax.Array:  # [N, H] -> f32[N, W]
    """Logits over the draft vocabulary (draft ids; ``draft_to_target`` names them)."""
    return linear(normed, weights.lm_head, "NH,HW->NW", jnp.float32)


def target_logits(
    weights: Eagle3Weights, normed: jax.Array, vocab_size: int
) -> jax.Array:  # [N, H] -> f32[N, V]
    """The draft logits placed at their target ids; -inf at every id outside the draft vocab."""
    logits = draft_logits(weights, normed)
    out = jnp.full((logits.shape[0], vocab_size), -jnp.inf, jnp.float32)
    return out.at[:, weights.draft_to_target].set(logits)


def greedy_draft(weights: Eagle3Weights, normed: jax.Array) -> jax.Array:  # [N, H] -> i32[N]
    """Each row's greedy draft as a target id: the draft vocabulary's argmax, mapped. The id
    of ``target_logits``' argmax (on a tie too where ``draft_to_target`` ascends, as EAGLE-3's
    training writes it), without the target-vocabulary array: at Llama-3's vocabulary that was
    a 0.5 MB fill, a scatter and a read a row, three more launches a chained step."""
    draft_ids = jnp.argmax(draft_logits(weights, normed), axis=-1)
    return weights.draft_to_target[draft_ids].astype(jnp.int32)


def eagle3_step(
    weights: Eagle3Weights,
    kv: tuple[jax.Array, jax.Array],
    batch: Batch,
    hidden: jax.Array,  # [T, H]
    config: Eagle3Config,
    attention_fn: AttentionFn | None = None,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array, jax.Array]:
    """One draft step: (the head's pages, f32[S, V] logits over target ids at each sequence's
    ``batch.logits_indices`` row, the pre-norm hidden [T, H] for the next step's ``hidden``)."""
    kv, normed, prenorm = eagle3_forward(weights, kv, batch, hidden, config, attention_fn)
    logits = target_logits(weights, normed[batch.logits_indices], config.vocab_size)
    return kv, logits, prenorm
