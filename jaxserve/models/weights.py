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
    layer_fields,
    model_fields,
    num_params,
)
from jaxserve.models.llama import LayerWeights, Weights

_LOG = logging.getLogger(__name__)
GiB = 1024**3

# (field path in Weights, e.g. ("layers", 3, "wq")) -> a sharding for it, or None (default device)
Placement = Callable[[tuple[Any, ...], tuple[int, ...]], jax.sharding.Sharding | None]


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the file and the tensor."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape in the checkpoint, for every tensor the model needs."""
    shapes = {field.hf_name: field.checkpoint_shape_for(config) for field in model_fields(config)}
    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config, layer):
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


def load_weights(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    placement: Placement | None = None,
    progress_above_bytes: int = GiB,
) -> Weights:
    """Stream a safetensors checkpoint into ``Weights`` (missing or misshapen tensors raise).

    A checkpoint of ``progress_above_bytes`` or more logs its progress at every tenth."""
    model_dir = Path(model_dir)
    files = _tensor_files(model_dir)
    progress = LoadProgress(sorted(set(files.values())), progress_above_bytes)
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in files]
    if missing:
        first = missing[0]
        raise WeightsError(
            f"{model_dir}: tensor {first!r} (expected shape {list(shapes[first])}) is missing "
            f"from the checkpoint ({len(missing)} missing in all)"
        )
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> np.ndarray:
            file = files[name]
            if file not in handles:
                if not file.is_file():
                    raise WeightsError(f"{file}: file named by the index for {name!r} not found")
                handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
            tensor = handles[file].get_tensor(name)
            if tuple(tensor.shape) != shapes[name]:
                raise WeightsError(
                    f"{file.name}: tensor {name!r} has shape {list(tensor.shape)}, "
                    f"expected {list(shapes[name])} from config.json"
                )
            progress.add(file, tensor.nbytes)
            return tensor

        def read_field(field: WeightField, prefix: str) -> np.ndarray:
            """One tensor in the field's layout; a per-expert field stacks its experts."""
            parts = [field.from_hf(read(name), config) for name in field.hf_names(config, prefix)]
            return parts[0] if not field.per_expert else np.stack(parts)

        layers = []
        for layer in range(config.num_layers):
            prefix = HF_LAYER_PREFIX.format(layer=layer)
            values = {
                field.name: _place(
                    read_field(field, prefix), dtype, ("layers", layer, field.name), placement
                )
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
) -> Weights:
    """Random weights in the real architecture (for benchmarks and tests); made on the device."""
    key = jax.random.key(seed)

    def make(path: tuple[Any, ...], field: WeightField) -> jax.Array:
        nonlocal key
        key, sub = jax.random.split(key)
        shape = field.shape_for(config)
        if field.init != "normal":
            array = (jnp.ones if field.init == "ones" else jnp.zeros)(shape, dtype)
        else:
            array = (scale * jax.random.normal(sub, shape, jnp.float32)).astype(dtype)
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


def weight_bytes(config: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes the weights occupy on the device."""
    return num_params(config) * jnp.dtype(dtype).itemsize
