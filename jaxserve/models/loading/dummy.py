"""Dummy weights: random weights in a config's real architecture (``--load-format dummy``, for
benchmarks and tests), made on the device from the family's weight tables, each tensor placed
as the runner's placement says (and quantized with a quantize-on-load scheme)."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import WeightField, dim_sizes
from jaxserve.models.families.registry import layer_fields, model_fields
from jaxserve.models.layers import LayerWeights, Weights
from jaxserve.models.loading.field_conversion import (
    Placement,
    field_dtype,
    is_quantized,
    is_quantized_experts,
    place_quantized,
    quantized_experts,
)
from jaxserve.models.loading.load_progress import raise_if_stopped
from jaxserve.models.quant import QArray, quantize, to_out_in
from jaxserve.models.quant_scheme import QuantScheme


def dummy_weights(
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    seed: int = 0,
    placement: Placement | None = None,
    scale: float = 0.02,
    scheme: QuantScheme | None = None,
    stop: threading.Event | None = None,
) -> Weights:
    """Random weights in the real architecture (for benchmarks and tests); made on the device.

    With a quantize-on-load ``scheme`` the Linear weights are the same random weights (the
    same seed gives the same bf16 values), quantized. Once ``stop`` is set, the next tensor
    raises ``LoadCancelled``."""
    key = jax.random.key(seed)
    if scheme is not None and scheme.from_checkpoint:
        raise ValueError(f"dummy weights cannot be made for a {scheme.method} checkpoint")

    def make(path: tuple[Any, ...], field: WeightField) -> Any:
        if stop is not None:
            raise_if_stopped(stop)
        made = make_one(path, field)
        # NOTE: with a stop to obey, one tensor at a time: dispatched ahead, every tensor
        # would be queued on the device before the first check (one sync per tensor costs
        # nothing beside making it).
        return jax.block_until_ready(made) if stop is not None else made

    def make_one(path: tuple[Any, ...], field: WeightField) -> Any:
        nonlocal key
        key, sub = jax.random.split(key)
        shape = field.shape_for(config)
        if field.init != "normal":
            array = (jnp.ones if field.init == "ones" else jnp.zeros)(shape, dtype)
        else:
            array = (scale * jax.random.normal(sub, shape, jnp.float32)).astype(
                field_dtype(field, dtype)
            )
        if is_quantized(field, scheme):
            assert scheme is not None
            return _quantized(array, path, field, config, scheme, placement)
        sharding = placement(path, shape) if placement is not None else None
        return array if sharding is None else jax.device_put(array, sharding)

    layers = [
        LayerWeights(
            **{f.name: make(("layers", layer, f.name), f) for f in layer_fields(config, layer)}
        )
        for layer in range(config.num_layers)
    ]
    outside: dict[str, Any] = {f.name: make((f.name,), f) for f in model_fields(config)}
    return Weights(layers=layers, **outside)


def _quantized(
    array: jax.Array,
    path: tuple[Any, ...],
    field: WeightField,
    config: ModelConfig,
    scheme: QuantScheme,
    placement: Placement | None,
) -> QArray:
    """A random weight in the model's layout, quantized as loading quantizes it (a Linear
    weight per output channel, routed experts per expert and output channel), placed."""
    if is_quantized_experts(field, scheme):
        return place_quantized(
            quantized_experts(array, scheme.weight_format), path, placement, act_quant=False
        )
    sizes = dim_sizes(config)
    w = quantize(
        to_out_in(array, len(field.hf_shape[1])),
        scheme.weight_format,
        tuple(sizes[d] for d in field.hf_shape[1]),
        tuple(sizes[d] for d in field.hf_shape[0]),
    )
    return place_quantized(w, path, placement, scheme.act_quant)
