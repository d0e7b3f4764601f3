"""Quantized Linear weights: values and scales, and the one matmul the model reads them through.

A quantized weight is a ``QArray`` kept in the checkpoint's Linear layout ``[out, in]`` (the
output and input axes of ``families/fields.py``'s ``WeightField.hf_shape``, flattened): 8-bit
values (fp8 e4m3 or int8) or 4-bit values packed eight to an int32 word along ``in``, with a
scale per output channel or per group of inputs, and for 4-bit formats a zero point per group.
``linear(x, w, spec)`` is the model's matmul: a plain array goes through
``jnp.einsum(spec, ...)`` exactly as before; a ``QArray`` is multiplied in its own layout and
reshaped back to the einsum's output. Steps of few tokens may take the skinny-matmul kernel
instead (``pallas_kernels.skinny_matmul``, behind ``JAXSERVE_SKINNY_MATMUL``), for plain
weights and per-channel 8-bit ones alike. In batch-invariant mode (``row_tile``) every call runs
on fixed tiles of rows (``tiled_rows``), so a row's result does not depend on its step.

Made by ``quantize`` (``--quantization fp8 | int8``: bf16 weights quantized on load) and by
``loading/quant_checkpoint.py`` (fp8, compressed-tensors, AWQ and GPTQ checkpoints); laid out
across devices by ``runner/parallel/sharding.py`` (scales follow their weight's output axis). The
embedding and lm_head are never quantized: they stay in the model dtype (as vLLM's fp8 does),
as do norms and biases.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.env_choice import env_choice
from pallas_kernels.fp8_matmul import dispatch as fp8_dispatch
from pallas_kernels.fp8_matmul import mosaic_gpu as fp8_mosaic
from pallas_kernels.fp8_matmul.reference import quantize_rows
from pallas_kernels.fresh import fresh_full
from pallas_kernels.skinny_matmul import dispatch as skinny_dispatch
from pallas_kernels.skinny_matmul import triton as skinny_triton

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
PACK = 8  # 4-bit values per int32 word
# The Linear weights of a layer; everything else (embedding, lm_head, norms, biases) is not.
QUANTIZED_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A mixture of experts' routed experts, stacked on E (``quantize_experts``): quantized by the
# same schemes on load. The router and shared experts are not (they stay in the model dtype).
QUANTIZED_EXPERT_FIELDS = ("experts_gate", "experts_up", "experts_down")
Array = jax.Array | np.ndarray


# NOTE: one layout for every format ([out, in], the checkpoint's) so the fp8 dot can contract
# the minor axis of both operands, the layout cuBLASLt's fp8 GEMM wants (a weight stored
# [in, out] would be transposed by XLA on every step); 4-bit formats are repacked to it on load.
# A mixture of experts' stacked experts are the one exception: q [E, in, out] in the model's
# own layout (the grouped matmul's rhs [G, K, N], which its kernel and ragged_dot read as it
# is), scale [E, out]; ``is_experts`` says which.
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QArray:
    """A Linear weight of logical shape ``[*in_shape, *out_shape]`` in fewer bits (stacked
    experts: ``[E, *in_shape, *out_shape]``)."""

    # Device arrays in the model; numpy on the host while a checkpoint is read.
    # f8e4m3 | i8 [out, in], or i32 [out, in // 8]: 4-bit values packed along in;
    # stacked experts: f8e4m3 | i8 [E, in, out]
    q: Array
    # f32 [out] per output channel, or f32 [out, G]: per group of in // G inputs;
    # stacked experts: f32 [E, out], per expert and output channel
    scale: Array
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    zero: Array | None = None  # u8 [out, G] zero points of 4-bit formats, else None
    g_idx: Array | None = None  # i32 [in]: each input's group (GPTQ act order), else None
    # W8A8: activations quantized to fp8 per token, the dot on fp8 tensor cores.
    act_quant: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def is_packed(self) -> bool:
        return self.q.dtype == jnp.int32

    @property
    def is_experts(self) -> bool:
        """Stacked experts ([E, in, out] values, [E, out] scales), read by the grouped matmul."""
        return self.q.ndim == 3

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.scale, self.zero, self.g_idx)
        return sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in parts if p is not None)


def joinable(parts: list[Any]) -> bool:
    """Whether ``parts`` are QArrays that ``join`` can make one: 8-bit values with one scale
    per output channel (no groups, zero points or packing), of one input, format and mode."""
    if not all(isinstance(p, QArray) for p in parts):
        return False
    first = parts[0]
    return all(
        not p.is_packed
        and not p.is_experts
        and p.zero is None
        and p.g_idx is None
        and jnp.ndim(p.scale) == 1
        and p.in_shape == first.in_shape
        and p.q.dtype == first.q.dtype
        and p.act_quant == first.act_quant
        and p.out_shape[1:] == first.out_shape[1:]
        for p in parts
    )


def join(parts: list[QArray]) -> QArray:
    """Per-channel QArrays that read the same input (``joinable``) as one, their outputs in
    order on the first output axis (q, k, v: ``[N + 2K, D]``; gate, up: ``[2I]``): each
    output channel keeps its values and its scale, so the product is the same."""
    first = parts[0]
    out_shape = (sum(p.out_shape[0] for p in parts), *first.out_shape[1:])
    return QArray(
        q=jnp.concatenate([jnp.asarray(p.q) for p in parts], axis=0),
        scale=jnp.concatenate([jnp.asarray(p.scale) for p in parts], axis=0),
        in_shape=first.in_shape,
        out_shape=out_shape,
        act_quant=first.act_quant,
    )


def unpack_int4(packed: jax.Array) -> jax.Array:  # i32[..., n] -> i32[..., 8 n], values 0..15
    """Eight 4-bit values per word, the first in the lowest bits (GPTQ's order)."""
    shifts = jnp.arange(PACK, dtype=jnp.int32) * 4
    values = (packed[..., None] >> shifts) & 0xF  # the arithmetic shift's sign bits masked off
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize(w: QArray, dtype: Any) -> jax.Array:  # [out, in] in dtype
    """The weight in ``dtype``; under jit this lives only inside the matmul that reads it.

    The arithmetic is in ``dtype`` itself (4-bit values and zero points are small integers,
    exact in bf16; fp8 values are exact too), so a dequantized operand XLA does not fuse into
    the GEMM costs two bytes per weight, not four. Stacked experts: [E, in, out]."""
    q, scale = jnp.asarray(w.q), jnp.asarray(w.scale).astype(dtype)
    if w.is_experts:
        return q.astype(dtype) * scale[:, None, :]
    values = (unpack_int4(q) if w.is_packed else q).astype(dtype)  # [out, in]
    if scale.ndim == 1:
        return values * scale[:, None]
    zero = None if w.zero is None else jnp.asarray(w.zero).astype(dtype)  # [out, G]
    if w.g_idx is not None:  # act order: any input may sit in any group
        g_idx = jnp.asarray(w.g_idx)
        if zero is not None:
            values = values - zero[:, g_idx]
        return values * scale[:, g_idx]
    num_out, num_in = values.shape
    num_groups = scale.shape[1]
    grouped = values.reshape(num_out, num_groups, num_in // num_groups)
    if zero is not None:
        grouped = grouped - zero[..., None]
    return (grouped * scale[..., None]).reshape(num_out, num_in)


_CONTRACT_IN = (((1,), (1,)), ((), ()))  # x[T, in] . w[out, in] -> [T, out]


def quantize_tokens_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token fp8: (f8e4m3[T, in], f32[T, 1] scales), x ~= values * scale (the
    fp8-matmul kernel's quantizer, so both W8A8 paths round alike)."""
    return quantize_rows(x)


# Steps of fewer tokens (decode) read fp8 weights weight-only, converted inside the GEMM: at
# batch 1 on the H200 the W8A8 path (per-token activation quantization, then the fp8 dot) took
# 7.1 ms a step against 5.0 for bf16. JAXSERVE_W8A8_MIN_TOKENS moves the threshold (benchmarks).
W8A8_MIN_TOKENS = int(os.environ.get("JAXSERVE_W8A8_MIN_TOKENS", "128"))


# NOTE: XLA's native fp8 dot, not qwix. Measured with qwix 0.1.8 (pip) on the CPU: its W8A8
# (qwix.quantize + qwix.dot) lowers to the same stablehlo.dot_general f8E4M3FN x f8E4M3FN -> f32
# and gave the same error (max 0.111 against 0.105 here, an 8x256x512 product of logits ~3),
# but it keeps the weight [in, out] (contracting [1] x [0], so cuBLASLt's fp8 GEMM gets a
# transposed weight each step unless XLA relayouts it), stores 4-bit as jnp.int4 with its own
# tiling (AWQ and GPTQ checkpoints would be repacked either way), and brings 13,928 lines plus
# flax, optax, chex, orbax, absl and opt_einsum, none of which jaxserve otherwise needs. This
# function is the whole of what the model uses.
def linear(
    x: jax.Array,
    w: jax.Array | QArray,
    spec: str,
    out_dtype: Any = None,
    row_tile: int | None = None,
) -> jax.Array:
    """The model's matmul: ``jnp.einsum(spec, x, w)`` for a plain weight; for a ``QArray``,
    x ``[T, *in_shape]`` -> ``[T, *out_shape]`` in x's dtype, dequantized inside the matmul.
    ``out_dtype`` (default x's): the result's dtype, summed in f32 either way (logits).
    ``row_tile`` (batch-invariant mode): the rows go through one GEMM of that many rows at a
    time (``tiled_rows``), so a row's result does not depend on how many rows there are."""
    if row_tile is not None:
        return tiled_rows(lambda tile: linear(tile, w, spec, out_dtype), x, row_tile)
    kernel = _fp8_matmul(x, w, out_dtype) if isinstance(w, QArray) else None
    if kernel is None:
        kernel = _skinny_matmul(x, w, spec, out_dtype)
    if kernel is not None:
        return kernel
    if not isinstance(w, QArray):
        if _cpu_upcasts(x, w, out_dtype):
            x, w = x.astype(out_dtype), w.astype(out_dtype)
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    lead = x.shape[: x.ndim - len(w.in_shape)]
    x2 = x.reshape(-1, math.prod(w.in_shape))  # [T, in]
    if w.act_quant and x2.shape[0] >= W8A8_MIN_TOKENS:
        # W8A8 through XLA's native fp8 dot: fp8 operands, f32 accumulation, both scales after.
        xq, x_scale = quantize_tokens_fp8(x2)
        y = jax.lax.dot_general(xq, w.q, _CONTRACT_IN, preferred_element_type=w8a8_dot_dtype(x))
        y = y.astype(jnp.float32) * x_scale * w.scale
    elif w.scale.ndim == 1 and not w.is_packed:  # per channel: the scale after the dot
        y = jax.lax.dot_general(
            x2, w.q.astype(x.dtype), _CONTRACT_IN, preferred_element_type=jnp.float32
        )
        y = y * w.scale
    else:  # per group: each group's scale applies before its inputs are summed
        y = jax.lax.dot_general(
            x2, dequantize(w, x.dtype), _CONTRACT_IN, preferred_element_type=jnp.float32
        )
    return y.astype(out_dtype or x.dtype).reshape(*lead, *w.out_shape)


# What the W8A8 dot writes (``w8a8_dot_dtype``): ``auto``, or ``float32`` (what it wrote before,
# to compare the two in one benchmark run). Read at trace time.
W8A8_DOT_DTYPE_ENV = "JAXSERVE_W8A8_DOT_DTYPE"


def w8a8_dot_dtype(x: jax.Array) -> Any:
    """What the W8A8 dot writes: 16-bit activations' own dtype, else float32. Summed in f32
    either way; the scales multiply in f32 after it (a second rounding, within bf16's half ulp,
    well under fp8's own error), and XLA fuses them into the GEMM's consumer. A float32 result
    is written and read back at twice the bytes: at 474 decoding sequences (Llama-3-8B, fp8),
    about 2.6 GB a step."""
    if env_choice(W8A8_DOT_DTYPE_ENV, ("auto", "float32"), "auto") == "float32":
        return jnp.float32
    return x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.float32


def _cpu_upcasts(x: jax.Array, w: jax.Array, out_dtype: Any) -> bool:
    """Whether a 16-bit matmul summed into f32 takes f32 operands: on the CPU, whose runtime
    has no bf16 x bf16 -> f32 dot inside some fusions ("Unsupported element type for
    DotThunk", an EAGLE-3 head's logits in bf16). Exact: every bf16 and f16 is an f32."""
    return (
        out_dtype == jnp.float32
        and x.dtype != out_dtype
        and w.dtype == x.dtype
        and jax.default_backend() == "cpu"
    )


# Batch-invariant mode's GEMM rows. A decode step of up to 128 sequences costs about what it
# did on a GPU (the GEMM reads the weights once and stays memory-bound: on the H200 bf16 turns
# compute-bound near 200 rows); a prefill step re-reads the weights once per 128 rows, and a
# smaller bucket computes padding rows up to 128.
INVARIANT_ROW_TILE = 128


# NOTE: a loop over tiles, not one batched dot over [tiles, tile, H]: a weight with
# no batch axis lets XLA fold the tiles back into one GEMM of every row (which then picks its
# algorithm, and on GPUs its split of the reduction, by the row count). Inside the loop each
# GEMM has the one shape [row_tile, in], so every step of every bucket runs the same algorithm
# and each row is reduced in the same order. On the CPU both forms were bitwise invariant; an
# untiled float32 GEMM was not (a row alone and the same row among 2-16 differed by 5e-5).
def tiled_rows(
    fn: Callable[[jax.Array], jax.Array],  # [row_tile, ...] -> [row_tile, ...], row by row
    x: jax.Array,  # [T, ...]
    row_tile: int,
) -> jax.Array:  # [T, ...]
    """``fn`` over ``x``'s rows, ``row_tile`` at a time: the rows padded with zeros to whole
    tiles, each tile one call of the one shape."""
    num_rows = x.shape[0]
    num_tiles = -(-num_rows // row_tile)
    padding = num_tiles * row_tile - num_rows
    tiles = jnp.pad(x, ((0, padding),) + ((0, 0),) * (x.ndim - 1))
    tiles = tiles.reshape(num_tiles, row_tile, *x.shape[1:])
    tile_out = jax.eval_shape(fn, tiles[0])
    # (fresh_full: a start of this call's own, which XLA cannot merge with other calls')
    out = fresh_full(x, (num_tiles, *tile_out.shape), 0, tile_out.dtype)

    def one_tile(i: jax.Array, out: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_index_in_dim(out, fn(tiles[i]), i, 0)

    out = jax.lax.fori_loop(0, num_tiles, one_tile, out)
    return out.reshape(num_tiles * row_tile, *out.shape[2:])[:num_rows]


def weight_layout(spec: str) -> tuple[str, int] | None:
    """How ``spec`` reads its weight: ``("kn", num_in_axes)`` for x ``[T, *in]`` times a weight
    ``[*in, *out]`` into ``[T, *out]`` (``"TND,NDH->TH"``), ``("nk", ...)`` for a weight
    ``[*out, *in]`` (``"NH,VH->NV"``, a tied embedding); None for any other einsum."""
    inputs, out = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    lead, x_in = x_axes[:1], x_axes[1:]
    w_out = "".join(a for a in w_axes if a not in x_in)
    if out != lead + w_out or not x_in or lead in w_axes:
        return None
    if w_axes == x_in + w_out:
        return "kn", len(x_in)
    if w_axes == w_out + x_in:
        return "nk", len(x_in)
    return None


def _fp8_matmul(x: jax.Array, w: QArray, out_dtype: Any) -> jax.Array | None:
    """``linear`` on the fp8-matmul kernel (``pallas_kernels.fp8_matmul``), when this step
    takes it (its rows of x: the token bucket) and the weight is fp8 with per-channel scales;
    else None. A W8A8 weight stays W8A8 there (x quantized per token), any other is read
    weight-only (x in float16)."""
    lead = x.shape[: x.ndim - len(w.in_shape)]
    num_rows = math.prod(lead)
    mode = fp8_dispatch.takes(num_rows)
    if mode is None or w.scale.ndim != 1 or w.zero is not None or w.g_idx is not None:
        return None
    x2 = x.reshape(num_rows, -1)  # [T, in]
    q, scale = jnp.asarray(w.q), jnp.asarray(w.scale)
    if fp8_mosaic.unsupported_reason(x2, q, scale, fp8_mosaic.Fp8MatmulConfig()) is not None:
        return None
    y = fp8_mosaic.fp8_matmul(
        x2,
        q,
        scale,
        act_quant=w.act_quant,
        out_dtype=out_dtype,
        interpret=mode == "interpret",
    )
    return y.reshape(*lead, *w.out_shape)


def _skinny_matmul(
    x: jax.Array, w: jax.Array | QArray, spec: str, out_dtype: Any
) -> jax.Array | None:
    """``linear`` on the skinny-matmul kernel, when this step (its rows of x: the token
    bucket) takes it and the kernel takes the weight; else None."""
    lead = x.shape[: x.ndim - len(w.in_shape)] if isinstance(w, QArray) else x.shape[:1]
    num_rows = math.prod(lead)
    mode = skinny_dispatch.takes(num_rows)
    if mode is None:
        return None
    scale: jax.Array | None = None  # f32[out]
    if isinstance(w, QArray):  # per-channel 8-bit values, [out, in], read weight-only
        if w.is_packed or w.scale.ndim != 1 or (w.act_quant and num_rows >= W8A8_MIN_TOKENS):
            return None
        layout, w2, scale, out_shape = "nk", jnp.asarray(w.q), jnp.asarray(w.scale), w.out_shape
    else:  # [*in, *out] ("kn") or [*out, *in] ("nk"), as the einsum says
        how = weight_layout(spec)
        if how is None:
            return None
        layout, num_in = how
        out_shape = w.shape[num_in:] if layout == "kn" else w.shape[: w.ndim - num_in]
        num_out = math.prod(out_shape)
        w2 = w.reshape((-1, num_out) if layout == "kn" else (num_out, -1))
    x2 = x.reshape(num_rows, -1)  # [T, in]
    if skinny_triton.unsupported_reason(x2, w2, scale, layout) is not None:
        return None
    y = skinny_triton.skinny_matmul(
        x2, w2, scale, w_layout=layout, out_dtype=out_dtype, interpret=mode == "interpret"
    )
    return y.reshape(*lead, *out_shape)


# -- quantizing bf16 weights (on load and for dummy weights) -----------------------------------

WEIGHT_FORMATS = ("fp8", "int8")


def channel_scale(xp: Any, amax: Any, limit: float) -> tuple[Any, Any]:
    """Each channel's scale (``amax / limit``) and its reciprocal, the values being quantized as
    ``w * reciprocal``. XLA compiles a division by a constant, or by a broadcast, into a product
    with the reciprocal; written so here, the host (loading) and the device (dummy weights) round
    every scale and value alike."""
    scale = xp.maximum(amax, 1e-12) * (1.0 / limit)
    return scale, 1.0 / scale


def quantize(
    w: Any,  # [out, in], numpy (on the host) or a jax.Array (on the device)
    weight_format: str,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    act_quant: bool = False,
) -> QArray:
    """Symmetric per-output-channel quantization: fp8 e4m3 (amax -> 448) or int8 (-> 127)."""
    xp: Any = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    amax = xp.max(xp.abs(w32), axis=1)
    if weight_format == "fp8":
        scale, inv = channel_scale(xp, amax, FP8_MAX)
        fp8 = ml_dtypes.float8_e4m3fn if xp is np else FP8
        q = xp.clip(w32 * inv[:, None], -FP8_MAX, FP8_MAX).astype(fp8)
    elif weight_format == "int8":
        scale, inv = channel_scale(xp, amax, INT8_MAX)
        q = xp.clip(xp.round(w32 * inv[:, None]), -INT8_MAX, INT8_MAX).astype(xp.int8)
    else:
        raise ValueError(f"weight_format={weight_format!r} must be one of {WEIGHT_FORMATS}")
    return QArray(
        q=q,
        scale=scale.astype(xp.float32),
        in_shape=in_shape,
        out_shape=out_shape,
        act_quant=act_quant,
    )


def quantize_experts(
    w: Any,  # [E, in, out] (the model's layout of stacked experts), numpy or a jax.Array
    weight_format: str,
) -> QArray:
    """Stacked experts quantized as ``quantize`` quantizes a Linear weight: one scale per
    (expert, output channel), the values kept in the grouped matmul's layout [E, in, out]."""
    xp: Any = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    amax = xp.max(xp.abs(w32), axis=1)  # [E, out]
    if weight_format == "fp8":
        scale, inv = channel_scale(xp, amax, FP8_MAX)
        fp8 = ml_dtypes.float8_e4m3fn if xp is np else FP8
        q = xp.clip(w32 * inv[:, None, :], -FP8_MAX, FP8_MAX).astype(fp8)
    elif weight_format == "int8":
        scale, inv = channel_scale(xp, amax, INT8_MAX)
        q = xp.clip(xp.round(w32 * inv[:, None, :]), -INT8_MAX, INT8_MAX).astype(xp.int8)
    else:
        raise ValueError(f"weight_format={weight_format!r} must be one of {WEIGHT_FORMATS}")
    return QArray(
        q=q,
        scale=scale.astype(xp.float32),
        in_shape=(w.shape[1],),
        out_shape=(w.shape[2],),
    )


def to_out_in(w: Any, num_in_axes: int) -> Any:
    """A weight in the model's layout ``[*in, *out]`` -> ``[out, in]`` (flattened)."""
    num_in = math.prod(w.shape[:num_in_axes])
    return w.reshape(num_in, -1).T
