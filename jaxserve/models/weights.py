"""Weights: a Hugging Face safetensors checkpoint (or random ``dummy`` weights) -> ``Weights``.

Tensors are read one at a time from memory-mapped safetensors files, transposed to the
model's einsum layout, cast and placed on the device (or straight into their shards when a
``placement`` function gives a sharding), so peak host memory is about one tensor. Loading logs
one line at the end, and a line at every tenth of the bytes for a checkpoint of 1 GiB or more.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve.config import ModelConfig
from jaxserve.models.families import (
    HF_LAYER_PREFIX,
    WeightField,
    dim_sizes,
    layer_fields,
    model_fields,
    num_params,
)
from jaxserve.models.llama import LayerWeights, Weights
from jaxserve.models.quant import QUANTIZED_FIELDS, QArray, quantize, to_out_in
from jaxserve.models.quant_checkpoint import read_fp8, read_qarray, tensor_shapes
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.models.quant_scheme import weight_bytes as quantized_weight_bytes

_LOG = logging.getLogger(__name__)
GiB = 1024**3

# (field path in Weights, e.g. ("layers", 3, "wq")) -> a sharding for it, or None (default device)
Placement = Callable[[tuple[Any, ...], tuple[int, ...]], jax.sharding.Sharding | None]


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the file and the tensor."""


def field_dtype(field: WeightField, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a field is kept in: the weights' ``dtype``, or float32 where the table says."""
    return jnp.dtype(jnp.float32) if field.is_float32 else jnp.dtype(dtype)


def is_quantized(field: WeightField, scheme: QuantScheme | None) -> bool:
    return scheme is not None and field.name in QUANTIZED_FIELDS


def expected_shapes(
    config: ModelConfig, scheme: QuantScheme | None = None
) -> dict[str, tuple[int, ...] | None]:
    """HF tensor name -> shape in the checkpoint, for every tensor the model needs (None: a
    quantized checkpoint's scale, whose published shapes vary; checked where it is read)."""
    shapes: dict[str, tuple[int, ...] | None] = {
        field.hf_name: field.checkpoint_shape_for(config) for field in model_fields(config)
    }
    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config, layer):
            if scheme is not None and scheme.from_checkpoint and is_quantized(field, scheme):
                for name, shape in tensor_shapes(field, config, scheme).items():
                    shapes[prefix + name] = shape
            else:
                for name in field.hf_names(config, prefix):
                    shapes[name] = field.checkpoint_shape_for(config)
    return shapes


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it (index file or a directory scan)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"{model_dir}: no *.safetensors files (only safetensors checkpoints are loaded; "
            "use --load-format dummy for random weights)"
        )
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def format_bytes(num_bytes: int) -> str:
    """``8.4 MiB``, ``14.96 GiB``."""
    if num_bytes >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 1024**2:.1f} MiB"


class LoadProgress:
    """Counts the bytes read from a checkpoint's shards and logs how far loading has got."""

    def __init__(self, shards: list[Path], log_every_tenth_above_bytes: int) -> None:
        self.shards = shards  # in the order of their names (model-00001-of-00004, ...)
        self.total_bytes = sum(shard.stat().st_size for shard in shards if shard.is_file())
        self.log_every_tenth = self.total_bytes >= log_every_tenth_above_bytes
        self.num_bytes = 0
        self.tenths_logged = 0
        self.start = time.perf_counter()

    def add(self, shard: Path, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        if not self.log_every_tenth or not self.total_bytes:
            return
        tenths = min(10, self.num_bytes * 10 // self.total_bytes)
        if tenths > self.tenths_logged:
            self.tenths_logged = tenths
            _LOG.info(
                "Loading weights: %d%% (%s of %s), shard %d of %d, at %.1f s",
                tenths * 10,
                format_bytes(self.num_bytes),
                format_bytes(self.total_bytes),
                self.shards.index(shard) + 1,
                len(self.shards),
                time.perf_counter() - self.start,
            )

    def finish(self) -> None:
        num_shards = len(self.shards)
        _LOG.info(
            "Loaded weights: %s from %d shard%s in %.1f s",
            format_bytes(self.num_bytes),
            num_shards,
            "" if num_shards == 1 else "s",
            time.perf_counter() - self.start,
        )


def _place(
    array: np.ndarray, dtype: jnp.dtype, path: tuple[Any, ...], placement: Placement | None
) -> jax.Array:
    array = array.astype(dtype, copy=False)
    sharding = placement(path, array.shape) if placement is not None else None
    if sharding is None:
        return jax.device_put(array)
    # Each device receives only its own slice of the host tensor.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _place_quantized(
    w: QArray, path: tuple[Any, ...], placement: Placement | None, act_quant: bool
) -> QArray:
    """A QArray's parts (numpy or device arrays) placed as its weight's path + part name says;
    they keep their dtypes (the values quantized, the scales f32)."""
    parts: dict[str, Any] = {}
    for name in ("q", "scale", "zero", "g_idx"):
        part = getattr(w, name)
        if part is None:
            continue
        if isinstance(part, jax.Array):  # made on the device (dummy weights)
            sharding = placement((*path, name), part.shape) if placement is not None else None
            parts[name] = part if sharding is None else jax.device_put(part, sharding)
        else:
            parts[name] = _place(np.asarray(part), part.dtype, (*path, name), placement)
    return QArray(**parts, in_shape=w.in_shape, out_shape=w.out_shape, act_quant=act_quant)


# Checkpoint tensors read elsewhere or safely left: rotary tables the model computes, the
# fp8 KV cache's scales (kv_scales.py) and fp8 checkpoints' static activation scales (unread,
# docs/quantization.md).
_UNREAD_OK = (
    "rotary_emb.inv_freq",
    "k_scale",
    "v_scale",
    "kv_scale",
    "input_scale",
    "output_scale",
)


def _warn_unread(model_dir: Path, model_type: str, unread: list[str]) -> None:
    """Log the checkpoint tensors the model does not read: a bias or norm the family table
    does not know would otherwise be dropped without a word."""
    unread = [name for name in unread if not name.endswith(_UNREAD_OK)]
    if unread:
        shown = ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else "")
        _LOG.warning(
            "%s: %d checkpoint tensor(s) are not in the %s weight table and are not read: %s; "
            "if the model needs them its outputs will be wrong",
            model_dir,
            len(unread),
            model_type,
            shown,
        )


def load_weights(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    placement: Placement | None = None,
    progress_above_bytes: int = GiB,
    scheme: QuantScheme | None = None,
) -> Weights:
    """Stream a safetensors checkpoint into ``Weights`` (missing or misshapen tensors raise).

    With a ``scheme`` the Linear weights become ``QArray``s: read as the checkpoint stores
    them, or quantized here one tensor at a time (``--quantization fp8 | int8``).
    A checkpoint of ``progress_above_bytes`` or more logs its progress at every tenth."""
    model_dir = Path(model_dir)
    files = _tensor_files(model_dir)
    progress = LoadProgress(sorted(set(files.values())), progress_above_bytes)
    shapes = expected_shapes(config, scheme)
    missing = [name for name in shapes if name not in files]
    if missing:
        first = missing[0]
        shape = shapes[first]
        expected = f" (expected shape {list(shape)})" if shape is not None else ""
        raise WeightsError(
            f"{model_dir}: tensor {first!r}{expected} is missing "
            f"from the checkpoint ({len(missing)} missing in all)"
        )
    _warn_unread(model_dir, config.model_type, sorted(set(files) - set(shapes)))
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> np.ndarray:
            file = files[name]
            if file not in handles:
                if not file.is_file():
                    raise WeightsError(f"{file}: file named by the index for {name!r} not found")
                handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
            if handles[file].get_slice(name).get_dtype() == "F8_E4M3":
                tensor = read_fp8(file, name)
            else:
                tensor = handles[file].get_tensor(name)
            expected = shapes[name]
            if expected is not None and tuple(tensor.shape) != expected:
                raise WeightsError(
                    f"{file.name}: tensor {name!r} has shape {list(tensor.shape)}, "
                    f"expected {list(expected)} from config.json"
                )
            progress.add(file, tensor.nbytes)
            return tensor

        def read_field(field: WeightField, prefix: str) -> np.ndarray:
            """One tensor in the field's layout; a per-expert field stacks its experts."""
            parts = [field.from_hf(read(name), config) for name in field.hf_names(config, prefix)]
            return parts[0] if not field.per_expert else np.stack(parts)

        def load_field(prefix: str, field: WeightField, path: tuple[Any, ...]) -> Any:
            if not is_quantized(field, scheme):
                return _place(read_field(field, prefix), field_dtype(field, dtype), path, placement)
            assert scheme is not None
            if scheme.from_checkpoint:
                try:
                    w = read_qarray(read, prefix, field, config, scheme)
                except ValueError as exc:
                    raise WeightsError(f"{model_dir}: {exc}") from exc
            else:  # on the device (op by op): numpy's fp8 casts are slow on an 8B model
                sizes = dim_sizes(config)
                w = quantize(
                    jnp.asarray(read(prefix + field.hf_name)[field.part_rows(config)]),
                    scheme.weight_format,
                    tuple(sizes[d] for d in field.hf_shape[1]),
                    tuple(sizes[d] for d in field.hf_shape[0]),
                )
            return _place_quantized(w, path, placement, scheme.act_quant)

        layers = []
        for layer in range(config.num_layers):
            prefix = HF_LAYER_PREFIX.format(layer=layer)
            values = {
                field.name: load_field(prefix, field, ("layers", layer, field.name))
                for field in layer_fields(config, layer)
            }
            layers.append(LayerWeights(**values))
        outside: dict[str, Any] = {
            field.name: _place(
                field.from_hf(read(field.hf_name), config), dtype, (field.name,), placement
            )
            for field in model_fields(config)
        }
    progress.finish()
    return Weights(layers=layers, **outside)


def dummy_weights(
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    seed: int = 0,
    placement: Placement | None = None,
    scale: float = 0.02,
    scheme: QuantScheme | None = None,
) -> Weights:
    """Random weights in the real architecture (for benchmarks and tests); made on the device.

    With a quantize-on-load ``scheme`` the Linear weights are the same random weights (the
    same seed gives the same bf16 values), quantized."""
    key = jax.random.key(seed)
    if scheme is not None and scheme.from_checkpoint:
        raise ValueError(f"dummy weights cannot be made for a {scheme.method} checkpoint")

    def make(path: tuple[Any, ...], field: WeightField) -> Any:
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
            sizes = dim_sizes(config)
            num_in_axes = len(field.hf_shape[1])
            w = quantize(
                to_out_in(array, num_in_axes),
                scheme.weight_format,
                tuple(sizes[d] for d in field.hf_shape[1]),
                tuple(sizes[d] for d in field.hf_shape[0]),
            )
            del array
            return _place_quantized(w, path, placement, scheme.act_quant)
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


def weight_bytes(config: ModelConfig, dtype: jnp.dtype, scheme: QuantScheme | None = None) -> int:
    """Bytes the weights occupy on the device (quantized Linear weights at their own size)."""
    if scheme is not None:
        return quantized_weight_bytes(config, jnp.dtype(dtype).itemsize, scheme)
    return num_params(config) * jnp.dtype(dtype).itemsize
