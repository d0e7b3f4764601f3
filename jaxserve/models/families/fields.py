"""The weight tables' rows: ``WeightField`` says where one tensor sits in a Hugging Face
checkpoint and what it is in ``layers.Weights``; ``dim_sizes`` gives the einsum letters' sizes.

Each family module of this package writes its tables of these rows (``Family.layer_table``,
``Family.model_table``). The checkpoint loader, ``expected_shapes``, dummy weights, parameter
counting (``counting.py``: capacity planning and weight bytes) and the tensor-parallel layout
(``runner/parallel/sharding.py``, which maps the letters to mesh axes) all read the tables, so a new
weight is one row in its family's table plus its attribute in ``LayerWeights`` or ``Weights``.

Shapes are written in the einsum letters of ``decoder.py``: H hidden, N query heads, K kv heads,
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
