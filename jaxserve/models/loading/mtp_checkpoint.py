"""A DeepSeek-V3 checkpoint's MTP layers -> ``MtpWeights`` (``models/mtp.py``), read only when
asked (speculative decoding's ``mtp`` method); the target's loader leaves their tensors.

config.json's ``num_nextn_predict_layers`` = n layers are stored after the model's L at
``model.layers.{L + i}.``: ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight`` [H, 2H], the
decoder layer's tensors named as the target's layers name them (the family's weight table:
``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``),
``shared_head.norm.weight`` and ``shared_head.head.weight`` [V, H] (absent: the target's
``lm_head``). ``embed_tokens.weight`` there is the target's embedding again and is not read.
The layers are small next to the model: their tensors are read whole to the host and converted
on the default device as the target loader converts its fields, each then placed in the sharding
the runner gives under tensor parallelism (``sharding.mtp_shardings``; the shared embedding and
lm_head are the target's arrays, as sharded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ConfigError, ModelConfig, read_config_json
from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.families.registry import layer_fields
from jaxserve.models.layers import LayerWeights, Weights
from jaxserve.models.loading.checkpoint_loader import field_from_tensors, tensor_files
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError
from jaxserve.models.loading.field_conversion import Placement
from jaxserve.models.mtp import MtpWeights

MTP_FIELD = "num_nextn_predict_layers"


def num_mtp_layers(model_dir: str | os.PathLike[str]) -> int:
    """config.json's ``num_nextn_predict_layers`` (0 when absent)."""
    path = Path(model_dir) / "config.json"
    value = read_config_json(path).get(MTP_FIELD) or 0
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path}: {MTP_FIELD}={value!r} must be an integer >= 0")
    return value


def require_mtp_layers(model_dir: str | os.PathLike[str]) -> int:
    """``num_mtp_layers``, a ``ConfigError`` naming the field when it is 0 or absent."""
    count = num_mtp_layers(model_dir)
    path = Path(model_dir) / "config.json"
    if read_config_json(path).get("quantization_config"):
        raise ConfigError(
            f"{path}: speculative_config method='mtp' with a quantized checkpoint is not "
            "supported: its MTP layers' tensors would be read without their scales"
        )
    if count == 0:
        raise ConfigError(
            f"{Path(model_dir) / 'config.json'}: {MTP_FIELD} is 0 or absent: the model has no "
            "MTP layers for speculative_config method='mtp' (DeepSeek-V3 checkpoints have 1)"
        )
    return count


def mtp_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> checkpoint shape of MTP layer ``index`` (0-based), head excluded."""
    layer = config.num_layers + index
    prefix = HF_LAYER_PREFIX.format(layer=layer)
    h = config.hidden_size
    shapes = {
        prefix + "enorm.weight": (h,),
        prefix + "hnorm.weight": (h,),
        prefix + "eh_proj.weight": (h, 2 * h),
        prefix + "shared_head.norm.weight": (h,),
    }
    for field in layer_fields(config, layer):
        for name in field.hf_names(config, prefix):
            shapes[name] = field.checkpoint_shape_for(config)
    return shapes


def _read(
    model_dir: Path, files: dict[str, Path], shapes: dict[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    for name, shape in shapes.items():
        if name not in files:
            raise WeightsError(
                f"{model_dir}: MTP tensor {name!r} {list(shape)} is missing ({MTP_FIELD} "
                "names more layers than the checkpoint stores)"
            )
    with CheckpointReader({n: files[n] for n in shapes}) as reader:
        tensors = {name: reader.read_to_host(name) for name in shapes}
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise WeightsError(
                f"{model_dir}: MTP tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"expected {list(shape)} from config.json"
            )
    return tensors


def load_mtp(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    target: Weights,  # the target's embedding, and its lm_head for a layer without a head
    dtype: Any = jnp.bfloat16,
    shardings: list[MtpWeights] | None = None,  # a sharding per field, layer for layer
) -> list[MtpWeights]:
    """Every MTP layer of the checkpoint (``ConfigError`` naming ``num_nextn_predict_layers``
    when it has none), on the default device, or each field in its sharding."""
    model_dir = Path(model_dir)
    count = require_mtp_layers(model_dir)
    files = tensor_files(model_dir)
    placed: list[MtpWeights | None] = list(shardings) if shardings is not None else [None] * count
    return [_layer(model_dir, files, config, target, dtype, i, placed[i]) for i in range(count)]


def _layer_placement(shardings: LayerWeights) -> Placement:
    """A field's path (``("mtp", index, name)``) -> its sharding in the layer's shardings."""

    def place(path: tuple[Any, ...], shape: tuple[int, ...]) -> Any:
        return getattr(shardings, path[-1])

    return place


def _layer(
    model_dir: Path,
    files: dict[str, Path],
    config: ModelConfig,
    target: Weights,
    dtype: Any,
    index: int,
    shardings: MtpWeights | None,
) -> MtpWeights:
    layer = config.num_layers + index
    prefix = HF_LAYER_PREFIX.format(layer=layer)
    head_name = prefix + "shared_head.head.weight"
    shapes = mtp_shapes(config, index)
    if head_name in files:
        shapes[head_name] = (config.vocab_size, config.hidden_size)
    tensors = _read(model_dir, files, shapes)
    placement = None if shardings is None else _layer_placement(shardings.layer)
    fields = {
        field.name: field_from_tensors(
            [tensors[n] for n in field.hf_names(config, prefix)],
            ("mtp", index, field.name),
            field,
            config,
            dtype,
            placement,
        )
        for field in layer_fields(config, layer)
    }

    def vec(name: str) -> Any:  # on the host until placed
        return np.asarray(tensors[prefix + name], dtype)

    def linear_t(name: str) -> Any:  # [out, in] -> [in, out], on the host until placed
        return np.asarray(np.ascontiguousarray(tensors[name].T), dtype)

    # The target's arrays are kept where they are (a shared one: its sharding).
    if head_name in tensors:
        lm_head = linear_t(head_name)
    elif target.lm_head is not None:
        lm_head = target.lm_head.astype(dtype)
    else:
        lm_head = target.embed.astype(dtype).T
    extras = {
        "embed": target.embed.astype(dtype),
        "enorm": vec("enorm.weight"),
        "hnorm": vec("hnorm.weight"),
        "eh_proj": linear_t(prefix + "eh_proj.weight"),
        "head_norm": vec("shared_head.norm.weight"),
        "lm_head": lm_head,
    }
    placed = jax.device_put(
        extras, None if shardings is None else {n: getattr(shardings, n) for n in extras}
    )
    return MtpWeights(layer=LayerWeights(**fields), **placed)
