"""A checkpoint tensor on the device -> a field of ``Weights``: the loader's compiled
conversion (join the pieces ``checkpoint_reader`` sent, slice a fused part, transpose to the
model's einsum layout, cast), a field's dtype, and the placement in the field's shards (of a
plain array or a quantized one's parts). The checkpoint loader and dummy weights use them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import WeightField
from jaxserve.models.quant import (
    QUANTIZED_EXPERT_FIELDS,
    QUANTIZED_FIELDS,
    QArray,
    quantize_experts,
)
from jaxserve.models.quant_scheme import QuantScheme

# (field path in Weights, e.g. ("layers", 3, "wq")) -> a sharding for it, or None (default device)
Placement = Callable[[tuple[Any, ...], tuple[int, ...]], jax.sharding.Sharding | None]


# NOTE: a checkpoint tensor goes to the device as it is stored and is converted there. The
# loader before handed device_put transposed views of the host tensors, so the host made each
# transposed copy: an 8B checkpoint loaded at 0.65 GB/s on the H200, and on the CI machine that
# device_put took 57% of the old loader's time (numpy's own bf16 transpose: 0.1 GB/s). One
# compiled program per field layout and shape joins the pieces, slices a fused part,
# transposes and casts in one pass over device memory (a GPU does it in milliseconds; XLA's
# CPU transposes are slower than the host's copy, so on the CPU backend loading a 1.4 GB
# checkpoint went from 0.86 to 0.44 GB/s). It is the loader's own program; the model step's
# are compiled in the runner.
@functools.partial(jax.jit, static_argnames=("field", "config", "shape", "dtype"))
def to_field(
    pieces: list[jax.Array], field: WeightField, config: ModelConfig, shape: tuple, dtype: Any
) -> jax.Array:
    """The field in the model's layout and ``dtype``, from the 1-D pieces of its checkpoint
    tensors (``shape``: [number of tensors, *one tensor's shape])."""
    return _converted(pieces, field, config, shape, dtype)


def _converted(
    pieces: list[jax.Array], field: WeightField, config: ModelConfig, shape: tuple, dtype: Any
) -> jax.Array:
    stacked: Any = jnp.concatenate(pieces).reshape(shape)  # from_hf reads jax arrays too
    if field.per_expert:
        value = jax.vmap(lambda tensor: field.from_hf(tensor, config))(stacked)
    else:
        value = field.from_hf(stacked[0], config)
    return jnp.asarray(value).astype(dtype)


# NOTE: on one device the loader takes every field's memory before it sends any piece, and the
# conversion writes into it (donated), so the weights end as one block and only the pieces
# come and go above them. Each field made by XLA after its own pieces left the freed pieces as
# holes among the weights, and reused chunks the allocator hands out whole: on the H200 a real
# 8B checkpoint left the largest free block 1-4 GiB short of the pool less the weights, and the
# start ran out of memory allocating the KV cache the capacity plan had counted on.
@functools.partial(
    jax.jit,
    static_argnames=("field", "config", "shape"),
    donate_argnames=("out",),
    keep_unused=True,  # ``out`` is never read: kept, so that the result takes its buffer
)
def to_field_into(
    out: jax.Array, pieces: list[jax.Array], field: WeightField, config: ModelConfig, shape: tuple
) -> jax.Array:
    """``to_field`` written into ``out`` (donated: the field's shape and dtype, made before
    the pieces)."""
    return _converted(pieces, field, config, shape, out.dtype)


@functools.partial(
    jax.jit, static_argnames=("field", "config", "shape", "offset"), donate_argnames=("whole",)
)
def write_part(
    whole: jax.Array,
    pieces: list[jax.Array],
    field: WeightField,
    config: ModelConfig,
    shape: tuple,
    offset: int,
) -> jax.Array:
    """``whole`` (donated: written in place) with the field written at ``offset`` of its axis 1:
    a part of a joined array (``layers.FusedProjections``)."""
    value = _converted(pieces, field, config, shape, whole.dtype)
    return jax.lax.dynamic_update_slice_in_dim(whole, value, offset, axis=1)


@functools.partial(jax.jit, static_argnames=("shape", "scale_shape", "block", "dtype"))
def dequantized_fp8(
    pieces: list[jax.Array],
    scale_pieces: list[jax.Array],
    shape: tuple,  # [number of tensors, out, in]
    scale_shape: tuple,  # [number of tensors, *one scale's shape]
    block: tuple[int, int] | None,  # (out, in) of a scale's block; None: per tensor or row
    dtype: Any,
) -> jax.Array:  # 1-D: the tensors one after the other, as a piece of ``to_field``'s
    """An fp8 checkpoint's tensors times their scales, in ``dtype``: values in f32, rounded
    once to ``dtype`` (block scales ``[ceil(out / bo), ceil(in / bi)]``, a per-tensor scale
    ``[]`` / ``[1]`` or per-row ``[out]`` / ``[out, 1]``)."""
    num, num_out, num_in = shape
    values = jnp.concatenate(pieces).reshape(shape).astype(jnp.float32)
    scale = jnp.concatenate(scale_pieces).reshape(scale_shape).astype(jnp.float32)
    if block is None:
        scale = scale.reshape(num, -1, 1)  # [n, 1 | out, 1]
    else:
        rows, cols = block
        scale = jnp.repeat(scale, rows, axis=1)[:, :num_out]
        scale = jnp.repeat(scale, cols, axis=2)[:, :, :num_in]
    return (values * scale).astype(dtype).reshape(-1)


@functools.partial(jax.jit, static_argnames=("field", "config", "shape"))
def part_rows_of(pieces: list[jax.Array], field: WeightField, config: ModelConfig, shape: tuple):
    """This field's rows of its checkpoint tensor ``[out, in]`` (all of it, unless fused)."""
    return jnp.concatenate(pieces).reshape(shape)[0][field.part_rows(config)]


def layout_of(field: WeightField) -> WeightField:
    """The field without the names and fill that do not change its conversion, so fields of
    one layout and shape (wk and wv, the norms) share one compiled program."""
    hf_name = "{expert}" if field.per_expert else ""
    return dataclasses.replace(field, name="", hf_name=hf_name, init="normal", mlp="any")


def place_on_device(value: jax.Array, path: tuple[Any, ...], placement: Placement | None):
    """A device array placed with its sharding (each device gets its slice)."""
    sharding = placement(path, value.shape) if placement is not None else None
    if sharding is None:
        return value
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def field_dtype(field: WeightField, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a field is kept in: the weights' ``dtype``, or float32 where the table says."""
    return jnp.dtype(jnp.float32) if field.is_float32 else jnp.dtype(dtype)


def is_quantized(field: WeightField, scheme: QuantScheme | None) -> bool:
    """Whether ``scheme`` makes this field a ``QArray``: a Linear weight, or the routed
    experts (``is_quantized_experts``)."""
    return scheme is not None and (
        field.name in QUANTIZED_FIELDS or field.name in QUANTIZED_EXPERT_FIELDS
    )


def is_quantized_experts(field: WeightField, scheme: QuantScheme | None) -> bool:
    """Whether this field is a mixture of experts' routed experts, quantized by ``scheme``
    (values [E, in, out] and scales [E, out]: ``quant.quantize_experts``)."""
    return scheme is not None and field.name in QUANTIZED_EXPERT_FIELDS


# NOTE: one compiled program, so that XLA fuses the quantization into two passes over the
# experts (the amax, then the scaled values): op by op, a layer of DeepSeek-V3's experts
# (7.5 GB in bf16) made three float32 copies of itself on the device.
@functools.partial(jax.jit, static_argnames=("weight_format",))
def quantized_experts(experts: jax.Array, weight_format: str) -> QArray:
    """Stacked experts [E, in, out] on the device -> their ``QArray`` (``quantize_experts``)."""
    return quantize_experts(experts, weight_format)


def place_host(
    array: np.ndarray, dtype: jnp.dtype, path: tuple[Any, ...], placement: Placement | None
) -> jax.Array:
    array = array.astype(dtype, copy=False)
    sharding = placement(path, array.shape) if placement is not None else None
    if sharding is None:
        return jax.device_put(array)
    # Each device receives only its own slice of the host tensor.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def place_quantized(
    w: QArray, path: tuple[Any, ...], placement: Placement | None, act_quant: bool
) -> QArray:
    """A QArray's parts (numpy or device arrays) placed as its weight's path + part name says;
    they keep their dtypes (the values quantized, the scales f32)."""
    parts: dict[str, Any] = {}
    for name in ("q", "scale", "zero", "g_idx"):
        part = getattr(w, name)
        if part is None:
            continue
        if isinstance(part, jax.Array):  # made on the device (dummy weights)
            sharding = placement((*path, name), part.shape) if placement is not None else None
            parts[name] = part if sharding is None else jax.device_put(part, sharding)
        else:
            parts[name] = place_host(np.asarray(part), part.dtype, (*path, name), placement)
    return QArray(**parts, in_shape=w.in_shape, out_shape=w.out_shape, act_quant=act_quant)
