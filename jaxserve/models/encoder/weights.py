"""An encoder's weights as typed pytrees, their weight table, and how they are made: read from
a Hugging Face safetensors checkpoint (``load_encoder_weights``) or random
(``dummy_encoder_weights``, for benchmarks).

The table's rows say where each tensor sits in the checkpoint and its shape here, in the einsum
letters of ``forward.py``: V vocab, P positions, Y token types, H hidden, N heads, D head dim,
I intermediate, L labels. The encoder's tensors are named as ``BertModel`` / ``XLMRobertaModel``
save them (``embeddings.*``, ``encoder.layer.{i}.*``), under ``bert.`` / ``roberta.`` in a
sequence classifier; sentence-transformers saves its embedding models without the prefix, and
both are read. Encoders are small (BGE-large: 335M parameters), so each tensor is converted on
the host and sent to the default device whole; a runner that shards places them itself.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.encoder.config import EncoderConfig
from jaxserve.models.loading.checkpoint_loader import tensor_files
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError

_LOG = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerNorm:
    scale: jax.Array  # [H]
    bias: jax.Array  # [H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EncoderLayerWeights:
    """One post-LN transformer layer: attention, then its LayerNorm; MLP, then its LayerNorm."""

    wq: jax.Array  # [H, N, D]
    bq: jax.Array  # [N, D]
    wk: jax.Array  # [H, N, D]
    bk: jax.Array  # [N, D]
    wv: jax.Array  # [H, N, D]
    bv: jax.Array  # [N, D]
    wo: jax.Array  # [N, D, H]
    bo: jax.Array  # [H]
    attn_norm: LayerNorm
    w_in: jax.Array  # [H, I]  intermediate.dense
    b_in: jax.Array  # [I]
    w_out: jax.Array  # [I, H]  output.dense
    b_out: jax.Array  # [H]
    mlp_norm: LayerNorm


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ClassifierHead:
    """A sequence classifier's head on the first token: tanh(x @ w_dense + b_dense) @ w_out +
    b_out (BERT's pooler then classifier; XLM-R's classifier.dense then out_proj)."""

    w_dense: jax.Array  # [H, H]
    b_dense: jax.Array  # [H]
    w_out: jax.Array  # [H, L]
    b_out: jax.Array  # [L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EncoderWeights:
    word_embed: jax.Array  # [V, H]
    position_embed: jax.Array  # [P, H]
    type_embed: jax.Array  # [Y, H]
    embed_norm: LayerNorm
    layers: list[EncoderLayerWeights]
    head: ClassifierHead | None = None  # a cross-encoder's; None for an embedding model


@dataclasses.dataclass(frozen=True)
class EncoderField:
    """One tensor: its path in the pytree ("attn_norm.scale"), its checkpoint name (the
    encoder's: after the prefix, ``{layer}`` in a layer's; the head's: the whole name, the
    family's prefix included), its checkpoint shape (one entry per axis, each a product of
    letters: ("ND", "H") is [N * D, H]) and its shape here, one letter per axis. Linear weights
    are [out, in] in the checkpoint: transposed, then reshaped to ``shape``."""

    path: str
    hf_name: str
    hf_shape: tuple[str, ...]
    shape: str
    transpose: bool = False
    init: Literal["normal", "ones", "zeros"] = "normal"  # dummy weights


def _linear(path: str, hf: str, out: str, in_: str) -> tuple[EncoderField, ...]:
    """A Linear layer's weight [in..., out...] and bias [out...] (path "b" + the weight's
    after its "w")."""
    return (
        EncoderField(path, f"{hf}.weight", (out, in_), in_ + out, transpose=True),
        EncoderField("b" + path[1:], f"{hf}.bias", (out,), out, init="zeros"),
    )


def _layer_norm(path: str, hf: str) -> tuple[EncoderField, ...]:
    return (
        EncoderField(f"{path}.scale", f"{hf}.weight", ("H",), "H", init="ones"),
        EncoderField(f"{path}.bias", f"{hf}.bias", ("H",), "H", init="zeros"),
    )


EMBEDDING_TABLE = (
    EncoderField("word_embed", "embeddings.word_embeddings.weight", ("V", "H"), "VH"),
    EncoderField("position_embed", "embeddings.position_embeddings.weight", ("P", "H"), "PH"),
    EncoderField("type_embed", "embeddings.token_type_embeddings.weight", ("Y", "H"), "YH"),
    *_layer_norm("embed_norm", "embeddings.LayerNorm"),
)
_LAYER = "encoder.layer.{layer}."
LAYER_TABLE = (
    *_linear("wq", _LAYER + "attention.self.query", "ND", "H"),
    *_linear("wk", _LAYER + "attention.self.key", "ND", "H"),
    *_linear("wv", _LAYER + "attention.self.value", "ND", "H"),
    *_linear("wo", _LAYER + "attention.output.dense", "H", "ND"),
    *_layer_norm("attn_norm", _LAYER + "attention.output.LayerNorm"),
    *_linear("w_in", _LAYER + "intermediate.dense", "I", "H"),
    *_linear("w_out", _LAYER + "output.dense", "H", "I"),
    *_layer_norm("mlp_norm", _LAYER + "output.LayerNorm"),
)


def head_table(config: EncoderConfig) -> tuple[EncoderField, ...]:
    family = config.family
    return (
        *_linear("w_dense", family.head_dense, "H", "H"),
        *_linear("w_out", family.head_out, "L", "H"),
    )


def dim_sizes(config: EncoderConfig) -> dict[str, int]:
    return {
        "V": config.vocab_size,
        "P": config.max_position_embeddings,
        "Y": config.type_vocab_size,
        "H": config.hidden_size,
        "N": config.num_heads,
        "D": config.head_dim,
        "I": config.intermediate_size,
        "L": config.num_labels,
    }


def shape_of(field: EncoderField, config: EncoderConfig) -> tuple[int, ...]:
    sizes = dim_sizes(config)
    return tuple(sizes[letter] for letter in field.shape)


def checkpoint_shape_of(field: EncoderField, config: EncoderConfig) -> tuple[int, ...]:
    sizes = dim_sizes(config)
    return tuple(math.prod(sizes[letter] for letter in axis) for axis in field.hf_shape)


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"attn_norm.scale": x, ...} -> {"attn_norm": LayerNorm(...), ...}."""
    out: dict[str, Any] = {}
    norms: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        if "." in path:
            norm, attr = path.split(".")
            norms.setdefault(norm, {})[attr] = value
        else:
            out[path] = value
    out.update({name: LayerNorm(**parts) for name, parts in norms.items()})
    return out


def assemble(make: Any, config: EncoderConfig) -> EncoderWeights:
    """The weights from ``make(field, layer)`` -> array (layer None outside the layers)."""
    outside = _nest({f.path: make(f, None) for f in EMBEDDING_TABLE})
    layers = [
        EncoderLayerWeights(**_nest({f.path: make(f, layer) for f in LAYER_TABLE}))
        for layer in range(config.num_layers)
    ]
    head = None
    if config.has_classifier:
        head = ClassifierHead(**{f.path: make(f, None) for f in head_table(config)})
    return EncoderWeights(layers=layers, head=head, **outside)


def dummy_encoder_weights(
    config: EncoderConfig, dtype: jnp.dtype = jnp.bfloat16, seed: int = 0, scale: float = 0.02
) -> EncoderWeights:
    """Random weights in the config's architecture (for benchmarks and tests): drawn and cast
    on the host (numpy; BGE-large's in seconds, and no program compiled per shape), then sent
    to the default device."""
    rng = np.random.default_rng(seed)
    host_dtype = jnp.dtype(dtype)  # numpy's (bfloat16 through ml_dtypes)

    def make(field: EncoderField, layer: int | None) -> jax.Array:
        shape = shape_of(field, config)
        if field.init != "normal":
            host = (np.ones if field.init == "ones" else np.zeros)(shape, host_dtype)
        else:
            host = (scale * rng.standard_normal(shape, np.float32)).astype(host_dtype)
        return jax.device_put(host)

    return assemble(make, config)


# Checkpoint tensors that are safely left unread: the position-id buffer old checkpoints
# saved, and an embedding model's pooler (sentence-transformers pools without it).
_UNREAD_OK = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def checkpoint_prefix(names: set[str], config: EncoderConfig, model_dir: Path) -> str:
    """The prefix of the encoder's tensors: the family's (a classifier) or none (as
    sentence-transformers saves an embedding model)."""
    for prefix in (config.family.prefix, ""):
        if f"{prefix}{EMBEDDING_TABLE[0].hf_name}" in names:
            return prefix
    raise WeightsError(
        f"{model_dir}: no tensor {EMBEDDING_TABLE[0].hf_name!r}, with or without the "
        f"{config.family.prefix!r} prefix: not a {config.model_type} checkpoint"
    )


def encoder_tensor_names(
    config: EncoderConfig, prefix: str
) -> dict[str, tuple[EncoderField, int | None]]:
    """Checkpoint tensor name -> (its field, its layer) for every tensor the model reads."""
    names: dict[str, tuple[EncoderField, int | None]] = {
        prefix + f.hf_name: (f, None) for f in EMBEDDING_TABLE
    }
    for layer in range(config.num_layers):
        for f in LAYER_TABLE:
            names[prefix + f.hf_name.format(layer=layer)] = (f, layer)
    family_prefix = config.family.prefix
    for f in head_table(config) if config.has_classifier else ():
        # the head's names carry the family's prefix where they are under the encoder's
        name = f.hf_name
        if name.startswith(family_prefix):
            name = prefix + name[len(family_prefix) :]
        names[name] = (f, None)
    return names


def load_encoder_weights(
    model_dir: str | os.PathLike[str], config: EncoderConfig, dtype: jnp.dtype = jnp.bfloat16
) -> EncoderWeights:
    """Read an encoder's safetensors checkpoint (every tensor checked for presence and shape
    before any is read), each tensor brought to its layout and ``dtype`` on the host, then sent
    to the default device."""
    model_dir = Path(model_dir)
    host_dtype = jnp.dtype(dtype)  # numpy's (bfloat16 through ml_dtypes)
    files = tensor_files(model_dir)
    prefix = checkpoint_prefix(set(files), config, model_dir)
    wanted = encoder_tensor_names(config, prefix)
    by_field = {(f.path, f.hf_name, layer): name for name, (f, layer) in wanted.items()}
    unread = [n for n in sorted(set(files) - set(wanted)) if not n.endswith(_UNREAD_OK)]
    if unread:
        _LOG.warning(
            "%s: %d checkpoint tensor(s) are not read by the %s encoder: %s",
            model_dir,
            len(unread),
            config.model_type,
            ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else ""),
        )
    with CheckpointReader({n: files[n] for n in wanted if n in files}) as reader:
        for name, (field, _) in wanted.items():
            _check_tensor(reader, name, field, config, model_dir, name in files)

        def make(field: EncoderField, layer: int | None) -> jax.Array:
            host = reader.read_to_host(by_field[(field.path, field.hf_name, layer)])
            host = host.T if field.transpose else host
            return jax.device_put(host.reshape(shape_of(field, config)).astype(host_dtype))

        return assemble(make, config)


def _check_tensor(
    reader: CheckpointReader,
    name: str,
    field: EncoderField,
    config: EncoderConfig,
    model_dir: Path,
    is_present: bool,
) -> None:
    expected = checkpoint_shape_of(field, config)
    if not is_present:
        raise WeightsError(
            f"{model_dir}: tensor {name!r} (expected shape {list(expected)}) is missing "
            "from the checkpoint"
        )
    info = reader.info(name)
    info.dtype  # noqa: B018 (a dtype the reader cannot read raises here)
    if info.shape != expected:
        raise WeightsError(
            f"{info.file.name}: tensor {name!r} has shape {list(info.shape)}, expected "
            f"{list(expected)} from config.json"
        )
