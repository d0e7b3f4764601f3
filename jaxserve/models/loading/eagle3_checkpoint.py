"""An EAGLE-3 head's directory (config.json and safetensors) -> ``Eagle3Config``, ``Eagle3Weights``.

The tensors are named as SpecForge and the EAGLE repository save them: ``fc.weight``,
``midlayer.*`` (the one decoder layer: ``input_layernorm``, ``hidden_norm``,
``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``),
``norm.weight``, ``lm_head.weight``, ``d2t`` (draft id -> target id offset) and ``t2d`` (not
needed to draft); ``layers.0.`` for ``midlayer.`` and a ``model.`` prefix are read too. A head
without ``embed_tokens.weight`` uses the target's embedding, as vLLM does. A head is small
(one layer, a draft vocabulary's lm_head): its tensors are read whole to the host, converted to
the model's layout and dtype there and sent to the default device, or under tensor parallelism
straight into the shardings the runner gives (``sharding.eagle3_shardings``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ConfigError, ModelConfig, read_config_json
from jaxserve.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Config, Eagle3Weights
from jaxserve.models.families.registry import model_config_from_dict
from jaxserve.models.layers import LayerWeights
from jaxserve.models.loading.checkpoint_loader import tensor_files
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError
from jaxserve.models.quant import quantize, to_out_in

_LAYER = "midlayer."


def read_eagle3_config(model_dir: str | os.PathLike[str]) -> Eagle3Config:
    """A head directory's config.json (a ``ConfigError`` naming the file and the field)."""
    path = Path(model_dir) / "config.json"
    raw = read_config_json(path)
    architectures = raw.get("architectures") or []
    if not set(architectures) & set(EAGLE3_ARCHITECTURES):
        raise ConfigError(
            f"{path}: architectures={architectures} names no EAGLE-3 head "
            f"({', '.join(EAGLE3_ARCHITECTURES)})"
        )
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    try:
        # The layer is read by its model_type's family (llama); the architecture is the head's.
        layer = model_config_from_dict({k: v for k, v in raw.items() if k != "architectures"})
        return Eagle3Config(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> its shape in the checkpoint (Hugging Face's [out, in] Linear layout)."""
    lc = config.layer
    h, q, kv = lc.hidden_size, lc.q_size, lc.kv_size
    shapes = {
        "fc.weight": (h, 3 * config.target_hidden_size),
        _LAYER + "input_layernorm.weight": (h,),
        _LAYER + "hidden_norm.weight": (h,),
        _LAYER + "post_attention_layernorm.weight": (h,),
        _LAYER + "self_attn.q_proj.weight": (q, 2 * h),
        _LAYER + "self_attn.k_proj.weight": (kv, 2 * h),
        _LAYER + "self_attn.v_proj.weight": (kv, 2 * h),
        _LAYER + "self_attn.o_proj.weight": (h, q),
        _LAYER + "mlp.gate_proj.weight": (lc.intermediate_size, h),
        _LAYER + "mlp.up_proj.weight": (lc.intermediate_size, h),
        _LAYER + "mlp.down_proj.weight": (h, lc.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if lc.attention_bias:
        for name, size in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{_LAYER}self_attn.{name}_proj.bias"] = (size,)
    return shapes


def _canonical(name: str) -> str:
    """A stored name as this module spells it (no ``model.``, ``midlayer.`` for layer 0)."""
    name = name.removeprefix("model.")
    return _LAYER + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_eagle3_tensors(
    model_dir: Path, config: Eagle3Config
) -> dict[str, np.ndarray]:  # canonical name -> host array
    """Every tensor the head needs, shapes checked (errors name the tensor and both shapes)."""
    stored = tensor_files(model_dir)
    files = {_canonical(name): path for name, path in stored.items()}
    stored_names = {_canonical(name): name for name in stored}
    shapes = expected_shapes(config)
    if config.draft_vocab_size != config.vocab_size:
        shapes["d2t"] = (config.draft_vocab_size,)
    for name, shape in shapes.items():
        if name not in files:
            why = " (a draft vocabulary smaller than the target's needs the map)" * (name == "d2t")
            raise WeightsError(
                f"{model_dir}: EAGLE-3 head tensor {name!r} {list(shape)} missing{why}"
            )
    optional: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, config.hidden_size)
    }
    if config.draft_vocab_size == config.vocab_size:
        optional["d2t"] = (config.draft_vocab_size,)
    wanted = shapes | {name: shape for name, shape in optional.items() if name in files}
    with CheckpointReader(files, stored_names=stored_names) as reader:
        tensors = {name: reader.read_to_host(name) for name in wanted}
    for name, shape in wanted.items():
        if tuple(tensors[name].shape) != shape:
            raise WeightsError(
                f"{model_dir}: EAGLE-3 head tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"expected {list(shape)} (hidden_size={config.hidden_size}, "
                f"target_hidden_size={config.target_hidden_size}, "
                f"draft_vocab_size={config.draft_vocab_size})"
            )
    return tensors


def _draft_to_target(tensors: dict[str, np.ndarray], config: Eagle3Config) -> np.ndarray:
    """i32[W]: each draft id's target id, checked to lie in the target's vocabulary."""
    ids = np.arange(config.draft_vocab_size, dtype=np.int64)
    if "d2t" in tensors:
        ids = ids + tensors["d2t"].astype(np.int64)
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise WeightsError(
            f"EAGLE-3 head: d2t maps draft ids to [{ids.min()}, {ids.max()}], outside the "
            f"target's vocab_size={config.vocab_size}"
        )
    return ids.astype(np.int32)


def load_eagle3(
    model_dir: str | os.PathLike[str],
    target: ModelConfig,
    target_embed: jax.Array | None = None,  # [V, H]  the target's, for a head without one
    dtype: jnp.dtype = jnp.bfloat16,
    shardings: Eagle3Weights | None = None,  # a sharding per field; None: the default device
) -> tuple[Eagle3Config, Eagle3Weights]:
    """A head directory for ``target``: config checked against it, then every tensor, each
    put on the device(s) once, in its sharding."""
    model_dir = Path(model_dir)
    config = read_eagle3_config(model_dir)
    config.check_target(target)
    tensors = read_eagle3_tensors(model_dir, config)
    embed: Any
    if "embed_tokens.weight" in tensors:
        embed = np.asarray(tensors["embed_tokens.weight"], dtype)
    elif target_embed is None or target_embed.shape != (config.vocab_size, config.hidden_size):
        got = None if target_embed is None else list(target_embed.shape)
        raise WeightsError(
            f"{model_dir}: the head has no embed_tokens.weight and the target's embedding "
            f"({got}) is not [{config.vocab_size}, {config.hidden_size}] (hidden_size="
            f"{config.hidden_size}, the target's embedding width)"
        )
    else:
        embed = target_embed.astype(dtype)  # kept where it is (a shared one: its sharding)
    return config, jax.device_put(_weights_of(tensors, config, embed, dtype), shardings)


def _weights_of(
    tensors: dict[str, np.ndarray], config: Eagle3Config, embed: Any, dtype: Any
) -> Eagle3Weights:
    """The head's arrays on the host (the embedding as given), in the model's layout."""
    lc = config.layer
    n, k, d = lc.num_q_heads, lc.num_kv_heads, lc.head_dim

    def host(array: np.ndarray) -> Any:  # in ``dtype``, typed as the field it fills
        return np.asarray(array, dtype)

    def dev(name: str, *shape: int) -> Any:  # [out, in] -> [in, *shape], the einsum's
        array = tensors[_LAYER + name]
        return host(np.ascontiguousarray(array.T).reshape(-1, *shape))

    def vec(name: str, *shape: int) -> Any:
        return host(tensors[name].reshape(shape))

    d2t: Any = _draft_to_target(tensors, config)  # i32[W], on the host until placed
    bias = lc.attention_bias
    layer = LayerWeights(
        attn_norm=vec(_LAYER + "input_layernorm.weight", lc.hidden_size),
        wq=dev("self_attn.q_proj.weight", n, d),
        wk=dev("self_attn.k_proj.weight", k, d),
        wv=dev("self_attn.v_proj.weight", k, d),
        wo=dev("self_attn.o_proj.weight", lc.hidden_size).reshape(n, d, lc.hidden_size),
        mlp_norm=vec(_LAYER + "post_attention_layernorm.weight", lc.hidden_size),
        w_gate=dev("mlp.gate_proj.weight", lc.intermediate_size),
        w_up=dev("mlp.up_proj.weight", lc.intermediate_size),
        w_down=dev("mlp.down_proj.weight", lc.hidden_size),
        bq=vec(_LAYER + "self_attn.q_proj.bias", n, d) if bias else None,
        bk=vec(_LAYER + "self_attn.k_proj.bias", k, d) if bias else None,
        bv=vec(_LAYER + "self_attn.v_proj.bias", k, d) if bias else None,
    )
    return Eagle3Weights(
        embed=embed,
        fc=host(np.ascontiguousarray(tensors["fc.weight"].T)),
        hidden_norm=vec(_LAYER + "hidden_norm.weight", lc.hidden_size),
        layer=layer,
        final_norm=vec("norm.weight", lc.hidden_size),
        lm_head=host(np.ascontiguousarray(tensors["lm_head.weight"].T)),
        draft_to_target=d2t,
    )


def check_head_quantization(quantization: str | None, tensor_parallel_size: int) -> None:
    """A head is quantized on one device only (``quantized_head``; a split head's shardings are
    for its unquantized arrays): under tensor parallelism, a ValueError naming both."""
    if quantization is not None and tensor_parallel_size > 1:
        raise ValueError(
            f"speculative_config quantization={quantization!r}: an EAGLE-3 head is quantized "
            f"on one device only, and this target is split over {tensor_parallel_size} "
            "devices; leave quantization out (the head in the serving dtype)"
        )


def quantized_head(head: Eagle3Weights, weight_format: str, act_quant: bool) -> Eagle3Weights:
    """The head with its Linear weights quantized per output channel, as ``--quantization``
    quantizes a bf16 target while it loads (``speculative_config`` ``quantization``): the
    layer's projections, ``fc`` and ``lm_head`` (the largest weight a chained draft step reads);
    the norms, the embedding and the id map as they are. On one device (the arrays are
    quantized where they are; a tensor-parallel head is refused before, ``load_head``)."""

    def q(w: Any, num_in: int = 1) -> Any:  # [*in, *out] -> its QArray
        shape = tuple(w.shape)
        return quantize(
            to_out_in(w, num_in), weight_format, shape[:num_in], shape[num_in:], act_quant
        )

    lw = head.layer
    layer = dataclasses.replace(
        lw,
        wq=q(lw.wq),
        wk=q(lw.wk),
        wv=q(lw.wv),
        wo=q(lw.wo, 2),
        w_gate=q(lw.w_gate),
        w_up=q(lw.w_up),
        w_down=q(lw.w_down),
    )
    return dataclasses.replace(head, fc=q(head.fc), lm_head=q(head.lm_head), layer=layer)
