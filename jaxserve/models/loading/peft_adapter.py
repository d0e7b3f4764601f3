"""PEFT LoRA adapters from disk: ``adapter_config.json`` + ``adapter_model.safetensors`` -> host
arrays laid out as one slot of ``models/lora.py``'s stacks, checked against the served model.

What is read: ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``lora_alpha / r``, or ``lora_alpha
/ sqrt(r)``), ``target_modules`` (names, full module paths or ``"all-linear"``),
``base_model_name_or_path`` (named in errors), and each ``...layers.<i>.<self_attn|mlp>.<module>
.lora_<A|B>.weight`` tensor. A is ``[r, in]`` and B ``[out, r]`` in the file (torch's Linear
layout); here A stays ``[R, in]`` and B becomes ``[R, out]`` times the scaling, zero-padded to
``--max-lora-rank`` R. Whatever does not fit the model (an unknown or unsupported module, a
shape of another base model, a rank above the limit, a PEFT feature the product does not
compute) is an ``AdapterError`` naming the field or tensor and the limit. The runner's slots
(``runner/lora_slots.py``) keep the result in host memory and write it into a device slot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from jaxserve.models.lora import LORA_MODULES, LoraShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.weight)?$")
_JOINED = {"q": ("qkv_a", 0, 3), "k": ("qkv_a", 1, 3), "v": ("qkv_a", 2, 3)}
_JOINED |= {"gate": ("gate_up_a", 0, 2), "up": ("gate_up_a", 1, 2)}


class AdapterError(ValueError):
    """An adapter that cannot be served on this model (the message names what and why)."""


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    base_model: str | None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclasses.dataclass
class HostAdapter:
    """One adapter in host memory: per layer, ``LoraLayer`` field -> its slot (no M axis)."""

    path: str
    config: AdapterConfig
    layers: list[dict[str, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer.values())


def read_config(path: Path, max_rank: int) -> AdapterConfig:
    """The adapter's config, checked: a LoRA adapter of rank <= ``max_rank`` that the product
    computes exactly."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in the adapter directory {str(path)!r}")
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: not a JSON file ({exc})") from None
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type={peft_type!r}; only LORA adapters are served")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{file}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise AdapterError(
            f"{file}: r={rank} is above --max-lora-rank={max_rank}; "
            f"start the server with --max-lora-rank {rank} or more"
        )
    unsupported = {
        "use_dora": bool(raw.get("use_dora")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "bias": raw.get("bias", "none") not in ("none", None),
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
    }
    for field, is_set in unsupported.items():
        if is_set:
            raise AdapterError(f"{file}: {field}={raw.get(field)!r} is not supported")
    _check_targets(file, raw.get("target_modules"))
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{file}: lora_alpha={alpha!r} must be a number")
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), base)


def _check_targets(file: Path, targets: Any) -> None:
    """``target_modules``: a list of known module names (or paths ending in one), or a string
    (``"all-linear"`` or a pattern, which the tensors then spell out)."""
    if targets is None or isinstance(targets, str):
        return
    for target in targets:
        name = str(target).rsplit(".", 1)[-1]
        if name not in LORA_MODULES:
            raise AdapterError(
                f"{file}: target_modules has {target!r}, which is not a module LoRA can adapt "
                f"here (supported: {', '.join(LORA_MODULES)})"
            )


def load_adapter(path: str | Path, shapes: LoraShapes) -> HostAdapter:
    """The adapter in ``path``, checked against the model's ``shapes`` and laid out as one slot
    of its stacks (f32, B scaled, zero-padded to ``shapes.max_rank``)."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"the adapter directory {str(path)!r} does not exist")
    config = read_config(path, shapes.max_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        found = sorted(p.name for p in path.iterdir())
        raise AdapterError(f"no {WEIGHTS_FILE} in {str(path)!r} (found {found})")
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types
        raise AdapterError(f"{file}: not a safetensors file ({exc})") from None
    layers = [
        {k: np.zeros(s[1:], np.float32) for k, s in shapes.layer_arrays(i).items()}
        for i in range(len(shapes.dims))
    ]
    pairs = _pairs(file, tensors, shapes)
    if not pairs:
        raise AdapterError(f"{file}: no lora_A / lora_B tensor of a supported module")
    for (layer, module), (a, b) in pairs.items():
        try:
            _place(layers[layer], module, a, b, config, shapes.max_rank)
        except AdapterError as exc:
            raise AdapterError(f"{file}: layer {layer} {exc}") from None
    return HostAdapter(str(path), config, layers)


def _pairs(
    file: Path, tensors: dict[str, np.ndarray], shapes: LoraShapes
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, module) -> (A [r, in], B [out, r]), each checked against the model."""
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _TENSOR.search(key)
        name = match.group(3) if match else None
        if match is None or name not in LORA_MODULES:
            raise AdapterError(
                f"{file}: tensor {key!r} is not a LoRA matrix of a module this server adapts "
                f"(supported: {', '.join(LORA_MODULES)}; experts and embeddings are not)"
            )
        layer, module = int(match.group(1)), LORA_MODULES[name]
        if layer >= len(shapes.dims):
            raise AdapterError(
                f"{file}: tensor {key!r} is for layer {layer}; the model has {len(shapes.dims)}"
            )
        if module not in shapes.dims[layer]:
            raise AdapterError(
                f"{file}: tensor {key!r}: layer {layer} runs experts, and LoRA on experts is "
                "not supported (docs/lora.md)"
            )
        found.setdefault((layer, module), {})[match.group(4)] = value
    pairs = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{file}: layer {layer} {module}: lora_A without lora_B or back")
        pairs[(layer, module)] = (ab["A"], ab["B"])
    return pairs


def _place(
    layer: dict[str, np.ndarray],
    module: str,
    a: np.ndarray,  # [r, in]
    b: np.ndarray,  # [out, r]
    config: AdapterConfig,
    max_rank: int,
) -> None:
    """Write one module's A and B (scaled) into the layer's slot arrays."""
    a_field, part, num_parts = _JOINED.get(module, (f"{module}_a", 0, 1))
    width = layer[a_field].shape[0] // num_parts  # R
    num_in, num_out = layer[a_field].shape[1], layer[f"{module}_b"].shape[1]
    rank = config.rank
    if a.shape != (rank, num_in) or b.shape != (num_out, rank):
        raise AdapterError(
            f"{module}_proj: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit this "
            f"model (r={rank}: lora_A must be [{rank}, {num_in}], lora_B [{num_out}, {rank}]); "
            f"the adapter was made for {config.base_model or 'another base model'!r}"
        )
    assert rank <= max_rank == width
    start = part * width
    layer[a_field][start : start + rank] = a.astype(np.float32)  # [r, in], as PEFT writes it
    layer[f"{module}_b"][:rank] = b.astype(np.float32).T * config.scaling
