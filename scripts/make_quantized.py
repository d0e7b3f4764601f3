"""Write pre-quantized copies of a Hugging Face model directory, in the published layouts.

    python scripts/make_quantized.py SRC_DIR DST_DIR --format awq

Formats (``FORMATS``): ``fp8`` (vLLM's per-tensor ``weight_scale``), ``fp8-block`` (128x128
``weight_scale_inv`` blocks as Qwen3 and DeepSeek publish; ``--block`` sets the size),
``compressed-tensors`` (float8, per-channel ``weight_scale`` [out, 1], as Red Hat / Neural Magic
publish), ``awq`` (AutoAWQ gemm: asymmetric 4-bit, ``qweight`` [in, out / 8] in AutoAWQ's column
order) and ``gptq`` (AutoGPTQ v1: symmetric 4-bit, ``qweight`` [in / 8, out], zero points stored
minus one, ``desc_act`` with a shuffled ``g_idx``). Only the Linear weights of the decoder layers
are quantized (not the embedding or lm_head), in numpy, with round-to-nearest (no calibration:
these are fixtures for the loader, not good quantizations). The tests make them from the fixture
models under ``tests/fixtures/models/``; every tensor is written by ``write_safetensors`` (the
safetensors numpy writer has no float8).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

FORMATS = ("fp8", "fp8-block", "compressed-tensors", "awq", "gptq")
FP8_MAX = 448.0
# The Linear weights of a decoder layer, as Hugging Face names them (fused ones included).
LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight$"
)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_DTYPE_NAMES = {
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format by hand: a little-endian u64 header size, the JSON header, data."""
    header: dict[str, dict] = {}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = np.ascontiguousarray(tensor).tobytes()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def pack(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """u8[..., 8 n] values 0..15 -> i32[..., n]: nibble i (bits 4i) holds value order[i]."""
    groups = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(groups.shape[:-1], np.uint32)
    for nibble, column in enumerate(order):
        words |= groups[..., column] << np.uint32(4 * nibble)
    return words.view(np.int32)


def fp8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def quantize_fp8_tensor(base: str, w: np.ndarray) -> dict[str, np.ndarray]:
    scale = np.float32(np.abs(w).max() / FP8_MAX)
    return {f"{base}.weight": fp8(w, scale), f"{base}.weight_scale": np.asarray(scale)}


def quantize_fp8_block(base: str, w: np.ndarray, block: int) -> dict[str, np.ndarray]:
    num_out, num_in = w.shape
    blocks = w.reshape(num_out // block, block, num_in // block, block)
    scale = (np.abs(blocks).max(axis=(1, 3)) / FP8_MAX).astype(np.float32)  # [out/b, in/b]
    expanded = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)
    return {f"{base}.weight": fp8(w, expanded), f"{base}.weight_scale_inv": scale}


def quantize_fp8_channel(base: str, w: np.ndarray) -> dict[str, np.ndarray]:
    scale = (np.abs(w).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)  # [out, 1]
    return {f"{base}.weight": fp8(w, scale), f"{base}.weight_scale": scale}


def quantize_awq(base: str, w: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Asymmetric 4-bit per group of inputs: w ~= (q - zero) * scale."""
    wt = w.T.reshape(-1, group, w.shape[0])  # [G, group, out]
    lo, hi = wt.min(axis=1), wt.max(axis=1)  # [G, out]
    scale = np.maximum(hi - lo, 1e-6) / 15
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(wt / scale[:, None]) + zero[:, None], 0, 15).reshape(w.shape[1], -1)
    return {
        f"{base}.qweight": pack(q.astype(np.uint8), AWQ_PACK_ORDER),  # [in, out / 8]
        f"{base}.qzeros": pack(zero.astype(np.uint8), AWQ_PACK_ORDER),  # [G, out / 8]
        f"{base}.scales": scale.astype(np.float16),  # [G, out]
    }


def quantize_gptq(base: str, w: np.ndarray, group: int, seed: int) -> dict[str, np.ndarray]:
    """Symmetric 4-bit (zero point 8) over groups of inputs in a shuffled (act) order."""
    num_out, num_in = w.shape
    order = np.random.default_rng(seed).permutation(num_in)  # inputs in "activation" order
    g_idx = np.empty(num_in, np.int32)
    g_idx[order] = np.arange(num_in) // group
    num_groups = num_in // group
    scale = np.empty((num_groups, num_out), np.float32)
    for g in range(num_groups):
        scale[g] = np.maximum(np.abs(w[:, g_idx == g]).max(axis=1), 1e-6) / 7
    scale = scale.astype(np.float16)
    per_input = scale[g_idx].astype(np.float32)  # [in, out]
    q = np.clip(np.round(w.T / per_input) + 8, 0, 15).astype(np.uint8)  # [in, out]
    zeros = np.full((num_groups, num_out), 8 - 1, np.uint8)  # v1: stored minus one
    return {
        f"{base}.qweight": pack(q.T).T.copy(),  # [in / 8, out], eight inputs per word
        f"{base}.qzeros": pack(zeros),  # [G, out / 8]
        f"{base}.scales": scale,  # [G, out]
        f"{base}.g_idx": g_idx,
    }


def quantization_config(fmt: str, group: int, block: int) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
            "modules_to_not_convert": ["lm_head"],
        }
    if fmt == "compressed-tensors":
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
        }
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "version": "gemm",
            "zero_point": True,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
    }


def make_quantized(src: Path, dst: Path, fmt: str, group: int = 32, block: int = 128) -> Path:
    """Copy ``src`` to ``dst`` with its Linear weights quantized to ``fmt``; returns ``dst``."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} must be one of {FORMATS}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            for seed, name in enumerate(f.keys()):
                tensor = f.get_tensor(name)
                if not LINEAR.search(name):
                    tensors[name] = tensor
                    continue
                w, base = tensor.astype(np.float32), name.removesuffix(".weight")
                if fmt == "fp8":
                    tensors |= quantize_fp8_tensor(base, w)
                elif fmt == "fp8-block":
                    tensors |= quantize_fp8_block(base, w, block)
                elif fmt == "compressed-tensors":
                    tensors |= quantize_fp8_channel(base, w)
                elif fmt == "awq":
                    tensors |= quantize_awq(base, w, group)
                else:
                    tensors |= quantize_gptq(base, w, group, seed)
    write_safetensors(dst / "model.safetensors", tensors)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "golden.npz"):
            shutil.copy(file, dst / file.name)
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--group-size", type=int, default=32, help="AWQ / GPTQ inputs per group")
    parser.add_argument("--block", type=int, default=128, help="fp8-block: block edge")
    args = parser.parse_args()
    make_quantized(args.src, args.dst, args.format, args.group_size, args.block)
    print(f"wrote {args.dst} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
