"""Gemma 2 and Gemma 3 (text): (1 + weight) RMSNorm, norms after attention and the MLP as well
as before them, scaled embeddings, local and global layers."""

from __future__ import annotations

import dataclasses

from jaxserve.config import FULL, SLIDING, ConfigFeatures, ModelConfig
from jaxserve.config_fields import ConfigFields
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


def _layer_types(hf: ConfigFields, sliding_window: int | None) -> tuple[str, ...]:
    """Local/global pattern: ``layer_types``, else ``sliding_window_pattern`` (every n-th layer
    global), else Gemma 2's alternation (even layers local)."""
    num_layers = hf.required_integer("num_hidden_layers")
    if hf.strings("layer_types"):
        return hf.strings("layer_types")
    pattern = (
        hf.optional_integer("sliding_window_pattern")
        or hf.optional_integer("_sliding_window_pattern")
        or 2
    )
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


GEMMA2 = ConfigFeatures(is_gemma=True, layer_types=_layer_types)
# Gemma 3: q/k norms, a rope base of its own for the local layers, and a max_position_embeddings
# that already counts the rope scaling.
GEMMA3 = ConfigFeatures(
    is_gemma=True,
    qk_norm=True,
    layer_types=_layer_types,
    local_rope=True,
    max_positions_are_scaled=True,
)

FAMILIES = (
    Family("gemma2", ("Gemma2ForCausalLM",), GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS, GEMMA2),
    Family("gemma3_text", ("Gemma3ForCausalLM",), GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS, GEMMA3),
)
