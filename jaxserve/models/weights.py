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
from jaxserve.models.llama import LayerWeights, Weights

# (field path in Weights, e.g. ("layers", 3, "wq")) -> a sharding for it, or None (default device)
Placement = Callable[[tuple[Any, ...], tuple[int, ...]], jax.sharding.Sharding | None]


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the file and the tensor."""


def _layer_fields(config: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    """LayerWeights field -> (HF tensor suffix, transform from HF layout)."""
    n, k, d, h = config.num_q_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    fields: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
        "attn_norm": ("input_layernorm.weight", lambda t: t),
        "wq": ("self_attn.q_proj.weight", lambda t: t.T.reshape(h, n, d)),
        "wk": ("self_attn.k_proj.weight", lambda t: t.T.reshape(h, k, d)),
        "wv": ("self_attn.v_proj.weight", lambda t: t.T.reshape(h, k, d)),
        "wo": ("self_attn.o_proj.weight", lambda t: t.T.reshape(n, d, h)),
        "mlp_norm": ("post_attention_layernorm.weight", lambda t: t),
        "w_gate": ("mlp.gate_proj.weight", lambda t: t.T),
        "w_up": ("mlp.up_proj.weight", lambda t: t.T),
        "w_down": ("mlp.down_proj.weight", lambda t: t.T),
    }
    if config.attention_bias:
        fields["bq"] = ("self_attn.q_proj.bias", lambda t: t.reshape(n, d))
        fields["bk"] = ("self_attn.k_proj.bias", lambda t: t.reshape(k, d))
        fields["bv"] = ("self_attn.v_proj.bias", lambda t: t.reshape(k, d))
    if config.qk_norm:
        fields["q_norm"] = ("self_attn.q_norm.weight", lambda t: t)
        fields["k_norm"] = ("self_attn.k_norm.weight", lambda t: t)
    return fields


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape in the checkpoint, for every tensor the model needs."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, d = config.q_size, config.kv_size, config.head_dim
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    needed = {suffix for suffix, _ in _layer_fields(config).values()}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config.num_layers):
        for suffix in needed:
            shapes[f"model.layers.{layer}.{suffix}"] = per_layer[suffix]
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
        fields = _layer_fields(config)
        layers = []
        for layer in layer_iter:
            values = {
                field: _place(
                    transform(read(f"model.layers.{layer}.{suffix}")),
                    dtype,
                    ("layers", layer, field),
                    placement,
                )
                for field, (suffix, transform) in fields.items()
            }
            layers.append(LayerWeights(**values))
        embed = _place(read("model.embed_tokens.weight"), dtype, ("embed",), placement)
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = _place(read("lm_head.weight").T, dtype, ("lm_head",), placement)
        final_norm = _place(read("model.norm.weight"), dtype, ("final_norm",), placement)
    return Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def dummy_weights(
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    seed: int = 0,
    placement: Placement | None = None,
    scale: float = 0.02,
) -> Weights:
    """Random weights in the real architecture (for benchmarks and tests); made on the device."""
    n, k, d, h = config.num_q_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    i, v = config.intermediate_size, config.vocab_size
    key = jax.random.key(seed)

    def make(path: tuple[Any, ...], shape: tuple[int, ...], ones: bool = False) -> jax.Array:
        nonlocal key
        key, sub = jax.random.split(key)
        if ones:
            array = jnp.ones(shape, dtype)
        else:
            array = (scale * jax.random.normal(sub, shape, jnp.float32)).astype(dtype)
        sharding = placement(path, shape) if placement is not None else None
        return array if sharding is None else jax.device_put(array, sharding)

    layers = []
    for layer in range(config.num_layers):
        shapes: dict[str, tuple[tuple[int, ...], bool]] = {
            "attn_norm": ((h,), True),
            "wq": ((h, n, d), False),
            "wk": ((h, k, d), False),
            "wv": ((h, k, d), False),
            "wo": ((n, d, h), False),
            "mlp_norm": ((h,), True),
            "w_gate": ((h, i), False),
            "w_up": ((h, i), False),
            "w_down": ((i, h), False),
        }
        if config.attention_bias:
            shapes |= {"bq": ((n, d), False), "bk": ((k, d), False), "bv": ((k, d), False)}
        if config.qk_norm:
            shapes |= {"q_norm": ((d,), True), "k_norm": ((d,), True)}
        layers.append(
            LayerWeights(
                **{f: make(("layers", layer, f), s, ones) for f, (s, ones) in shapes.items()}
            )
        )
    lm_head = None if config.tie_word_embeddings else make(("lm_head",), (h, v))
    return Weights(
        embed=make(("embed",), (v, h)),
        layers=layers,
        final_norm=make(("final_norm",), (h,), ones=True),
        lm_head=lm_head,
    )


def weight_bytes(config: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes the weights occupy on the device."""
    return config.num_params() * jnp.dtype(dtype).itemsize
