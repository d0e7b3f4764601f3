"""The ``Family`` record: everything jaxserve keys by a Hugging Face ``model_type``.

Each family module of this package lists its records in ``FAMILIES``; ``registry.py`` collects
them. Nothing outside a family's module names its ``model_type`` or architectures.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import ConfigFeatures
from jaxserve.models.families.fields import WeightField


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as config.json names it: adding a family is one record.

    ``layer_table`` and ``model_table``: its weight tensors of each layer and outside them.
    Every family's rows are ``LayerWeights``' (``Weights``') fields in their order; a field the
    family never has is left out of its table.
    """

    model_type: str  # config.json's model_type
    architectures: tuple[str, ...]  # config.json's architectures it serves
    layer_table: tuple[WeightField, ...]
    model_table: tuple[WeightField, ...]
    features: ConfigFeatures = ConfigFeatures()  # what it turns on in the config parser
