"""Which quantization a model is served with: ``--quantization`` and the checkpoint's own.

``resolve_scheme`` reads ``quantization_config`` from the model's config.json (pre-quantized
checkpoints: ``fp8``, ``compressed-tensors`` float8, ``awq``, ``gptq``) and the requested
``--quantization`` (``fp8`` or ``int8``: bf16 weights quantized on load), and returns one
``QuantScheme`` or None (unquantized). The runner then checks it against the device
(``check_device``); the loader, dummy weights, sharding and capacity planning all read it.
Anything it cannot serve exactly is a ``QuantizationError`` naming the format and the value,
never a fall back to bf16.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.engine_config import ON_LOAD_QUANTIZATIONS
from jaxserve.models.families.counting import num_float32_params, num_params
from jaxserve.models.families.fields import WeightField, dim_sizes
from jaxserve.models.families.registry import layer_fields
from jaxserve.models.quant import PACK, QUANTIZED_EXPERT_FIELDS, QUANTIZED_FIELDS

# What --quantization accepts: the two quantize-on-load modes, and the checkpoint methods
# (naming one checks that the checkpoint has it, as vLLM does).
ON_LOAD_METHODS = ON_LOAD_QUANTIZATIONS  # --quantization modes for a bf16 checkpoint
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
FP8_MIN_COMPUTE_CAPABILITY = 8.9  # Ada and Hopper: the first NVIDIA GPUs with fp8


class QuantizationError(ValueError):
    """A quantization this build or this device cannot serve: names the format and the value."""


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    method: str  # fp8 | int8 (on load), or the checkpoint's quant_method
    weight_format: str  # fp8 | int8 | int4
    from_checkpoint: bool = False
    group_size: int | None = None  # inputs per scale; None: one scale per output channel
    out_block: int = 1  # fp8 block scales: output rows sharing a scale
    scale_name: str = "weight_scale"  # fp8 checkpoints: the scale tensor's suffix
    has_zero: bool = False  # 4-bit: zero points per group
    has_g_idx: bool = False  # GPTQ act order (desc_act): a group index per input
    zero_offset: int = 0  # GPTQ v1 stores zero points minus one
    awq: bool = False  # AWQ's interleaved packing along out
    act_quant: bool = False  # W8A8 (set by check_device: fp8 tensor cores)

    def describe(self) -> str:
        """The start-up line's words."""
        if self.weight_format == "int4":
            layout = f"4-bit, groups of {self.group_size}" + (
                ", act order" if self.has_g_idx else ""
            )
        elif self.group_size is not None:
            layout = f"{self.weight_format}, {self.out_block}x{self.group_size} block scales"
        else:
            layout = f"{self.weight_format}, per-channel scales"
        source = f"{self.method} checkpoint" if self.from_checkpoint else "quantized on load"
        matmul = (
            "W8A8 on fp8 tensor cores (dynamic per-token activation scales)"
            if self.act_quant
            else "weight-only (dequantized inside the matmul)"
        )
        return f"Quantization: {source} ({layout}); {matmul}; embedding and lm_head unquantized"


def read_quantization_config(model_dir: Path) -> dict[str, Any] | None:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    raw = json.loads(config_path.read_text())
    qc = raw.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def _ignored(qc: dict[str, Any], key: str) -> None:
    """Modules a checkpoint leaves unquantized: only lm_head (which is never quantized here)."""
    names = [
        n for n in (qc.get(key) or []) if n.split(".")[-1] != "lm_head" and n != "re:.*lm_head"
    ]
    if names:
        raise QuantizationError(
            f"quantization_config.{key}={names}: checkpoints with unquantized Linear layers "
            "other than lm_head are not supported"
        )


def _fp8_block(block: Any, where: str) -> tuple[int, int | None]:
    if block is None:
        return 1, None
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise QuantizationError(f"{where}={block!r} must be [output rows, input columns]")
    return int(block[0]), int(block[1])


def parse_checkpoint(qc: dict[str, Any]) -> QuantScheme:
    """The scheme of a config.json ``quantization_config`` (raises for what is not served)."""
    method = qc.get("quant_method")
    if method == "mxfp4":  # GPT-OSS's published checkpoints: 4-bit experts, 8-bit shared scales
        raise QuantizationError(
            "quantization_config.quant_method='mxfp4' (GPT-OSS's MXFP4 experts) is not "
            "supported; serve a bf16 checkpoint of the model (one without quantization_config, "
            "its experts stored as bf16 gate_up_proj / down_proj tensors)"
        )
    # NOTE: activations are always scaled per token, dynamically (vLLM's choice for fp8 on
    # Hopper); a checkpoint's static input_scale tensors (activation_scheme "static") are not
    # read: a per-token scale is never coarser than one calibrated per tensor.
    if method == "fp8":
        return _parse_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method in ("awq", "gptq"):
        return _parse_int4(qc, method)
    raise QuantizationError(
        f"quantization_config.quant_method={method!r} is not supported; supported: "
        f"{', '.join(CHECKPOINT_METHODS)}"
    )


def _parse_fp8(qc: dict[str, Any]) -> QuantScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 checkpoint fmt={fmt!r} is not supported; only e4m3")
    _ignored(qc, "ignored_layers")
    _ignored(qc, "modules_to_not_convert")
    out_block, group = _fp8_block(qc.get("weight_block_size"), "weight_block_size")
    return QuantScheme(
        method="fp8",
        weight_format="fp8",
        from_checkpoint=True,
        group_size=group,
        out_block=out_block,
        scale_name="weight_scale_inv" if group else "weight_scale",
    )


def _parse_int4(qc: dict[str, Any], method: str) -> QuantScheme:
    """AWQ (GEMM layout, zero points) or GPTQ (v1 or v2 zero points, optional g_idx)."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"{method} checkpoint bits={bits!r} is not supported; only 4")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0 or group % PACK:
        raise QuantizationError(
            f"{method} checkpoint group_size={group!r} is not supported; a positive "
            f"multiple of {PACK} (per-channel -1 is not)"
        )
    if qc.get("lm_head"):
        raise QuantizationError(f"{method} checkpoint lm_head=true is not supported")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(
                f"awq checkpoint version={version!r} is not supported; only 'gemm'"
            )
        if qc.get("zero_point", True) is not True:
            raise QuantizationError("awq checkpoint zero_point=false is not supported")
        _ignored(qc, "modules_to_not_convert")
        return QuantScheme(
            method="awq",
            weight_format="int4",
            from_checkpoint=True,
            group_size=group,
            has_zero=True,
            awq=True,
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"gptq checkpoint_format={fmt!r} is not supported; only 'gptq' and 'gptq_v2'"
        )
    return QuantScheme(
        method="gptq",
        weight_format="int4",
        from_checkpoint=True,
        group_size=group,
        has_zero=True,
        has_g_idx=bool(qc.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantScheme:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors format={fmt!r} with {len(groups)} config group(s) is not "
            "supported; only float-quantized (fp8) with one config group"
        )
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise QuantizationError(
            f"compressed-tensors weights type={weights.get('type')!r} "
            f"num_bits={weights.get('num_bits')!r} is not supported; only float 8"
        )
    _ignored(qc, "ignore")
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        out_block, group = 1, None
    elif strategy == "block":
        out_block, group = _fp8_block(weights.get("block_structure"), "block_structure")
    else:
        raise QuantizationError(
            f"compressed-tensors weights strategy={strategy!r} is not supported; "
            "only tensor, channel and block"
        )
    return QuantScheme(
        method="compressed-tensors",
        weight_format="fp8",
        from_checkpoint=True,
        group_size=group,
        out_block=out_block,
    )


def resolve_scheme(
    quantization: str | None, model_dir: Path, load_format: str = "auto"
) -> QuantScheme | None:
    """The scheme served: the checkpoint's (``quantization`` must then name it, or be None),
    else the requested quantize-on-load mode, else None."""
    qc = read_quantization_config(model_dir)
    if qc is not None:
        if load_format == "dummy":
            raise QuantizationError(
                f"load_format='dummy' with a quantized checkpoint config "
                f"(quant_method={qc.get('quant_method')!r}) is not supported; use the config "
                "without quantization_config and --quantization fp8 or int8"
            )
        scheme = parse_checkpoint(qc)
        if quantization is not None and quantization != scheme.method:
            raise QuantizationError(
                f"quantization={quantization!r} does not match the checkpoint's "
                f"quantization_config.quant_method={scheme.method!r} in {model_dir}"
            )
        return scheme
    if quantization is None:
        return None
    if quantization not in ON_LOAD_METHODS:
        raise QuantizationError(
            f"quantization={quantization!r} needs a checkpoint quantized so, but {model_dir} "
            f"has no quantization_config; bf16 checkpoints quantize on load with "
            f"{' or '.join(ON_LOAD_METHODS)}"
        )
    return QuantScheme(method=quantization, weight_format=quantization)


def check_device(
    scheme: QuantScheme, platform: str, device_kind: str, compute_capability: float | None
) -> QuantScheme:
    """Refuse what the device cannot run; turn on W8A8 where fp8 tensor cores serve it."""
    is_fp8 = scheme.weight_format == "fp8"
    if is_fp8 and platform == "gpu" and compute_capability is not None:
        if compute_capability < FP8_MIN_COMPUTE_CAPABILITY:
            raise QuantizationError(
                f"quantization={scheme.method!r} (fp8 weights) needs a GPU with fp8 support "
                f"(compute capability {FP8_MIN_COMPUTE_CAPABILITY} or newer); {device_kind} "
                f"has {compute_capability}"
            )
    # NOTE: W8A8 only for per-channel fp8 on an fp8 GPU; block scales change along the
    # contraction, which one fp8 dot cannot apply, so they dequantize inside the matmul.
    act_quant = is_fp8 and platform == "gpu" and scheme.group_size is None
    return dataclasses.replace(scheme, act_quant=act_quant)


def qarray_layout(
    field: WeightField, config: ModelConfig, scheme: QuantScheme
) -> dict[str, tuple[tuple[int, ...], int]]:
    """A quantized field's ``QArray`` parts: name -> (shape, bytes per element)."""
    sizes = dim_sizes(config)
    num_out = math.prod(sizes[d] for d in field.hf_shape[0])
    num_in = math.prod(sizes[d] for d in field.hf_shape[1])
    parts: dict[str, tuple[tuple[int, ...], int]]
    if scheme.weight_format == "int4":
        parts = {"q": ((num_out, num_in // PACK), 4)}
    else:
        parts = {"q": ((num_out, num_in), 1)}
    if scheme.group_size is None:
        parts["scale"] = ((num_out,), 4)
    else:
        num_groups = num_in // scheme.group_size
        parts["scale"] = ((num_out, num_groups), 4)
        if scheme.has_zero:
            parts["zero"] = ((num_out, num_groups), 1)
    if scheme.has_g_idx:
        parts["g_idx"] = ((num_in,), 4)
    return parts


def quantized_field_bytes(field: WeightField, config: ModelConfig, scheme: QuantScheme) -> int:
    """Device bytes of one quantized Linear weight (values, scales, zero points, g_idx)."""
    layout = qarray_layout(field, config, scheme)
    return sum(math.prod(shape) * itemsize for shape, itemsize in layout.values())


def quantized_experts_bytes(field: WeightField, config: ModelConfig) -> int:
    """Device bytes of one layer's quantized routed experts (``quant.quantize_experts``):
    values [E, in, out] at one byte each, f32 scales [E, out]."""
    num_experts, num_in, num_out = field.shape_for(config)
    return num_experts * num_in * num_out + num_experts * num_out * 4


def weight_bytes(config: ModelConfig, dtype_bytes: int, scheme: QuantScheme | None) -> int:
    """Bytes the weights occupy on the device (all of them, before tensor parallelism); the
    ones kept in float32 (``WeightField.is_float32``) at 4 bytes. With a ``scheme`` the
    Linear weights and the routed experts count as quantized (values and scales)."""
    float32_extra = num_float32_params(config) * max(0, 4 - dtype_bytes)
    if scheme is None:
        return num_params(config) * dtype_bytes + float32_extra
    total = 0
    unquantized = num_params(config)
    for layer in range(config.num_layers):
        for field in layer_fields(config, layer):
            if field.name in QUANTIZED_FIELDS:
                total += quantized_field_bytes(field, config, scheme)
            elif field.name in QUANTIZED_EXPERT_FIELDS:
                total += quantized_experts_bytes(field, config)
            else:
                continue
            unquantized -= math.prod(field.shape_for(config))
    return total + unquantized * dtype_bytes + float32_extra
