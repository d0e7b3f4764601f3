"""Parameter counts of the weights a config describes, from its family's weight tables: for
capacity planning (``runner/devices.py``, ``bench/capacity.py``) and weight bytes."""

from __future__ import annotations

import math

from jaxserve.config import ModelConfig
from jaxserve.models.families.registry import layer_fields, model_fields


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
