"""The model's weights on the device(s), as the engine configuration asks: random (``dummy``)
or read from the checkpoint, quantized or not, placed for tensor parallelism (on one device,
unquantized, with the projections that share an input fused); and the per-layer scales of an
fp8 KV cache."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.kv_scales import kv_scales_for
from jaxserve.models.llama import Weights, fuse_projections
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.models.weights import Placement, dummy_weights, load_weights

_LOG = logging.getLogger(__name__)


def model_weights(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: jnp.dtype,
    placement: Placement | None,
    quant: QuantScheme | None,
) -> tuple[Weights, float]:
    """(the weights, seconds it took to make or load them and place them)."""
    start = time.perf_counter()
    if config.load_format == "dummy":
        weights = dummy_weights(
            model_config, dtype, seed=config.seed, placement=placement, scheme=quant
        )
    else:
        weights = load_weights(
            config.model_dir, model_config, dtype, placement=placement, scheme=quant
        )
    if placement is None and quant is None:  # one device, unquantized: see fuse_projections
        weights = fuse_projections(weights)
    jax.block_until_ready(weights)
    seconds = time.perf_counter() - start
    if config.load_format == "dummy":
        _LOG.info("Made random weights in %.1f s", seconds)
    return weights, seconds


def kv_cache_scales(model_config: ModelConfig, config: EngineConfig, kv_dtype: jnp.dtype) -> Any:
    """An fp8 cache's (k_scale, v_scale) per layer (the checkpoint's, else 1.0), else None."""
    return kv_scales_for(
        config.model_dir, model_config.num_layers, kv_dtype, config.load_format != "dummy"
    )
