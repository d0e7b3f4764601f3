"""``jaxserve capacity``: how many tokens of KV cache fit, without loading weights.

Reads only ``config.json`` and prints what ``jaxserve launch`` would log at start-up (weight
memory, KV bytes per token, blocks, tokens, maximum concurrency at full context), from the same
function (``jaxserve.runner.capacity.plan_capacity``), for the current device or a named one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from jaxserve.config import ModelConfig
from jaxserve.engine_config import default_model_dir
from jaxserve.models.families import num_params
from jaxserve.runner.capacity import (
    DEVICE_MEMORY_BYTES,
    CapacityError,
    GiB,
    detect_device_memory,
    plan_capacity,
)
from jaxserve.runner.input_builder import next_power_of_2, token_buckets_for
from jaxserve.units import human_int

KV_DTYPE_BYTES = {
    "auto": None,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_memory(text: str) -> int:
    """'141GB', '80 GiB', 'H200', '17179869184' -> bytes."""
    for name, size in DEVICE_MEMORY_BYTES.items():
        if text.strip().lower() == name.lower():
            return size
    match = _SIZE.match(text)
    if not match:
        names = ", ".join(DEVICE_MEMORY_BYTES)
        raise argparse.ArgumentTypeError(
            f"--device-memory {text!r}: give a size like 141GB / 80GiB or a device: {names}"
        )
    unit = (match.group(2) or "").lower().rstrip("b")
    return int(float(match.group(1)) * _UNITS[unit])


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory with config.json (default: the demo model)",
    )
    parser.add_argument(
        "--max-model-len",
        type=human_int,
        default=None,
        help="context per request (8192, 8k = 8000, 8K = 8192; default: the model's maximum)",
    )
    parser.add_argument(
        "--memory-utilization",
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        dest="memory_utilization",
        help="fraction of device memory jaxserve may use",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_memory,
        default=None,
        help="device memory as a size (141GB) or a device name "
        f"({', '.join(DEVICE_MEMORY_BYTES)}); default: the current device",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPE_BYTES),
        help="weight dtype (auto = bfloat16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(KV_DTYPE_BYTES),
        help="KV cache dtype (auto = the weight dtype)",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=human_int, default=2048)
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def run_capacity(args: argparse.Namespace) -> int:
    model_dir = args.model or str(default_model_dir())
    try:
        config = ModelConfig.from_hf_dir(model_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    max_model_len = args.max_model_len or config.max_position_embeddings
    memory = args.device_memory if args.device_memory is not None else detect_device_memory()
    try:
        cap = plan_capacity(
            config,
            max_model_len=max_model_len,
            device_memory_bytes=memory,
            memory_utilization=args.memory_utilization,
            dtype_bytes=DTYPE_BYTES[args.dtype],
            kv_dtype_bytes=KV_DTYPE_BYTES[args.kv_cache_dtype],
            block_size=args.block_size,
            tensor_parallel_size=args.tensor_parallel_size,
            max_num_batched_tokens=token_buckets_for(args.max_num_batched_tokens)[-1],
            max_num_seqs=next_power_of_2(args.max_num_seqs),
        )
    except CapacityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "model": model_dir,
                    "device_memory_bytes": memory,
                    "memory_utilization": args.memory_utilization,
                    "weight_bytes": cap.weight_bytes,
                    "activation_bytes": cap.activation_bytes,
                    "kv_budget_bytes": cap.kv_budget_bytes,
                    "kv_bytes_per_token": cap.kv_bytes_per_token,
                    "block_size": cap.block_size,
                    "num_blocks": cap.num_blocks,
                    "kv_cache_tokens": cap.num_tokens,
                    "max_model_len": cap.max_model_len,
                    "max_concurrency": cap.max_concurrency,
                },
                indent=2,
            )
        )
        return 0
    print(f"Model: {model_dir} ({config.model_type}, {num_params(config) / 1e9:.2f}B parameters)")
    print(
        f"Device memory: {memory / GiB:.2f} GiB x {args.memory_utilization:.0%} utilization, "
        f"tensor parallel {args.tensor_parallel_size}"
    )
    for line in cap.lines():
        print(line)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="jaxserve capacity", description=__doc__.splitlines()[0])
    add_capacity_arguments(parser)
    return run_capacity(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
