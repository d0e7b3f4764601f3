"""DeepSeek-V3: multi-head latent attention (``models/mla.py``) over a cache of latents, dense
MLPs in the first layers, then grouped sigmoid routing over experts and a shared expert."""

from __future__ import annotations

import dataclasses
import math

from jaxserve.config import ConfigFeatures, MlaConfig, ModelConfig, MoeConfig, rope_type_of
from jaxserve.config_fields import ConfigError, ConfigFields
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


def _mla(hf: ConfigFields, rope: ConfigFields) -> MlaConfig:
    """The latent attention, its softmax scale as transformers' ``yarn_apply_mscale`` makes
    it."""
    model_type = hf.raw["model_type"]
    if hf.boolean("attention_bias", False):
        raise ConfigError(f"attention_bias=True is not supported for {model_type}; only false")
    quant = hf.raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    # NOTE: an fp8 checkpoint (the published one: 128 x 128 block scales) is read: its latent
    # and shared-expert projections dequantized on load, its experts quantized again per
    # channel (checkpoint_loader.scaled_tensors); others would lose their scales.
    if quant and method != "fp8":
        raise ConfigError(
            f"quantization_config (quant_method={method!r}) is not supported for {model_type}; "
            "serve its fp8 checkpoint or a bf16 one (--quantization fp8 or int8 quantizes it "
            "on load)"
        )
    mla = MlaConfig(
        kv_lora_rank=hf.required_integer("kv_lora_rank"),
        qk_nope_head_dim=hf.required_integer("qk_nope_head_dim"),
        qk_rope_head_dim=hf.required_integer("qk_rope_head_dim"),
        v_head_dim=hf.required_integer("v_head_dim"),
        q_lora_rank=hf.optional_integer("q_lora_rank"),
        rope_interleave=hf.boolean("rope_interleave", True),
    )
    scale = mla.qk_head_dim**-0.5
    mscale_all_dim = rope.optional_number("mscale_all_dim")
    if rope_type_of(rope) != "default" and mscale_all_dim:
        factor = rope.optional_number("factor")
        if factor is None:
            raise ConfigError(f"{rope.prefix}factor is needed with mscale_all_dim")
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return dataclasses.replace(mla, softmax_scale=scale)


def _moe(hf: ConfigFields) -> MoeConfig:
    """``first_k_dense_replace`` dense layers, then routed experts with sigmoid scores,
    grouped top-k steered by ``e_score_correction_bias``, the routed scaling factor, and
    ``n_shared_experts`` shared experts (one dense MLP of their summed width)."""
    num_layers = hf.required_integer("num_hidden_layers")
    first_dense = hf.integer("first_k_dense_replace", 0)
    moe_intermediate = hf.integer("moe_intermediate_size", 0)
    return MoeConfig(
        hf.integer("n_routed_experts", 0),
        hf.integer("num_experts_per_tok", 0),
        moe_intermediate,
        scoring="sigmoid",
        norm_topk_prob=hf.boolean("norm_topk_prob", True),
        n_group=hf.optional_integer("n_group") or 1,
        topk_group=hf.optional_integer("topk_group") or 1,
        routed_scaling_factor=hf.optional_number("routed_scaling_factor") or 1.0,
        has_correction_bias=True,
        shared_intermediate_size=moe_intermediate * hf.integer("n_shared_experts", 0),
        dense_layers=tuple(range(min(first_dense, num_layers))),
    )


DEEPSEEK_V3 = ConfigFeatures(mla=_mla, moe=_moe)

FAMILIES = (
    Family(
        "deepseek_v3",
        ("DeepseekV3ForCausalLM",),
        DEEPSEEK_V3_LAYER_FIELDS,
        LLAMA_MODEL_FIELDS,
        DEEPSEEK_V3,
    ),
)
