"""Pre-quantized checkpoint tensors -> ``QArray`` parts in numpy, one Linear weight at a time.

Read by ``checkpoint_loader.load_weights`` for a ``QuantScheme`` from a checkpoint
(``models/quant_scheme.py``).
Each format is brought to the one layout of ``quant.QArray`` ([out, in], 4-bit values packed
eight to an int32 along in, the first in the lowest bits); its values stay quantized on the
device and are dequantized inside the matmul.

The published layouts (``base`` is a Linear's name, such as ``model.layers.0.self_attn.q_proj``):
  fp8 (per tensor)      base.weight f8e4m3 [out, in], base.weight_scale f32 [] or [1]
  fp8 (block scales)    base.weight f8e4m3 [out, in], base.weight_scale_inv f32
                        [ceil(out / bo), ceil(in / bi)] for weight_block_size [bo, bi]; the
                        weight is weight * weight_scale_inv despite the name
  compressed-tensors    base.weight f8e4m3 [out, in], base.weight_scale f32 [] / [1] (tensor),
                        [out, 1] (channel) or [out / bo, in / bi] (block)
  AWQ (gemm)            base.qweight i32 [in, out / 8], eight columns per word in the order
                        0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's); base.qzeros i32 [in / g, out / 8]
                        packed alike; base.scales f16 [in / g, out]; w = (q - z) * s
  GPTQ                  base.qweight i32 [in / 8, out], eight rows per word in order;
                        base.qzeros i32 [in / g, out / 8] in order, stored minus one in the
                        (v1) ``gptq`` checkpoint_format; base.scales f16 [in / g, out];
                        base.g_idx i32 [in], each input's group (act order when desc_act)
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import WeightField, dim_sizes
from jaxserve.models.quant import PACK, QArray
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.units import cdiv

# AutoAWQ packs output columns (0, 2, 4, 6, 1, 3, 5, 7) into nibbles 0..7 of a word.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = np.arange(PACK, dtype=np.uint32) * 4

# name -> shape (None: checked where it is converted, as the published shapes vary)
Read = Callable[[str], np.ndarray]


class QuantizedCheckpointError(ValueError):
    """A quantized tensor whose shape or dtype does not match the config: names it."""


def unpack_np(packed: np.ndarray, order: tuple[int, ...] | None = None) -> np.ndarray:
    """i32[..., n] -> u8[..., 8 n]; ``order``: which of the eight each nibble holds."""
    nibbles = (packed.astype(np.uint32)[..., None] >> _SHIFTS) & 0xF  # [..., n, 8]
    if order is not None:
        nibbles = nibbles[..., np.argsort(order)]
    return nibbles.reshape(*packed.shape[:-1], -1).astype(np.uint8)


def pack_np(values: np.ndarray, order: tuple[int, ...] | None = None) -> np.ndarray:
    """u8[..., 8 n] (values 0..15) -> i32[..., n]: the inverse of ``unpack_np``."""
    words = values.astype(np.uint32).reshape(*values.shape[:-1], -1, PACK)
    if order is not None:
        words = words[..., list(order)]
    return np.bitwise_or.reduce(words << _SHIFTS, axis=-1).view(np.int32)


def _base(field: WeightField) -> str:
    return field.hf_name.removesuffix(".weight")


def _out_in(field: WeightField, config: ModelConfig) -> tuple[int, int]:
    """(out, in) of the checkpoint tensor (the whole of a fused one)."""
    num_out, num_in = field.checkpoint_shape_for(config)
    return num_out, num_in


def tensor_shapes(
    field: WeightField, config: ModelConfig, scheme: QuantScheme
) -> dict[str, tuple[int, ...] | None]:
    """Checkpoint tensors (relative to the layer prefix) of one quantized field."""
    base = _base(field)
    num_out, num_in = _out_in(field, config)
    if scheme.weight_format == "fp8":
        return {f"{base}.weight": (num_out, num_in), f"{base}.{scheme.scale_name}": None}
    group = scheme.group_size or num_in
    if scheme.awq:
        shapes: dict[str, tuple[int, ...] | None] = {
            f"{base}.qweight": (num_in, num_out // PACK),
            f"{base}.qzeros": (num_in // group, num_out // PACK),
            f"{base}.scales": (num_in // group, num_out),
        }
        return shapes
    shapes = {
        f"{base}.qweight": (num_in // PACK, num_out),
        f"{base}.qzeros": (num_in // group, num_out // PACK),
        f"{base}.scales": (num_in // group, num_out),
    }
    if scheme.has_g_idx:
        shapes[f"{base}.g_idx"] = (num_in,)
    return shapes


def _fp8_scale(scale: np.ndarray, name: str, num_out: int, num_in: int, scheme: QuantScheme):
    """The published fp8 scale -> f32 [out] (tensor, channel) or [out, in / bi] (blocks)."""
    scale = scale.astype(np.float32)
    if scheme.group_size is None:
        if scale.size == 1:
            return np.full(num_out, scale.reshape(()), np.float32)
        if scale.shape in ((num_out,), (num_out, 1)):
            return scale.reshape(num_out)
        raise QuantizedCheckpointError(
            f"tensor {name!r} has shape {list(scale.shape)}; a per-tensor ([] or [1]) or "
            f"per-channel ([{num_out}, 1]) scale expected"
        )
    bo, bi = scheme.out_block, scheme.group_size
    expected = (cdiv(num_out, bo), cdiv(num_in, bi))
    if scale.shape != expected or num_in % bi:
        raise QuantizedCheckpointError(
            f"tensor {name!r} has shape {list(scale.shape)}, expected {list(expected)} for "
            f"{bo}x{bi} blocks of a [{num_out}, {num_in}] weight (in a multiple of {bi})"
        )
    return np.repeat(scale, bo, axis=0)[:num_out]  # [out, in / bi]


def check_fp8_scale(
    name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], scheme: QuantScheme
) -> None:
    """The scale of an fp8 tensor ``name`` [out, in] dequantized on load (``scaled_tensors``)
    has the shape ``scheme`` says: blocks, or per tensor / row (QuantizedCheckpointError)."""
    if len(shape) != 2:
        raise QuantizedCheckpointError(
            f"tensor {name!r} has shape {list(shape)}; fp8 tensors dequantized on load are "
            "[out, in]"
        )
    num_out, num_in = shape
    expected: list[tuple[int, ...]]
    if scheme.group_size is not None:
        expected = [(cdiv(num_out, scheme.out_block), cdiv(num_in, scheme.group_size))]
    else:
        expected = [(), (1,), (num_out,), (num_out, 1)]
    if tuple(scale_shape) not in expected:
        raise QuantizedCheckpointError(
            f"the scale of tensor {name!r} ({list(shape)}) has shape {list(scale_shape)}, "
            f"expected {' or '.join(str(list(e)) for e in expected)}"
        )


def read_qarray(
    read: Read, prefix: str, field: WeightField, config: ModelConfig, scheme: QuantScheme
) -> QArray:
    """One quantized field in ``QArray`` layout, numpy parts on the host."""
    base = prefix + _base(field)
    num_out, num_in = _out_in(field, config)
    zero = g_idx = None
    if scheme.weight_format == "fp8":
        q = read(f"{base}.weight")
        if q.dtype != ml_dtypes.float8_e4m3fn:
            raise QuantizedCheckpointError(
                f"tensor {base + '.weight'!r} has dtype {q.dtype}; {scheme.method} "
                "checkpoints store float8_e4m3fn"
            )
        name = f"{base}.{scheme.scale_name}"
        scale = _fp8_scale(read(name), name, num_out, num_in, scheme)
    elif scheme.awq:
        q = pack_np(unpack_np(read(f"{base}.qweight"), AWQ_PACK_ORDER).T)  # [out, in / 8]
        zero = np.ascontiguousarray(unpack_np(read(f"{base}.qzeros"), AWQ_PACK_ORDER).T)
        scale = read(f"{base}.scales").astype(np.float32).T  # [out, G]
    else:
        q = np.ascontiguousarray(read(f"{base}.qweight").T)  # already packed along in
        zeros = unpack_np(read(f"{base}.qzeros")).astype(np.int32) + scheme.zero_offset
        zero = np.ascontiguousarray(zeros.T).astype(np.uint8)  # [out, G]
        scale = read(f"{base}.scales").astype(np.float32).T
        if scheme.has_g_idx:
            g_idx = read(f"{base}.g_idx").astype(np.int32)
            if g_idx.min() < 0 or g_idx.max() >= scale.shape[1]:
                raise QuantizedCheckpointError(
                    f"tensor {base + '.g_idx'!r} names groups outside 0..{scale.shape[1] - 1}"
                )
    rows = field.part_rows(config)
    sizes = dim_sizes(config)
    return QArray(
        q=np.ascontiguousarray(q[rows]),
        scale=np.ascontiguousarray(scale[rows]),
        zero=None if zero is None else np.ascontiguousarray(zero[rows]),
        g_idx=g_idx,
        in_shape=tuple(sizes[d] for d in field.hf_shape[1]),
        out_shape=tuple(sizes[d] for d in field.hf_shape[0]),
    )


@functools.lru_cache(maxsize=64)
def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def read_fp8(path: Path, name: str) -> np.ndarray:
    """An F8_E4M3 tensor, memory-mapped (safetensors' numpy reader has no fp8 dtype)."""
    start, header = _header(path)
    entry = header[name]
    begin, _ = entry["data_offsets"]
    shape = tuple(entry["shape"])
    return np.memmap(path, ml_dtypes.float8_e4m3fn, "r", start + begin, shape)
