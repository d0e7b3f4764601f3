"""The encoder families (BERT, XLM-RoBERTa) and ``EncoderConfig``, read from a model directory.

``config.json`` gives the architecture (``BertModel``, ``BertForSequenceClassification``,
``XLMRobertaModel``, ``XLMRobertaForSequenceClassification``) and the sizes; a cross-encoder's
score activation comes from sentence-transformers' files beside it, as ``CrossEncoder`` reads
it. These families live apart from the decoder registry (``models/families/``): their weights,
layers and forward pass share nothing with the decoder's, and the decoder registry keeps its
error for these architectures. ``is_encoder`` tells a caller which of the two reads a config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from jaxserve.config import read_config_json
from jaxserve.config_fields import ConfigError, ConfigFields

_LOG = logging.getLogger(__name__)

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# sentence-transformers' activation (a torch class path) -> the name ``heads.scores`` applies.
SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}


@dataclasses.dataclass(frozen=True)
class EncoderFamily:
    """One encoder family: its architectures and where its tensors sit in a checkpoint."""

    model_type: str  # config.json's model_type
    base_architecture: str  # the encoder alone (an embedding model)
    classifier_architecture: str  # with a sequence-classification head (a cross-encoder)
    prefix: str  # the encoder's tensors' prefix under the classifier ("bert.")
    # The classification head's two Linear layers (HF names without .weight / .bias): a dense
    # layer followed by tanh, then the projection to the labels.
    head_dense: str
    head_out: str
    positions_after_padding: bool = False  # XLM-R: position ids start at pad_token_id + 1


BERT = EncoderFamily(
    "bert", "BertModel", "BertForSequenceClassification", "bert.", "bert.pooler.dense", "classifier"
)
XLM_ROBERTA = EncoderFamily(
    "xlm-roberta",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "roberta.",
    "classifier.dense",
    "classifier.out_proj",
    positions_after_padding=True,
)
ENCODER_FAMILIES = {family.model_type: family for family in (BERT, XLM_ROBERTA)}
ENCODER_ARCHITECTURES = tuple(
    arch
    for family in ENCODER_FAMILIES.values()
    for arch in (family.base_architecture, family.classifier_architecture)
)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """An encoder's sizes and switches (einsum letters of ``forward.py`` in brackets)."""

    model_type: str
    vocab_size: int  # [V]
    hidden_size: int  # [H]
    intermediate_size: int  # [I]
    num_layers: int
    num_heads: int  # [N]
    max_position_embeddings: int  # [P] rows of the position table
    type_vocab_size: int  # [Y] rows of the token-type table (XLM-R: 1)
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # "gelu" is exact (erf) GELU, as Hugging Face's BERT
    position_offset: int = 0  # added to each token's 0-based position (XLM-R: pad id + 1)
    num_labels: int = 0  # [L] the classification head's outputs; 0: no head
    score_activation: str = "identity"  # on the logits: "sigmoid", "identity" or "tanh"
    # each label's name (config.json's ``id2label``, in id order; "LABEL_i" where it has none)
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"{name}={value} must be positive")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_heads}"
            )
        if self.type_vocab_size < 1 or self.num_labels < 0:
            raise ConfigError(
                f"type_vocab_size={self.type_vocab_size} must be >= 1 and "
                f"num_labels={self.num_labels} >= 0"
            )
        if self.max_seq_len < 1:
            raise ConfigError(
                f"max_position_embeddings={self.max_position_embeddings} leaves no position "
                f"after the first {self.position_offset}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.score_activation not in SCORE_ACTIVATIONS.values():
            raise ConfigError(f"score_activation={self.score_activation!r} is not supported")

    @property
    def family(self) -> EncoderFamily:
        return ENCODER_FAMILIES[self.model_type]

    @property
    def head_dim(self) -> int:  # [D]
        return self.hidden_size // self.num_heads

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the position table holds (XLM-R: 2 fewer than its rows)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def has_classifier(self) -> bool:
        return self.num_labels > 0


def is_encoder(raw: dict[str, Any]) -> bool:
    """Whether a config.json dict names an encoder architecture this module reads."""
    architectures = raw.get("architectures") or []
    if architectures:
        return any(arch in ENCODER_ARCHITECTURES for arch in architectures)
    return raw.get("model_type") in ENCODER_FAMILIES


def encoder_config_from_dict(raw: dict[str, Any]) -> EncoderConfig:
    """A config.json dict of an encoder; the score activation is sentence-transformers'
    default (sigmoid for one label, else identity): ``load_encoder_config`` reads the saved one."""
    fields = ConfigFields(raw)
    architectures = fields.strings("architectures")
    if not is_encoder(raw):
        raise ConfigError(
            f"config.json: architectures={list(architectures)} "
            f"(model_type={raw.get('model_type')!r}) is not an encoder; supported encoders: "
            f"{', '.join(ENCODER_ARCHITECTURES)}"
        )
    model_type = fields.string("model_type")
    family = ENCODER_FAMILIES.get(model_type or "")
    if family is None or not set(architectures) <= {
        family.base_architecture,
        family.classifier_architecture,
    }:
        raise ConfigError(
            f"config.json: model_type={model_type!r} with architectures={list(architectures)} "
            f"is not supported; supported: "
            + ", ".join(
                f"{f.model_type} ({f.base_architecture}, ...)" for f in ENCODER_FAMILIES.values()
            )
        )
    if fields.string("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(
            f"position_embedding_type={raw['position_embedding_type']!r} is not supported; "
            "supported: absolute"
        )
    num_labels = 0
    if family.classifier_architecture in architectures:
        id2label = raw.get("id2label")
        num_labels = len(id2label) if isinstance(id2label, dict) and id2label else 0
        num_labels = fields.integer("num_labels", num_labels or 2)
    pad = fields.integer("pad_token_id", 1)
    return EncoderConfig(
        model_type=family.model_type,
        vocab_size=fields.required_integer("vocab_size"),
        hidden_size=fields.required_integer("hidden_size"),
        intermediate_size=fields.required_integer("intermediate_size"),
        num_layers=fields.required_integer("num_hidden_layers"),
        num_heads=fields.required_integer("num_attention_heads"),
        max_position_embeddings=fields.integer("max_position_embeddings", 512),
        type_vocab_size=fields.integer("type_vocab_size", 2),
        layer_norm_eps=fields.number("layer_norm_eps", 1e-12),
        hidden_act=fields.string("hidden_act", "gelu") or "gelu",
        position_offset=pad + 1 if family.positions_after_padding else 0,
        num_labels=num_labels,
        score_activation="sigmoid" if num_labels == 1 else "identity",
        labels=label_names(raw.get("id2label"), num_labels),
    )


def label_names(id2label: Any, num_labels: int) -> tuple[str, ...]:
    """The name of each of ``num_labels`` labels from config.json's ``id2label`` (keys are the
    ids as strings, as transformers saves them); "LABEL_i" for an id it does not name, as
    transformers' default."""
    names = id2label if isinstance(id2label, dict) else {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(num_labels))


def load_encoder_config(model_dir: str | os.PathLike[str]) -> EncoderConfig:
    """The encoder config of a model directory, with a cross-encoder's saved score activation."""
    model_dir = Path(model_dir)
    raw = read_config_json(model_dir / "config.json")
    try:
        config = encoder_config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{model_dir / 'config.json'}: {exc}") from exc
    if not config.has_classifier:
        return config
    activation = read_score_activation(model_dir, raw)
    return dataclasses.replace(config, score_activation=activation or config.score_activation)


def read_score_activation(model_dir: Path, raw: dict[str, Any]) -> str | None:
    """The activation a cross-encoder's scores go through, where sentence-transformers saved
    one: ``config_sentence_transformers.json``'s ``activation_fn`` (v4 and later), else
    config.json's ``sentence_transformers.activation_fn``, else its
    ``sbert_ce_default_activation_function`` (before v4); None: none saved. A class outside
    ``torch.`` is skipped, as ``CrossEncoder`` skips it without ``trust_remote_code``."""
    found: list[tuple[str, Any]] = []
    st_path = model_dir / "config_sentence_transformers.json"
    if st_path.is_file():
        try:
            st_config = json.loads(st_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{st_path} is not valid JSON: {exc}") from exc
        if isinstance(st_config, dict):
            found.append((f"{st_path.name}: activation_fn", st_config.get("activation_fn")))
    section = raw.get("sentence_transformers")
    if isinstance(section, dict):
        found.append(
            ("config.json: sentence_transformers.activation_fn", section.get("activation_fn"))
        )
    found.append(
        (
            "config.json: sbert_ce_default_activation_function",
            raw.get("sbert_ce_default_activation_function"),
        )
    )
    for where, path in found:
        if path is None:
            continue
        if not isinstance(path, str) or not path.startswith("torch."):
            _LOG.warning("%s: %s=%r is not a torch class; not used", model_dir, where, path)
            continue
        if path not in SCORE_ACTIVATIONS:
            raise ConfigError(
                f"{model_dir}: {where}={path!r} is not supported; supported: "
                f"{', '.join(SCORE_ACTIVATIONS)}"
            )
        return SCORE_ACTIVATIONS[path]
    return None
