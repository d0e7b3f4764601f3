"""Mixtral, Qwen3-MoE and Qwen2-MoE: the Llama decoder with experts in place of the dense MLP
(``models/moe.py``); and ``moe_layer_fields``, the experts' rows GPT-OSS and DeepSeek-V3 start
from."""

from __future__ import annotations

import dataclasses

from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS

# Mixtures of experts: the dense MLP rows only on dense layers, then the router and experts.
DENSE_MLP = ("w_gate", "w_up", "w_down")


def moe_layer_fields(
    base: tuple[WeightField, ...], block: str, gate: str, up: str, down: str
) -> tuple[WeightField, ...]:
    """``base`` with its MLP on dense layers only, and ``block``'s router and experts."""
    return (
        *(dataclasses.replace(f, mlp="dense") if f.name in DENSE_MLP else f for f in base),
        WeightField("router", f"{block}.gate.weight", ("E", "H"), "HE", transpose=True, mlp="moe"),
        *(
            WeightField(
                name,
                f"{block}.experts.{{expert}}.{hf}.weight",
                hf_shape,
                shape,
                transpose=True,
                per_expert=True,
                mlp="moe",
            )
            for name, hf, hf_shape, shape in (
                ("experts_gate", gate, ("M", "H"), "EHM"),
                ("experts_up", up, ("M", "H"), "EHM"),
                ("experts_down", down, ("H", "M"), "EMH"),
            )
        ),
    )


# Qwen3-MoE: Qwen3's attention (q/k norms); experts on the layers decoder_sparse_step picks,
# outside mlp_only_layers. Mixtral: Mistral's attention, experts on every layer (w1 gate,
# w3 up, w2 down, under block_sparse_moe).
QWEN3_MOE_LAYER_FIELDS = moe_layer_fields(
    LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj"
)
MIXTRAL_LAYER_FIELDS = moe_layer_fields(LLAMA_LAYER_FIELDS, "block_sparse_moe", "w1", "w3", "w2")
# Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's experts, and a shared expert every
# token goes through, its output times sigmoid(x @ shared_expert_gate).
QWEN2_MOE_LAYER_FIELDS = (
    *moe_layer_fields(LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj"),
    *(
        WeightField(name, f"mlp.{hf}.weight", hf_shape, shape, transpose=True, mlp="moe")
        for name, hf, hf_shape, shape in (
            ("shared_gate", "shared_expert.gate_proj", ("S", "H"), "HS"),
            ("shared_up", "shared_expert.up_proj", ("S", "H"), "HS"),
            ("shared_down", "shared_expert.down_proj", ("H", "S"), "SH"),
            ("shared_router", "shared_expert_gate", ("O", "H"), "HO"),
        )
    ),
)

FAMILIES = (
    Family("mixtral", ("MixtralForCausalLM",), MIXTRAL_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), QWEN3_MOE_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), QWEN2_MOE_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
)
