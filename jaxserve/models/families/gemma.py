"""Gemma 2 and Gemma 3 (text): (1 + weight) RMSNorm, norms after attention and the MLP as well
as before them, scaled embeddings, local and global layers."""

from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS


def _has_sandwich_norms(config: ModelConfig) -> bool:
    return config.is_gemma


# Gemma 2 and 3: the same attention and MLP tensors, four norms per layer (the one Hugging Face
# calls post_attention_layernorm is applied to the attention output), q/k norms in Gemma 3,
# all norms scaling by (1 + weight). Tied embeddings.
_GEMMA_NORM_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
}
GEMMA_LAYER_FIELDS = (
    *(
        dataclasses.replace(
            field, hf_name=_GEMMA_NORM_NAMES.get(field.name, field.hf_name), init="zeros"
        )
        if field.init == "ones"
        else field
        for field in LLAMA_LAYER_FIELDS
        if field.name not in ("bq", "bk", "bv")
    ),
    WeightField(
        "post_attn_norm",
        "post_attention_layernorm.weight",
        ("H",),
        "H",
        init="zeros",
        present=_has_sandwich_norms,
    ),
    WeightField(
        "post_mlp_norm",
        "post_feedforward_layernorm.weight",
        ("H",),
        "H",
        init="zeros",
        present=_has_sandwich_norms,
    ),
)
GEMMA_MODEL_FIELDS = tuple(
    dataclasses.replace(field, init="zeros") if field.init == "ones" else field
    for field in LLAMA_MODEL_FIELDS
)

FAMILIES = (
    Family("gemma2", ("Gemma2ForCausalLM",), GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS),
    Family("gemma3_text", ("Gemma3ForCausalLM",), GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS),
)
