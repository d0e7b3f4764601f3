"""Weights named as Hugging Face or a flax.nnx model names them -> ``Weights``: what a trainer
in the same process hands ``LLM.update_weights`` (``runner/weight_update.py`` checks and swaps
them in).

Hugging Face names (``model.state_dict()`` / safetensors: ``{"model.layers.0.self_attn.q_proj
.weight": [out, in], ...}``) go through the same weight tables (``families/``) and the same
compiled per-field conversion (``checkpoint_loader.field_from_tensors``: slice a fused part,
transpose, reshape to the einsum layout, cast, quantize, place) as a checkpoint read from disk,
on the device where the arrays already are.

A flax.nnx model written as flax users write Llama / Qwen (jax-ml/bonsai's ``llama3_2`` layout:
``embedder.embedding``, ``layers[i].self_attn.q_proj.kernel`` [in, out],
``layers[i].input_layernorm.scale``, ``final_norm.scale``, ``lm_head.kernel``) is first renamed
to Hugging Face's names (``nnx_to_hf_names``, ``weights_from_nnx``; docs/training.md has the
table), its kernels transposed, then taken as above. ``nnx_from_hf`` is the inverse: a
checkpoint's tensors as the nested dict ``nnx.replace_by_pure_dict`` takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.families.registry import layer_fields, model_fields
from jaxserve.models.layers import LayerWeights, Weights
from jaxserve.models.loading.checkpoint_loader import (
    UNREAD_OK,
    expected_shapes,
    field_from_tensors,
    field_jobs,
)
from jaxserve.models.loading.field_conversion import Placement
from jaxserve.models.quant_scheme import QuantScheme

# The nnx layout's names outside the layers -> Hugging Face's (the parameter leaf is renamed
# below: ``kernel`` -> ``weight``, ``scale`` -> ``weight``, ``embedding`` -> ``weight``).
NNX_MODULES = {"embedder": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
NNX_LAYERS = "layers"  # layers[i] -> model.layers.{i}; the modules inside keep HF's names
# nnx parameter leaf -> (Hugging Face's leaf, whether the array is transposed: a Linear's
# kernel is [in, out], Hugging Face's weight [out, in]).
NNX_LEAVES = {
    "kernel": ("weight", True),
    "bias": ("bias", False),
    "scale": ("weight", False),
    "embedding": ("weight", False),
}


def nnx_path(path: tuple[Any, ...]) -> str:
    """A path of the nnx state as its user writes it: ``layers.0.self_attn.q_proj.kernel``."""
    return ".".join(str(key) for key in path)


def flat_nnx_state(state: Any) -> dict[tuple[Any, ...], Any]:
    """Path -> array of ``nnx.state(model)`` (or ``nnx.to_pure_dict`` of it): each
    ``Variable``'s value, without importing flax."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = tuple(_key(entry) for entry in path)
        if keys and keys[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
            keys = keys[:-1]  # a Variable's array
        flat[keys] = leaf
    return flat


def _key(entry: Any) -> Any:
    for name in ("key", "name", "idx"):
        if hasattr(entry, name):
            return getattr(entry, name)
    return str(entry)


def hf_name_of(path: tuple[Any, ...]) -> tuple[str, bool] | None:
    """(Hugging Face's name, whether transposed) of one nnx parameter; None: not in the
    layout."""
    if len(path) < 2 or path[-1] not in NNX_LEAVES:
        return None
    leaf, transposed = NNX_LEAVES[path[-1]]
    if path[0] == NNX_LAYERS and len(path) >= 4 and _is_index(path[1]):
        module = f"model.layers.{int(path[1])}." + ".".join(str(key) for key in path[2:-1])
    elif len(path) == 2 and path[0] in NNX_MODULES:
        module = NNX_MODULES[path[0]]
    else:
        return None
    name = f"{module}.{leaf}"
    # Each leaf belongs to one kind of module (a Linear's kernel, a norm's scale): a
    # ``gate_proj.scale`` is no parameter of the layout, though it renames to a weight.
    if nnx_path(nnx_path_of(name)) != nnx_path(path):
        return None
    return name, transposed


def _is_index(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def nnx_to_hf_names(state: Any) -> dict[str, str | None]:
    """What maps where: each nnx path of ``state`` -> its Hugging Face name (None: not a
    parameter of the layout)."""
    names = {}
    for path in flat_nnx_state(state):
        found = hf_name_of(path)
        names[nnx_path(path)] = found[0] if found is not None else None
    return names


@dataclasses.dataclass
class NnxAsHf:
    """An nnx state read as Hugging Face names, nothing converted yet."""

    values: dict[str, Any]  # HF name -> the nnx array, as it is
    transposed: set[str]  # the HF names whose nnx array is a kernel, [in, out]
    unknown: list[str]  # the nnx paths outside the layout

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> the shape its tensor has in Hugging Face's layout."""
        shapes = {name: tuple(jnp.shape(value)) for name, value in self.values.items()}
        return {n: s[::-1] if n in self.transposed else s for n, s in shapes.items()}

    def tensors(self) -> dict[str, Any]:
        """HF name -> the array in Hugging Face's layout (each kernel transposed on its
        device)."""
        return {
            name: jnp.transpose(value) if name in self.transposed else value
            for name, value in self.values.items()
        }


def read_nnx(state: Any) -> NnxAsHf:
    """``nnx.state(model)`` of the nnx layout, read as Hugging Face names."""
    read = NnxAsHf({}, set(), [])
    for path, value in flat_nnx_state(state).items():
        found = hf_name_of(path)
        if found is None or (found[1] and jnp.ndim(value) != 2):
            read.unknown.append(nnx_path(path))
            continue
        name, transposed = found
        read.values[name] = value
        if transposed:
            read.transposed.add(name)
    return read


def weights_from_nnx(state: Any) -> dict[str, Any]:
    """``nnx.state(model)`` of the nnx layout as Hugging Face name -> array (each kernel
    transposed to [out, in] on its device): what ``LLM.update_weights`` serves it as. A path
    outside the layout raises ``KeyError`` naming it."""
    read = read_nnx(state)
    if read.unknown:
        raise KeyError(f"not in the nnx layout (docs/training.md): {', '.join(read.unknown)}")
    return read.tensors()


def nnx_path_of(name: str) -> tuple[Any, ...]:
    """The nnx path of the parameter a Hugging Face name maps to (the inverse of
    ``hf_name_of``); ``KeyError`` naming it for a name outside the layout."""
    by_module = {hf: nnx for nnx, hf in NNX_MODULES.items()}
    module, _, leaf = name.rpartition(".")
    if module.startswith("model.layers.") and module.count(".") >= 3:
        index, _, rest = module.removeprefix("model.layers.").partition(".")
        path: tuple[Any, ...] = (NNX_LAYERS, int(index), *rest.split("."))
    elif module in by_module:
        path = (by_module[module],)
    else:
        raise KeyError(f"{name}: not in the nnx layout (docs/training.md)")
    if leaf == "bias":
        return (*path, "bias")
    if path == ("embedder",):
        return (*path, "embedding")
    if path == ("lm_head",) or str(path[-1]).endswith("_proj"):
        return (*path, "kernel")  # a Linear's
    return (*path, "scale")  # a norm's


def nnx_from_hf(tensors: Mapping[str, Any]) -> dict[Any, Any]:
    """Hugging Face name -> array, as the nested dict of the nnx layout
    (``nnx.replace_by_pure_dict(nnx.state(model), nnx_from_hf(tensors))``), kernels
    transposed: a checkpoint read into an nnx model. A name outside the layout raises
    ``KeyError`` naming it."""
    nested: dict[Any, Any] = {}
    for name, value in tensors.items():
        *modules, leaf = nnx_path_of(name)
        node = nested
        for key in modules:
            node = node.setdefault(key, {})
        node[leaf] = jnp.transpose(value) if leaf == "kernel" else value
    return nested


def hf_problems(
    shapes: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    scheme: QuantScheme | None = None,
    as_nnx: bool = False,
) -> list[str]:
    """What keeps tensors of these Hugging Face names and shapes from being this model's
    weights, each named as its user wrote it (``as_nnx``: by its nnx path too, a kernel's
    shape as the user's, [in, out]); empty when they fit."""
    if scheme is not None and scheme.from_checkpoint:
        return [f"the weights of a {scheme.method} checkpoint change only from disk"]
    expected = expected_shapes(config, scheme)
    ignored = ("lm_head.weight",) if config.tie_word_embeddings else ()

    def named(name: str) -> str:
        return f"{nnx_path(nnx_path_of(name))} ({name})" if as_nnx else name

    problems = [
        f"{named(name)}: not a weight of this model"
        for name in shapes
        if name not in expected and name not in ignored and not name.endswith(UNREAD_OK)
    ]
    for name, have in shapes.items():
        want = expected.get(name)
        if want is not None and have != want:
            if as_nnx and nnx_path_of(name)[-1] == "kernel":
                have, want = have[::-1], want[::-1]
            problems.append(f"{named(name)}: shape {have}, the model's is {want}")
    problems += [f"{named(name)}: missing" for name in expected if name not in shapes]
    return problems


def weights_from_hf(
    tensors: Mapping[str, Any],
    config: ModelConfig,
    dtype: Any,
    placement: Placement | None = None,
    scheme: QuantScheme | None = None,
) -> Weights:
    """Hugging Face-named arrays (checked by ``hf_problems``) -> ``Weights`` with the projections
    not yet fused: each field made by the loader's own conversion, on the device."""
    values = {}
    for job in field_jobs(config, scheme):
        parts = [tensors[name] for name in job.names]
        for path, field, _ in job.fields:
            values[path] = field_from_tensors(parts, path, field, config, dtype, placement, scheme)
    layers = [
        LayerWeights(**{f.name: values[("layers", i, f.name)] for f in layer_fields(config, i)})
        for i in range(config.num_layers)
    ]
    return Weights(layers=layers, **{f.name: values[(f.name,)] for f in model_fields(config)})
