"""Mixtral, Qwen3-MoE and Qwen2-MoE: the Llama decoder with experts in place of the dense MLP
(``models/moe.py``); and ``moe_layer_fields``, the experts' rows GPT-OSS and DeepSeek-V3 start
from."""

from __future__ import annotations

import dataclasses

from jaxserve.config import ConfigFeatures, MoeConfig
from jaxserve.config_fields import ConfigError, ConfigFields
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


# The checkpoint method whose experts are read (dequantized, then quantized again per channel:
# checkpoint_loader.scaled_tensors); GPT-OSS's MXFP4 gets its own message at the scheme.
MOE_CHECKPOINT_METHODS = ("fp8", "mxfp4")


def reject_quantized_experts(hf: ConfigFields) -> None:
    """A quantized checkpoint of these families other than fp8: its experts' scales would not
    be read."""
    quant = hf.raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant and method not in MOE_CHECKPOINT_METHODS:
        raise ConfigError(
            f"quantization_config (quant_method={method!r}) is not supported for "
            f"{hf.raw['model_type']}: its experts would be read without their scales; serve "
            "an fp8 checkpoint or a bf16 one (--quantization fp8 or int8 then quantizes its "
            "Linear weights and experts on load)"
        )


def experts_and_top_k(hf: ConfigFields) -> tuple[int, int]:
    """(num_experts, top_k) of every family here, after the quantization check."""
    reject_quantized_experts(hf)
    num_experts = hf.optional_integer("num_local_experts") or hf.integer("num_experts", 0)
    top_k = hf.integer("num_experts_per_tok", 0)
    return num_experts, top_k


def _mixtral_moe(hf: ConfigFields) -> MoeConfig:
    """Experts on every layer, the top-k weights renormalized."""
    num_experts, top_k = experts_and_top_k(hf)
    intermediate_size = hf.required_integer("intermediate_size")
    return MoeConfig(num_experts, top_k, intermediate_size, norm_topk_prob=True)


def _qwen_moe(hf: ConfigFields, *, shared: bool) -> MoeConfig:
    """Experts on every ``decoder_sparse_step``-th layer except ``mlp_only_layers``; Qwen2-MoE
    (``shared``) adds a shared expert behind a sigmoid gate."""
    num_experts, top_k = experts_and_top_k(hf)
    num_layers = hf.required_integer("num_hidden_layers")
    step = hf.optional_integer("decoder_sparse_step") or 1
    only_dense = set(hf.integers("mlp_only_layers"))
    dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
    return MoeConfig(
        num_experts,
        top_k,
        hf.integer("moe_intermediate_size", 0),
        norm_topk_prob=hf.boolean("norm_topk_prob", False),
        dense_layers=dense,
        shared_intermediate_size=(
            hf.integer("shared_expert_intermediate_size", 0) if shared else 0
        ),
        has_shared_gate=shared,
    )


def _qwen3_moe(hf: ConfigFields) -> MoeConfig:
    return _qwen_moe(hf, shared=False)


def _qwen2_moe(hf: ConfigFields) -> MoeConfig:
    return _qwen_moe(hf, shared=True)


def _qkv_bias(hf: ConfigFields) -> bool:
    """Qwen2-MoE's q/k/v biases: ``qkv_bias``, on unless the config turns it off."""
    return hf.boolean("attention_bias", False) or hf.boolean("qkv_bias", True)


MIXTRAL = ConfigFeatures(moe=_mixtral_moe)
QWEN3_MOE = ConfigFeatures(qk_norm=True, sliding_window_opt_in=True, moe=_qwen3_moe)
QWEN2_MOE = ConfigFeatures(attention_bias=_qkv_bias, sliding_window_opt_in=True, moe=_qwen2_moe)

FAMILIES = (
    Family("mixtral", ("MixtralForCausalLM",), MIXTRAL_LAYER_FIELDS, LLAMA_MODEL_FIELDS, MIXTRAL),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        QWEN3_MOE_LAYER_FIELDS,
        LLAMA_MODEL_FIELDS,
        QWEN3_MOE,
    ),
    Family(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        QWEN2_MOE_LAYER_FIELDS,
        LLAMA_MODEL_FIELDS,
        QWEN2_MOE,
    ),
)
