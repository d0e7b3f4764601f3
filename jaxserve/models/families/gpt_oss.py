"""GPT-OSS: attention with biases and sinks, experts on every layer with biases and the clamped
swiglu, alternating sliding and full layers."""

from __future__ import annotations

from jaxserve.config import ConfigFeatures, ModelConfig, MoeConfig
from jaxserve.config_fields import ConfigFields
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS
from jaxserve.models.families.moe import DENSE_MLP, experts_and_top_k


def _has_o_proj_bias(config: ModelConfig) -> bool:
    return config.o_proj_bias


def _has_sinks(config: ModelConfig) -> bool:
    return config.attention_sinks


# GPT-OSS: attention with q/k/v/o biases and a sink logit per head; experts on every layer,
# whole tensors stacked on E (already [in, out]), gate and up interleaved in gate_up_proj, a
# bias on the router and on each expert's projections.
GPT_OSS_LAYER_FIELDS = (
    *(f for f in LLAMA_LAYER_FIELDS if f.name not in (*DENSE_MLP, "q_norm", "k_norm")),
    WeightField("router", "mlp.router.weight", ("E", "H"), "HE", transpose=True, mlp="moe"),
    WeightField(
        "experts_gate",
        "mlp.experts.gate_up_proj",
        ("E", "H", "M"),
        "EHM",
        mlp="moe",
        interleave=2,
        part=0,
    ),
    WeightField(
        "experts_up",
        "mlp.experts.gate_up_proj",
        ("E", "H", "M"),
        "EHM",
        mlp="moe",
        interleave=2,
        part=1,
    ),
    WeightField("experts_down", "mlp.experts.down_proj", ("E", "M", "H"), "EMH", mlp="moe"),
    WeightField("bo", "self_attn.o_proj.bias", ("H",), "H", present=_has_o_proj_bias),
    WeightField("sinks", "self_attn.sinks", ("N",), "N", present=_has_sinks),
    WeightField("router_logit_bias", "mlp.router.bias", ("E",), "E", mlp="moe"),
    WeightField(
        "experts_gate_bias",
        "mlp.experts.gate_up_proj_bias",
        ("E", "M"),
        "EM",
        mlp="moe",
        interleave=2,
        part=0,
    ),
    WeightField(
        "experts_up_bias",
        "mlp.experts.gate_up_proj_bias",
        ("E", "M"),
        "EM",
        mlp="moe",
        interleave=2,
        part=1,
    ),
    WeightField("experts_down_bias", "mlp.experts.down_proj_bias", ("E", "H"), "EH", mlp="moe"),
)


def _moe(hf: ConfigFields) -> MoeConfig:
    """Experts on every layer, with biases and the clamped swiglu."""
    num_experts, top_k = experts_and_top_k(hf)
    intermediate_size = hf.required_integer("intermediate_size")
    # NOTE: Hugging Face's router takes the softmax of the top-k logits; a softmax over
    # every expert renormalized over the top k (norm_topk_prob) is the same weights.
    return MoeConfig(
        num_experts,
        top_k,
        intermediate_size,
        norm_topk_prob=True,
        has_biases=True,
        swiglu_limit=hf.number("swiglu_limit", 7.0),
        swiglu_alpha=hf.number("swiglu_alpha", 1.702),
    )


def _layer_types(hf: ConfigFields, sliding_window: int | None) -> tuple[str, ...]:
    """Alternating sliding and full layers, as config.json lists them, when it has a window."""
    return hf.strings("layer_types") if sliding_window is not None else ()


GPT_OSS = ConfigFeatures(moe=_moe, layer_types=_layer_types, attention_sinks=True, o_proj_bias=True)

FAMILIES = (
    Family("gpt_oss", ("GptOssForCausalLM",), GPT_OSS_LAYER_FIELDS, LLAMA_MODEL_FIELDS, GPT_OSS),
)
