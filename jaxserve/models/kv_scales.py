"""The scales of an fp8 KV cache: one ``k_scale`` and one ``v_scale`` per layer.

The cache stores ``x / scale`` in fp8 and attention reads ``page * scale``
(``pallas_kernels.kv_cache.quantize_kv``). A checkpoint calibrated for an fp8 cache carries the
scales as scalar tensors, under the names vLLM reads (``kv_scale``, deprecated, is both):
  model.layers.N.self_attn.{k_scale, v_scale, kv_scale}          (vLLM, llm-compressor)
  model.layers.N.self_attn.attn.{k_scale, v_scale}               (vLLM's own module path)
  model.layers.N.self_attn.{k_proj.k_scale, v_proj.v_scale}      (NVIDIA ModelOpt)
  model.layers.N.self_attn.{k_proj, v_proj}.output_scale         (compressed-tensors)
A layer without them gets 1.0, vLLM's default (no calibration pass); the runner logs how many
layers came from the checkpoint. The runner reads them once at start-up and passes them to the
model step as constants.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.loading.checkpoint_loader import tensor_files
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.loading.orbax_checkpoint import is_converted_checkpoint, read_manifest
from pallas_kernels.kv_cache import is_quantized

_LOG = logging.getLogger(__name__)
# What each fp8 --kv-cache-dtype stores (engine_config.kv_cache_dtype_name's names).
FP8_KV_DTYPES = {"fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn), "fp8_e5m2": jnp.dtype(jnp.float8_e5m2)}


def kv_dtype_label(kv_dtype) -> str:
    """``fp8_e4m3`` / ``fp8_e5m2`` (vLLM's names) or the dtype's own name (``bfloat16``)."""
    names = {v: k for k, v in FP8_KV_DTYPES.items()}
    return names.get(jnp.dtype(kv_dtype), jnp.dtype(kv_dtype).name)


# Checkpoint names after the layer prefix, in the order they are looked for.
K_SCALE_NAMES = (
    "self_attn.k_scale",
    "self_attn.attn.k_scale",
    "self_attn.k_proj.k_scale",
    "self_attn.k_proj.output_scale",
    "self_attn.kv_scale",
)
V_SCALE_NAMES = (
    "self_attn.v_scale",
    "self_attn.attn.v_scale",
    "self_attn.v_proj.v_scale",
    "self_attn.v_proj.output_scale",
    "self_attn.kv_scale",
)


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per-layer ``(k_scale, v_scale)``, and how many layers the checkpoint gave them for."""

    scales: tuple[tuple[float, float], ...]
    num_from_checkpoint: int = 0

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls(((1.0, 1.0),) * num_layers)

    def describe(self) -> str:
        """The start-up log's words for where the scales came from."""
        num_layers = len(self.scales)
        if self.num_from_checkpoint == 0:
            return (
                "scale 1.0 for every layer (the checkpoint has no k_scale / v_scale; vLLM's "
                "default: values past the fp8 range saturate)"
            )
        rest = num_layers - self.num_from_checkpoint
        if rest == 0:
            return f"k_scale / v_scale from the checkpoint for all {num_layers} layers"
        return (
            f"k_scale / v_scale from the checkpoint for {self.num_from_checkpoint} of "
            f"{num_layers} layers, 1.0 for the other {rest}"
        )


def _read_scale(file: Path, name: str) -> float:
    with safe_open(file, framework="numpy") as f:
        tensor = np.asarray(f.get_tensor(name), np.float32)
    if tensor.size != 1:
        raise WeightsError(
            f"{file.name}: KV cache scale {name!r} has shape {list(tensor.shape)}; only one "
            "scale per tensor (a scalar) is supported"
        )
    value = float(tensor.reshape(()))
    if not (math.isfinite(value) and value > 0.0):
        raise WeightsError(f"{file.name}: KV cache scale {name!r} is {value}; must be > 0")
    return value


def load_kv_scales(model_dir: str | os.PathLike[str], num_layers: int) -> KVScales:
    """Each layer's scales from the checkpoint in ``model_dir``; 1.0 where it has none (a
    converted checkpoint keeps its source's in its manifest)."""
    if is_converted_checkpoint(model_dir):
        manifest = read_manifest(model_dir)
        if manifest.kv_scales is None:
            return KVScales.ones(num_layers)
        pairs = tuple((float(k), float(v)) for k, v in manifest.kv_scales)
        return KVScales(pairs, manifest.num_kv_scales_from_checkpoint)
    files = tensor_files(Path(model_dir))
    scales = []
    num_found = 0
    for layer in range(num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        pair = []
        for names in (K_SCALE_NAMES, V_SCALE_NAMES):
            name = next((prefix + n for n in names if prefix + n in files), None)
            pair.append(1.0 if name is None else _read_scale(files[name], name))
        if any(prefix + n in files for n in K_SCALE_NAMES + V_SCALE_NAMES):
            num_found += 1
        scales.append((pair[0], pair[1]))
    return KVScales(tuple(scales), num_found)


def kv_scales_for(
    model_dir: str | os.PathLike[str], num_layers: int, kv_dtype, from_checkpoint: bool
) -> tuple[tuple[float, float], ...] | None:
    """The scales the model step takes: None for an unquantized cache; for fp8, the
    checkpoint's (``from_checkpoint``) or 1.0 (random weights), with one start-up log line."""
    if not is_quantized(kv_dtype):
        return None
    if from_checkpoint:
        scales = load_kv_scales(model_dir, num_layers)
    else:
        scales = KVScales.ones(num_layers)
    _LOG.info("KV cache dtype %s: %s", kv_dtype_label(kv_dtype), scales.describe())
    return scales.scales
