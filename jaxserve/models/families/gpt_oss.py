"""GPT-OSS: attention with biases and sinks, experts on every layer with biases and the clamped
swiglu, alternating sliding and full layers."""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField
from jaxserve.models.families.llama import LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS
from jaxserve.models.families.moe import DENSE_MLP


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

FAMILIES = (Family("gpt_oss", ("GptOssForCausalLM",), GPT_OSS_LAYER_FIELDS, LLAMA_MODEL_FIELDS),)
