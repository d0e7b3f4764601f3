"""DeepSeek-V3: multi-head latent attention (``models/mla.py``) over a cache of latents, dense
MLPs in the first layers, then grouped sigmoid routing over experts and a shared expert."""

from __future__ import annotations

import dataclasses

from jaxserve.config import ModelConfig
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS
from jaxserve.models.families.moe import DENSE_MLP, moe_layer_fields


def _has_q_lora(config: ModelConfig) -> bool:
    return config.mla is not None and config.mla.q_lora_rank is not None


def _has_plain_q(config: ModelConfig) -> bool:
    return config.mla is not None and config.mla.q_lora_rank is None


# DeepSeek-V3: multi-head latent attention (models/mla.py). The query through q_proj, or
# through the q_lora_rank bottleneck (q_a_proj, its RMSNorm, q_b_proj); kv_a_proj_with_mqa is
# the latent's rows then the rotary key's (two parts of one tensor); kv_b_proj expands the
# latent to each head's key part and value, [N * (C + U), L] with each head's rows together.
# The first layers have a dense MLP, the others experts, a shared expert and the router's
# e_score_correction_bias.
DEEPSEEK_V3_LAYER_FIELDS = (
    *(
        dataclasses.replace(f, present=_has_plain_q, hf_shape=("NA", "H"), shape="HNA")
        if f.name == "wq"
        else dataclasses.replace(f, hf_shape=("H", "NU"), shape="NUH")
        if f.name == "wo"
        else dataclasses.replace(f, is_float32=True)
        if f.name == "router"
        else f
        for f in moe_layer_fields(LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj")
        if f.name in ("attn_norm", "wq", "wo", "mlp_norm", "router", *DENSE_MLP)
        or f.name.startswith("experts_")
    ),
    *(
        WeightField(
            name, f"mlp.shared_experts.{hf}.weight", hf_shape, shape, transpose=True, mlp="moe"
        )
        for name, hf, hf_shape, shape in (
            ("shared_gate", "gate_proj", ("S", "H"), "HS"),
            ("shared_up", "up_proj", ("S", "H"), "HS"),
            ("shared_down", "down_proj", ("H", "S"), "SH"),
        )
    ),
    WeightField(
        "wq_a", "self_attn.q_a_proj.weight", ("Q", "H"), "HQ", transpose=True, present=_has_q_lora
    ),
    WeightField(
        "q_a_norm",
        "self_attn.q_a_layernorm.weight",
        ("Q",),
        "Q",
        init="ones",
        present=_has_q_lora,
    ),
    WeightField(
        "wq_b", "self_attn.q_b_proj.weight", ("NA", "Q"), "QNA", transpose=True, present=_has_q_lora
    ),
    WeightField(
        "wkv_a",
        "self_attn.kv_a_proj_with_mqa.weight",
        ("L", "H"),
        "HL",
        transpose=True,
        fused=("L", "R"),
        part=0,
    ),
    WeightField(
        "wk_pe",
        "self_attn.kv_a_proj_with_mqa.weight",
        ("R", "H"),
        "HR",
        transpose=True,
        fused=("L", "R"),
        part=1,
    ),
    WeightField("kv_a_norm", "self_attn.kv_a_layernorm.weight", ("L",), "L", init="ones"),
    WeightField("w_kv_b", "self_attn.kv_b_proj.weight", ("NB", "L"), "LNB", transpose=True),
    WeightField(
        "router_bias", "mlp.gate.e_score_correction_bias", ("E",), "E", mlp="moe", is_float32=True
    ),
)

FAMILIES = (
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), DEEPSEEK_V3_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
)
