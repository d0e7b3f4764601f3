"""Weights: a Hugging Face safetensors checkpoint (or random ``dummy`` weights) -> ``Weights``.

Tensors are read one at a time from memory-mapped safetensors files, transposed to the
model's einsum layout, cast and placed on the device (or straight into their shards when a
``placement`` function gives a sharding), so peak host memory is about one tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
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

# (field path in Weights, e.g. ("layers", 3, "wq")) -> a sharding for it, or None (default device)
Placement = Callable[[tuple[Any, ...], tuple[int, ...]], jax.sharding.Sharding | None]


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the file and the tensor."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape in the checkpoint, for every tensor the model needs."""
    shapes = {field.hf_name: field.checkpoint_shape_for(config) for field in model_fields(config)}
    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config):
            shapes[prefix + field.hf_name] = field.checkpoint_shape_for(config)
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
    progress: Callable[[Iterator[int]], Iterator[int]] | None = None,
) -> Weights:
    """Stream a safetensors checkpoint into ``Weights`` (missing or misshapen tensors raise)."""
    model_dir = Path(model_dir)
    files = _tensor_files(model_dir)
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
            return tensor

        layer_iter: Iterator[int] = iter(range(config.num_layers))
        if progress is not None:
            layer_iter = progress(layer_iter)
        layers = []
        for layer in layer_iter:
            prefix = HF_LAYER_PREFIX.format(layer=layer)
            values = {
                field.name: _place(
                    field.from_hf(read(prefix + field.hf_name), config),
                    dtype,
                    ("layers", layer, field.name),
                    placement,
                )
                for field in layer_fields(config)
            }
            layers.append(LayerWeights(**values))
        outside: dict[str, Any] = {
            field.name: _place(
                field.from_hf(read(field.hf_name), config), dtype, (field.name,), placement
            )
            for field in model_fields(config)
        }
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
        LayerWeights(**{f.name: make(("layers", layer, f.name), f) for f in layer_fields(config)})
        for layer in range(config.num_layers)
    ]
    outside: dict[str, Any] = {f.name: make((f.name,), f) for f in model_fields(config)}
    return Weights(layers=layers, **outside)


def weight_bytes(config: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes the weights occupy on the device."""
    return num_params(config) * jnp.dtype(dtype).itemsize
