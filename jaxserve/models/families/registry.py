"""Every family of this package, by ``model_type``: the records each family module lists in
``FAMILIES``, found by walking the package (a new family module is found without being named
anywhere else), and the tensors a config has, from its family's weight tables."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path

from jaxserve.config import ModelConfig
from jaxserve.config_fields import ConfigError
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
