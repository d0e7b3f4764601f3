"""PartitionSpecs of a quantized Linear weight (a ``QArray`` of specs, part for part), for
``sharding.py``'s tensor-parallel layout."""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import WeightField, dim_sizes
from jaxserve.models.quant import QArray
from jaxserve.models.quant_scheme import QuantScheme, qarray_layout
from jaxserve.runner.parallel.mesh import KV_AXIS, TP_AXIS


def quantized_specs(
    field: WeightField,
    config: ModelConfig,
    quant: QuantScheme,
    tensor_parallel_size: int,
    split_dims: dict[str, str],  # einsum letter -> mesh axis, as sharding.py splits weights
) -> QArray:
    """A ``QArray`` of specs: values [out, in] split as the weight's output and input letters
    are, scales and zero points [out] / [out, G] following the output axis (and the input
    axis where the groups split evenly), g_idx replicated."""
    axis_sizes = {
        TP_AXIS: tensor_parallel_size,
        KV_AXIS: min(tensor_parallel_size, config.num_kv_heads),
    }

    def axis(letters: str, size: int) -> str | None:
        name = next((split_dims[d] for d in letters if d in split_dims), None)
        # NOTE: jax shards only evenly: an axis that does not divide stays replicated.
        return name if name is not None and size % axis_sizes[name] == 0 else None

    out_letters, in_letters = field.hf_shape
    parts: dict[str, Any] = {}
    for name, (shape, _) in qarray_layout(field, config, quant).items():
        if name == "g_idx":
            parts[name] = P(None)
        else:
            letters = (out_letters, in_letters)[: len(shape)]
            parts[name] = P(*(axis(ls, n) for ls, n in zip(letters, shape, strict=True)))
    sizes = dim_sizes(config)
    return QArray(
        **parts,
        in_shape=tuple(sizes[d] for d in in_letters),
        out_shape=tuple(sizes[d] for d in out_letters),
        act_quant=quant.act_quant,
    )
