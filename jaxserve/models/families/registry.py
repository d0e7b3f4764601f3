"""Every family of this package, by ``model_type``: the records each family module lists in
``FAMILIES``, found by walking the package (a new family module is found without being named
anywhere else); the one way a model directory's config.json becomes a ``ModelConfig``
(``load_model_config``: its family's features read by ``config.parse_model_config``); and the
tensors a config has, from its family's weight tables."""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig, parse_model_config, read_config_json
from jaxserve.config_fields import ConfigError, ConfigFields
from jaxserve.models.families.family import Family
from jaxserve.models.families.fields import WeightField


@functools.cache
def families() -> dict[str, Family]:
    """model_type -> its family, in model_type order, from every module of this package."""
    found: dict[str, Family] = {}
    architectures: set[str] = set()
    for module_info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__name__.rpartition('.')[0]}.{module_info.name}")
        for family in getattr(module, "FAMILIES", ()):
            if family.model_type in found or architectures & set(family.architectures):
                raise ValueError(f"{module.__name__}: {family.model_type} is keyed twice")
            found[family.model_type] = family
            architectures.update(family.architectures)
    return dict(sorted(found.items()))


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for family in families().values() for arch in family.architectures)


def family_of(model_type: str) -> Family:
    family = families().get(model_type)
    if family is None:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(families())}"
        )
    return family


def family_for(raw: dict[str, Any]) -> Family:
    """The family of a config.json dict: its ``model_type``'s, which must be among those of a
    listed architecture (an unknown one names the supported ones)."""
    architectures = raw.get("architectures") or []
    supported = supported_architectures()
    if architectures and not any(a in supported for a in architectures):
        raise ConfigError(
            f"config.json: architectures={architectures} is not supported; "
            f"supported: {', '.join(supported)}"
        )
    model_type = raw.get("model_type")
    if model_type not in families():
        raise ConfigError(
            f"config.json: model_type={model_type!r} is not supported; "
            f"supported: {', '.join(families())} (architectures {', '.join(supported)})"
        )
    return families()[model_type]


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A config.json dict, read as its family says."""
    ConfigFields(raw)  # an object, or a ConfigError
    return parse_model_config(raw, family_for(raw).features)


def load_model_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """The config of a model directory (its config.json), read as its family says."""
    config_path = Path(model_dir) / "config.json"
    raw = read_config_json(config_path)
    try:
        return model_config_from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from exc


def layer_fields(config: ModelConfig, layer: int | None = None) -> tuple[WeightField, ...]:
    """The tensors of layer ``layer`` (None: of any layer) this config has, in table order."""
    table = family_of(config.model_type).layer_table
    return tuple(
        field
        for field in table
        if field.present(config)
        and (
            field.is_in_layer(config, layer)
            if layer is not None
            else any(field.is_in_layer(config, i) for i in range(config.num_layers))
        )
    )


def model_fields(config: ModelConfig) -> tuple[WeightField, ...]:
    """The tensors outside the layers this config has, in table order."""
    table = family_of(config.model_type).model_table
    return tuple(field for field in table if field.present(config))
