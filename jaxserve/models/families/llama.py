"""Llama 2/3 and Mistral, and the decoder's weight tables every other family starts from.

``LLAMA_LAYER_FIELDS`` and ``LLAMA_MODEL_FIELDS`` are the generic decoder's tensors
(``models/decoder.py``): Qwen, Gemma, Phi-3 and the mixtures of experts write their tables as
these rows, replaced, left out or added to.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField


def _has_attention_bias(config: ModelConfig) -> bool:
    return config.attention_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _has_lm_head(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


# The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k norms).
# NOTE: the order is LayerWeights' field order, and dummy weights draw one random key per
# tensor in this order; a reordering changes the dummy weights a seed gives.
LLAMA_LAYER_FIELDS = (
    WeightField("attn_norm", "input_layernorm.weight", ("H",), "H", init="ones"),
    WeightField("wq", "self_attn.q_proj.weight", ("ND", "H"), "HND", transpose=True),
    WeightField("wk", "self_attn.k_proj.weight", ("KD", "H"), "HKD", transpose=True),
    WeightField("wv", "self_attn.v_proj.weight", ("KD", "H"), "HKD", transpose=True),
    WeightField("wo", "self_attn.o_proj.weight", ("H", "ND"), "NDH", transpose=True),
    WeightField("mlp_norm", "post_attention_layernorm.weight", ("H",), "H", init="ones"),
    WeightField("w_gate", "mlp.gate_proj.weight", ("I", "H"), "HI", transpose=True),
    WeightField("w_up", "mlp.up_proj.weight", ("I", "H"), "HI", transpose=True),
    WeightField("w_down", "mlp.down_proj.weight", ("H", "I"), "IH", transpose=True),
    WeightField("bq", "self_attn.q_proj.bias", ("ND",), "ND", present=_has_attention_bias),
    WeightField("bk", "self_attn.k_proj.bias", ("KD",), "KD", present=_has_attention_bias),
    WeightField("bv", "self_attn.v_proj.bias", ("KD",), "KD", present=_has_attention_bias),
    WeightField(
        "q_norm", "self_attn.q_norm.weight", ("D",), "D", init="ones", present=_has_qk_norm
    ),
    WeightField(
        "k_norm", "self_attn.k_norm.weight", ("D",), "D", init="ones", present=_has_qk_norm
    ),
)

# The tensors outside the layers, fields of ``Weights``.
# NOTE: dummy weights draw their keys after the layers', in this order (lm_head first): the
# order they have always been drawn in, so a seed keeps giving the same weights.
LLAMA_MODEL_FIELDS = (
    WeightField(
        "lm_head", "lm_head.weight", ("V", "H"), "HV", transpose=True, present=_has_lm_head
    ),
    WeightField("embed", "model.embed_tokens.weight", ("V", "H"), "VH"),
    WeightField("final_norm", "model.norm.weight", ("H",), "H", init="ones"),
)

# The base models (``*Model``, no head) are what embedding checkpoints name: --runner pooling.
FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "LlamaModel"), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    Family(
        "mistral", ("MistralForCausalLM", "MistralModel"), LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS
    ),
)
