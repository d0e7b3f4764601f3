"""Model families as data: one row per weight tensor, read by everything that handles weights.

A ``WeightField`` says where a tensor sits in a Hugging Face checkpoint (name, shape, layout)
and what it is in ``llama.Weights`` (field name, shape in einsum letters, how dummy weights fill
it, whether the config has it). The checkpoint loader, ``expected_shapes``, dummy weights,
parameter counting (``num_params``: capacity planning and weight bytes) and the tensor-parallel
layout (``runner/sharding.py``, which maps the letters to mesh axes) all read these tables, so a
new weight is one row here plus its attribute in ``LayerWeights`` or ``Weights``.

Shapes are written in the einsum letters of ``llama.py``: H hidden, N query heads, K kv heads,
D head dim, I intermediate, V vocab.
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
    return {
        "H": config.hidden_size,
        "N": config.num_q_heads,
        "K": config.num_kv_heads,
        "D": config.head_dim,
        "I": config.intermediate_size,
        "V": config.vocab_size,
    }


def _always(config: ModelConfig) -> bool:
    return True


def _has_attention_bias(config: ModelConfig) -> bool:
    return config.attention_bias


def _has_qk_norm(config: ModelConfig) -> bool:
    return config.qk_norm


def _has_lm_head(config: ModelConfig) -> bool:
    return not config.tie_word_embeddings


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
    init: Literal["normal", "ones"] = "normal"  # dummy weights: scaled noise, or ones (norms)
    present: Callable[[ModelConfig], bool] = _always  # whether the config has this tensor

    def __post_init__(self) -> None:
        if sorted("".join(self.hf_shape)) != sorted(self.shape):
            raise ValueError(f"{self.name}: {self.hf_shape=} and {self.shape=} differ in letters")

    def hf_shape_for(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = dim_sizes(config)
        return tuple(math.prod(sizes[dim] for dim in axis) for axis in self.hf_shape)

    def shape_for(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = dim_sizes(config)
        return tuple(sizes[dim] for dim in self.shape)

    def from_hf(self, tensor: np.ndarray, config: ModelConfig) -> np.ndarray:
        """A checkpoint tensor in this field's layout (a view where numpy can make one)."""
        return (tensor.T if self.transpose else tensor).reshape(self.shape_for(config))


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


# NOTE: every supported model_type is the Llama family (its variants are the `present`
# switches); a second family brings its own tables and is chosen here by config.model_type.
def layer_fields(config: ModelConfig) -> tuple[WeightField, ...]:
    """The per-layer tensors this config has, in table order."""
    return tuple(field for field in LLAMA_LAYER_FIELDS if field.present(config))


def model_fields(config: ModelConfig) -> tuple[WeightField, ...]:
    """The tensors outside the layers this config has, in table order."""
    return tuple(field for field in LLAMA_MODEL_FIELDS if field.present(config))


def num_params(config: ModelConfig, *, include_embedding: bool = True) -> int:
    """Parameter count of the weights this config describes."""
    per_layer = sum(math.prod(field.shape_for(config)) for field in layer_fields(config))
    outside = sum(
        math.prod(field.shape_for(config))
        for field in model_fields(config)
        if include_embedding or field.name != "embed"
    )
    return config.num_layers * per_layer + outside
