"""New weights for a running model: a pytree laid out as the served ``Weights``, checked leaf by
leaf against them before anything changes, then brought to their dtype and sharding on the
device. Weights named as Hugging Face or a flax.nnx model names them (``LAYOUTS``) are checked
name by name, then made into that layout on the device (``models/loading/named_weights.py``).

The compiled programs take the weights as an argument, so new weights of the same shapes,
dtypes and shardings run in the same executables: nothing compiles. A leaf that already has
the served dtype and sharding is used as it is (no copy); another is cast and placed on the
device. ``ModelRunner.update_weights`` and ``load_weights_from`` call this; the engine swaps
them in between steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.layers import Weights
from jaxserve.models.loading.field_conversion import Placement
from jaxserve.models.loading.named_weights import hf_problems, read_nnx, weights_from_hf
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner import model_weights

# How new weights may be laid out (docs/training.md): "engine" as ``LLM.weights`` (served
# without a copy where dtype and sharding match), "hf" Hugging Face's names and layout
# (``{"model.layers.0.self_attn.q_proj.weight": [out, in], ...}``), "nnx" a flax.nnx model's
# state in the layout of ``named_weights``; "auto" tells them apart (``weights_layout``).
LAYOUTS = ("auto", "engine", "hf", "nnx")


class WeightsUpdateError(ValueError):
    """New weights that do not fit the served model, named leaf by leaf; nothing changed."""


def checked_weights(served: Weights, new: Any) -> Weights:
    """``new`` as the model serves it: each leaf cast to the served leaf's dtype and placed in
    its sharding. ``WeightsUpdateError`` names every leaf missing, extra or of another shape
    (paths as ``jax.tree_util.keystr`` writes them: ``.layers[0].wq``)."""
    served_leaves, treedef = jax.tree_util.tree_flatten_with_path(served)
    new_leaves = jax.tree_util.tree_flatten_with_path(new)[0]  # anything else: one leaf
    served_by_path = {jax.tree_util.keystr(path): leaf for path, leaf in served_leaves}
    new_by_path = {jax.tree_util.keystr(path): leaf for path, leaf in new_leaves}
    # The surprising first: a leaf at no weight's path, then shapes, then what is missing.
    problems = [
        f"{path or 'the whole tree'}: not a weight of this model"
        for path in new_by_path
        if path not in served_by_path
    ]
    for path, leaf in new_by_path.items():
        old = served_by_path.get(path)
        if old is not None and tuple(jnp.shape(leaf)) != tuple(old.shape):
            problems.append(f"{path}: shape {tuple(jnp.shape(leaf))}, the model's is {old.shape}")
    problems += [f"{path}: missing" for path in served_by_path if path not in new_by_path]
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise WeightsUpdateError(f"{len(problems)} weights do not fit the model: {shown}")
    leaves = [
        _as_served(new_by_path[jax.tree_util.keystr(path)], old) for path, old in served_leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_served(new: Any, old: Any) -> jax.Array:
    """``new`` with ``old``'s dtype and sharding; ``new`` itself when it has both (``committed``
    then commits it, without a copy)."""
    if isinstance(new, jax.Array) and new.dtype == old.dtype and new.sharding == old.sharding:
        return new
    return jax.device_put(jnp.asarray(new).astype(old.dtype), old.sharding)


def committed(weights: Any) -> Any:
    """``weights`` with every array committed to its sharding's device(s): the same buffers,
    no copy. One device's weights load uncommitted, and a jitted program compiles again when
    an argument's commitment changes, so the served weights are always committed, wherever
    they came from (a load, a trainer's arrays, a wake from pinned host memory, which can only
    come back committed). Shapes (``jax.ShapeDtypeStruct``) pass through."""

    def commit(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.committed:
            return jax.device_put(leaf, leaf.sharding)
        return leaf

    return jax.tree.map(commit, weights)


def weights_layout(new: Any, layout: str = "auto") -> str:
    """The layout of ``new``: ``layout`` itself unless "auto". A flax ``State`` (or a dict with
    an ``embedder``, as ``nnx.to_pure_dict`` writes it) is "nnx"; a flat dict of dotted names
    is "hf"; anything else "engine"."""
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {', '.join(LAYOUTS)}")
    if layout != "auto":
        return layout
    if type(new).__module__.startswith("flax.") or (isinstance(new, Mapping) and "embedder" in new):
        return "nnx"
    if (
        isinstance(new, Mapping)
        and new
        and all(isinstance(key, str) and "." in key for key in new)
        and not any(isinstance(value, Mapping) for value in new.values())
    ):
        return "hf"
    return "engine"


def weights_from_named(
    new: Any,
    layout: str,
    config: ModelConfig,
    dtype: Any,
    placement: Placement | None,
    quant: QuantScheme | None,
) -> Weights:
    """``new``, named as ``layout`` ("hf" or "nnx") says, as the runner serves weights (fused,
    quantized, placed as at load), made on the device. ``WeightsUpdateError`` names every
    name missing, unknown or of another shape before anything is made."""
    if layout == "nnx":
        read = read_nnx(new)
        problems = [f"{path}: not a parameter of the nnx layout" for path in read.unknown]
        problems += hf_problems(read.shapes(), config, quant, as_nnx=True)
    elif isinstance(new, Mapping):
        problems = hf_problems({k: tuple(jnp.shape(v)) for k, v in new.items()}, config, quant)
    else:
        problems = [f"Hugging Face names need a dict of name -> array, not {type(new).__name__}"]
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise WeightsUpdateError(f"{len(problems)} weights do not fit the model: {shown}")
    # The kernels of an nnx state transposed only once nothing is wrong.
    tensors = read_nnx(new).tensors() if layout == "nnx" else new
    weights = weights_from_hf(tensors, config, dtype, placement, quant)
    return model_weights.as_served(weights, placement is None)
