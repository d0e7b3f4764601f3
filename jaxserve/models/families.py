"""Model families as data: one row per weight tensor, read by everything that handles weights.

A ``WeightField`` says where a tensor sits in a Hugging Face checkpoint (name, shape, layout)
and what it is in ``llama.Weights`` (field name, shape in einsum letters, how dummy weights fill
it, whether the config has it). The checkpoint loader, ``expected_shapes``, dummy weights,
parameter counting (``num_params``: capacity planning and weight bytes) and the tensor-parallel
layout (``runner/sharding.py``, which maps the letters to mesh axes) all read these tables, so a
new weight is one row here plus its attribute in ``LayerWeights`` or ``Weights``.

Shapes are written in the einsum letters of ``llama.py``: H hidden, N query heads, K kv heads,
D head dim, I intermediate, V vocab; and of ``moe.py``: E experts, M an expert's intermediate,
S the shared expert's intermediate, O one (the shared expert's gate); and of ``mla.py``: Q the
query's low rank, L the KV latent, C a head's key part without rope, R the rotary key part,
U a head's value, A = C + R (a query head), B = C + U (a head's share of kv_b_proj).

A mixture of experts' expert tensors are one checkpoint tensor per expert (``per_expert``:
``{expert}`` in the name), stacked on a leading E axis; ``mlp`` says whether a row belongs to
the layers with a dense MLP or to those with experts (Qwen3-MoE's ``mlp_only_layers``).

A fused checkpoint tensor (Phi-3's ``qkv_proj`` and ``gate_up_proj``) is one row per part:
``fused`` lists the first-axis blocks of the whole tensor and ``part`` says which is this one.
GPT-OSS's experts are whole tensors stacked on E, gate and up interleaved on the last axis
(gate at even, up at odd entries): ``interleave`` 2, ``part`` 0 or 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import numpy as np

from jaxserve.config import ModelConfig

# Hugging Face's name of layer ``layer``'s tensors: this prefix + ``WeightField.hf_name``.
HF_LAYER_PREFIX = "model.layers.{layer}."


def dim_sizes(config: ModelConfig) -> dict[str, int]:
    """Einsum letter -> its size in this config."""
    mla = config.mla
    return {
        "H": config.hidden_size,
        "N": config.num_q_heads,
        "K": config.num_kv_heads,
        "D": config.head_dim,
        "I": config.intermediate_size,
        "V": config.vocab_size,
        "E": config.moe.num_experts if config.moe else 0,
        "M": config.moe.intermediate_size if config.moe else 0,
        "S": config.moe.shared_intermediate_size if config.moe else 0,
        "O": 1,
        "Q": (mla.q_lora_rank or 0) if mla else 0,
        "L": mla.kv_lora_rank if mla else 0,
        "C": mla.qk_nope_head_dim if mla else 0,
        "R": mla.qk_rope_head_dim if mla else 0,
        "U": mla.v_head_dim if mla else 0,
        "A": mla.qk_head_dim if mla else 0,
        "B": mla.qk_nope_head_dim + mla.v_head_dim if mla else 0,
    }


def _always(config: ModelConfig) -> bool:
    return True


def _has_attention_bias(config: ModelConfig) -> bool:
    return config.attention_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _has_lm_head(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


def _has_o_proj_bias(config: ModelConfig) -> bool:
    return config.o_proj_bias


def _has_sinks(config: ModelConfig) -> bool:
    return config.attention_sinks


@dataclasses.dataclass(frozen=True)
class WeightField:
    """One weight tensor of a model family, in the checkpoint and in ``Weights``."""

    name: str  # attribute of LayerWeights (layer tables) or Weights (model tables)
    hf_name: str  # checkpoint tensor name; in a layer table, the part after HF_LAYER_PREFIX
    # Checkpoint shape, one entry per axis, each a product of letters: ("ND", "H") is [N * D, H].
    hf_shape: tuple[str, ...]
    shape: str  # shape in Weights, one letter per axis: "HND" is [H, N, D]
    # Hugging Face Linear weights are [out, in]: transposed, then reshaped to ``shape``.
    transpose: bool = False
    # Dummy weights: scaled noise, ones (norms) or zeros (Gemma's norms, which scale by 1 + w).
    init: Literal["normal", "ones", "zeros"] = "normal"
    present: Callable[[ModelConfig], bool] = _always  # whether the config has this tensor
    # A part of a fused tensor: the first-axis blocks of the whole (("ND", "KD", "KD") for
    # qkv_proj) and this field's index among them; empty for a tensor of its own.
    fused: tuple[str, ...] = ()
    part: int = 0
    # One checkpoint tensor per expert, ``{expert}`` in hf_name, hf_shape one expert's; the
    # field stacks them on its leading E axis.
    per_expert: bool = False
    # "dense": only layers with a dense MLP have it; "moe": only layers with experts.
    mlp: Literal["any", "dense", "moe"] = "any"
    # A part of a checkpoint tensor that interleaves ``interleave`` tensors on its last axis:
    # this field is entries part, part + interleave, ... (0: a tensor of its own).
    interleave: int = 0
    # Kept in float32 whatever the weights' dtype: DeepSeek-V3's router and its correction
    # bias, which pick among 256 sigmoid scores a few thousandths apart (transformers keeps
    # both in float32 too).
    is_float32: bool = False

    def __post_init__(self) -> None:
        if self.per_expert != ("{expert}" in self.hf_name) or (
            self.per_expert and not self.shape.startswith("E")
        ):
            raise ValueError(f"{self.name}: per_expert needs {{expert}} in hf_name and shape E...")
        if sorted("E" * self.per_expert + "".join(self.hf_shape)) != sorted(self.shape):
            raise ValueError(f"{self.name}: {self.hf_shape=} and {self.shape=} differ in letters")
        if self.fused and self.fused[self.part] != self.hf_shape[0]:
            raise ValueError(f"{self.name}: {self.part=} of {self.fused=} is not {self.hf_shape}")
        if self.interleave and (self.fused or not 0 <= self.part < self.interleave):
            raise ValueError(f"{self.name}: {self.interleave=} needs 0 <= part < it, no fused")

    @property
    def is_of_each_expert(self) -> bool:
        """Whether this is the experts' own weights stacked on E (a token reads top_k of them),
        whether one checkpoint tensor per expert or one for all (GPT-OSS)."""
        return self.shape.startswith("E") and len(self.shape) > 1

    def hf_shape_for(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = dim_sizes(config)
        return tuple(math.prod(sizes[dim] for dim in axis) for axis in self.hf_shape)

    def checkpoint_shape_for(self, config: ModelConfig) -> tuple[int, ...]:
        """Shape of the checkpoint tensor this field is read from (the whole of a fused one)."""
        shape = self.hf_shape_for(config)
        if self.interleave:
            return (*shape[:-1], shape[-1] * self.interleave)
        if not self.fused:
            return shape
        sizes = dim_sizes(config)
        rows = sum(math.prod(sizes[dim] for dim in block) for block in self.fused)
        return (rows, *shape[1:])

    def shape_for(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = dim_sizes(config)
        return tuple(sizes[dim] for dim in self.shape)

    def part_rows(self, config: ModelConfig) -> slice:
        """This field's first-axis rows of the checkpoint tensor (all of a tensor of its own)."""
        if not self.fused:
            return slice(None)
        sizes = dim_sizes(config)
        blocks = [math.prod(sizes[dim] for dim in block) for block in self.fused]
        start = sum(blocks[: self.part])
        return slice(start, start + blocks[self.part])

    def hf_names(self, config: ModelConfig, prefix: str = "") -> list[str]:
        """The checkpoint tensors this field is read from: one, or one per expert."""
        if not self.per_expert:
            return [prefix + self.hf_name]
        return [prefix + self.hf_name.format(expert=e) for e in range(dim_sizes(config)["E"])]

    def is_in_layer(self, config: ModelConfig, layer: int) -> bool:
        if self.mlp == "any":
            return True
        return (self.mlp == "moe") == config.is_moe_layer(layer)

    def from_hf(self, tensor: np.ndarray, config: ModelConfig) -> np.ndarray:
        """A checkpoint tensor in this field's layout (a view where numpy can make one); of a
        per-expert field, one expert's."""
        tensor = tensor[self.part_rows(config)]
        if self.interleave:
            tensor = tensor[..., self.part :: self.interleave]
        shape = self.shape_for(config)[1:] if self.per_expert else self.shape_for(config)
        return (tensor.T if self.transpose else tensor).reshape(shape)


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

# Phi-3: q, k and v in one qkv_proj tensor, gate and up in one gate_up_proj.
_QKV = ("ND", "KD", "KD")
_GATE_UP = ("I", "I")
_PHI3_FUSED = {
    "wq": ("self_attn.qkv_proj.weight", _QKV, 0),
    "wk": ("self_attn.qkv_proj.weight", _QKV, 1),
    "wv": ("self_attn.qkv_proj.weight", _QKV, 2),
    "w_gate": ("mlp.gate_up_proj.weight", _GATE_UP, 0),
    "w_up": ("mlp.gate_up_proj.weight", _GATE_UP, 1),
}
PHI3_LAYER_FIELDS = tuple(
    dataclasses.replace(
        field,
        hf_name=_PHI3_FUSED[field.name][0],
        fused=_PHI3_FUSED[field.name][1],
        part=_PHI3_FUSED[field.name][2],
    )
    if field.name in _PHI3_FUSED
    else field
    for field in LLAMA_LAYER_FIELDS
    if field.name not in ("bq", "bk", "bv", "q_norm", "k_norm")
)

# Mixtures of experts: the dense MLP rows only on dense layers, then the router and experts.
_DENSE_MLP = ("w_gate", "w_up", "w_down")


def _moe_layer_fields(
    base: tuple[WeightField, ...], block: str, gate: str, up: str, down: str
) -> tuple[WeightField, ...]:
    """``base`` with its MLP on dense layers only, and ``block``'s router and experts."""
    return (
        *(dataclasses.replace(f, mlp="dense") if f.name in _DENSE_MLP else f for f in base),
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
QWEN3_MOE_LAYER_FIELDS = _moe_layer_fields(
    LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj"
)
MIXTRAL_LAYER_FIELDS = _moe_layer_fields(LLAMA_LAYER_FIELDS, "block_sparse_moe", "w1", "w3", "w2")
# Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's experts, and a shared expert every
# token goes through, its output times sigmoid(x @ shared_expert_gate).
QWEN2_MOE_LAYER_FIELDS = (
    *_moe_layer_fields(LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj"),
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

# GPT-OSS: attention with q/k/v/o biases and a sink logit per head; experts on every layer,
# whole tensors stacked on E (already [in, out]), gate and up interleaved in gate_up_proj, a
# bias on the router and on each expert's projections.
GPT_OSS_LAYER_FIELDS = (
    *(f for f in LLAMA_LAYER_FIELDS if f.name not in (*_DENSE_MLP, "q_norm", "k_norm")),
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
        for f in _moe_layer_fields(LLAMA_LAYER_FIELDS, "mlp", "gate_proj", "up_proj", "down_proj")
        if f.name in ("attn_norm", "wq", "wo", "mlp_norm", "router", *_DENSE_MLP)
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

# model_type -> (layer table, model table). Every family's fields are LayerWeights' fields in
# their order; a field a family never has is left out of its table.
FAMILY_TABLES: dict[str, tuple[tuple[WeightField, ...], tuple[WeightField, ...]]] = {
    "llama": (LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "mistral": (LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "qwen2": (LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "qwen3": (LLAMA_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "gemma2": (GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS),
    "gemma3_text": (GEMMA_LAYER_FIELDS, GEMMA_MODEL_FIELDS),
    "phi3": (PHI3_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "mixtral": (MIXTRAL_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "qwen3_moe": (QWEN3_MOE_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "qwen2_moe": (QWEN2_MOE_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "gpt_oss": (GPT_OSS_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
    "deepseek_v3": (DEEPSEEK_V3_LAYER_FIELDS, LLAMA_MODEL_FIELDS),
}


def layer_fields(config: ModelConfig, layer: int | None = None) -> tuple[WeightField, ...]:
    """The tensors of layer ``layer`` (None: of any layer) this config has, in table order."""
    table = FAMILY_TABLES[config.model_type][0]
    return tuple(
        field
        for field in table
        if field.present(config)
        and (
            field.is_in_layer(config, layer)
            if layer is not None
            else any(field.is_in_layer(config, i) for i in range(config.num_layers))
        )
    )


def model_fields(config: ModelConfig) -> tuple[WeightField, ...]:
    """The tensors outside the layers this config has, in table order."""
    table = FAMILY_TABLES[config.model_type][1]
    return tuple(field for field in table if field.present(config))


def num_params(config: ModelConfig, *, include_embedding: bool = True) -> int:
    """Parameter count of the weights this config describes (every expert of every layer)."""
    layers = sum(
        math.prod(field.shape_for(config))
        for layer in range(config.num_layers)
        for field in layer_fields(config, layer)
    )
    outside = sum(
        math.prod(field.shape_for(config))
        for field in model_fields(config)
        if include_embedding or field.name != "embed"
    )
    return layers + outside


def num_float32_params(config: ModelConfig) -> int:
    """Parameters kept in float32 whatever the weights' dtype (``WeightField.is_float32``)."""
    return sum(
        math.prod(field.shape_for(config))
        for layer in range(config.num_layers)
        for field in layer_fields(config, layer)
        if field.is_float32
    )


def num_active_params(config: ModelConfig, *, include_embedding: bool = True) -> int:
    """Parameters one token reads: of a mixture of experts, only ``top_k`` experts per layer."""
    total = num_params(config, include_embedding=include_embedding)
    if config.moe is None:
        return total
    idle = config.moe.num_experts - config.moe.top_k
    per_expert = sum(
        math.prod(field.shape_for(config)[1:])
        for field in layer_fields(config)
        if field.is_of_each_expert
    )
    num_moe_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    return total - num_moe_layers * idle * per_expert
