"""What one compiled model step launches: the step of one token bucket, compiled by the
engine's own programs (dummy weights), its optimized HLO written out and its kernels listed by
``benchmarks.hlo_kernels``. Issue 36 counted about 430 small kernels in the Llama-3-8B batch-1
step, and issue 40's embedding step spends a third of its time in element-wise fusions: this
names them.

    python -m benchmarks.probes.step_kernels --bucket 16 --out-dir $OUT            # decode, b=1
    python -m benchmarks.probes.step_kernels --bucket 16 --max-loras 8 --out-dir $OUT  # LoRA on
    python -m benchmarks.probes.step_kernels --runner pooling --bucket 16384 \\
        --model jaxserve/assets/configs/qwen3-embedding-0.6b --out-dir $OUT          # embeddings
    python -m benchmarks.probes.step_kernels --smoke --out-dir /tmp/sk             # CPU fixture

``--deviceless h100`` (or ``h200``) compiles the step for that GPU on a machine without one
(``benchmarks/deviceless.py``: the CUDA plugin's compile-only device, abstract weights; its
GEMMs are the heuristics' Triton fusions, not the autotuner's picks):

    .venv-deviceless/bin/python -m benchmarks.probes.step_kernels --deviceless h100 \\
        --bucket 512 --quantization fp8 --kv-cache-dtype fp8 --out-dir /tmp/sk
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path
from typing import Any

from benchmarks import hlo_kernels
from jaxserve.config import builtin_config_dir
from jaxserve.runner.pooling_attention import POOLING_ATTENTION_ENV


def step_hlo(args: argparse.Namespace) -> str:
    """The optimized HLO text of the step of ``args.bucket`` tokens."""
    import jaxserve

    llm = jaxserve.LLM(
        args.model,
        runner=args.runner,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.bucket, args.max_num_batched_tokens),
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.runner == "generate",
        warmup=False,
        num_gpu_blocks_override=args.num_blocks,
        **({"quantization": args.quantization} if args.quantization else {}),
        **(
            {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": 16}
            if args.max_loras
            else {}
        ),
    )
    runner: Any = llm.engine.runner
    try:
        return runner.programs.lower_step(args.bucket).compile().as_text()
    finally:
        llm.shutdown()


def deviceless_hlo(args: argparse.Namespace) -> str:
    """The optimized HLO text of the step, compiled for ``args.deviceless`` without a GPU."""
    from benchmarks import deviceless

    whole = args.runner == "pooling" and os.environ.get(POOLING_ATTENTION_ENV) == "whole"
    spec = deviceless.StepSpec(
        Path(args.model),
        args.bucket,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_loras=args.max_loras,
        whole_prompts=whole,
        num_pages=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    return deviceless.step_hlo(spec, args.deviceless)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--runner", default="generate", choices=("generate", "pooling"))
    parser.add_argument("--bucket", type=int, default=16, help="the step's token bucket")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--max-loras", type=int, default=0, help="LoRA slots of rank 16 (0: off)")
    parser.add_argument(
        "--deviceless",
        choices=("h100", "h200"),
        help="compile for this GPU without one (the CUDA plugin's compile-only device)",
    )
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="the tiny fixture, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        from tests.conftest import fixture_dir

        args.model, args.max_model_len, args.num_blocks = str(fixture_dir("llama")), 256, 64
    if args.kv_cache_dtype != "auto" and not args.deviceless:
        parser.error("--kv-cache-dtype is for --deviceless (the engine's own flag elsewhere)")
    text = deviceless_hlo(args) if args.deviceless else step_hlo(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    quantized = f"_{args.quantization}" if args.quantization else ""
    quantized += "_fp8kv" if args.kv_cache_dtype == "fp8" else ""
    quantized += f"_{args.deviceless}" if args.deviceless else ""
    lora = f"_lora{args.max_loras}" if args.max_loras else ""
    name = f"step_{Path(args.model).name}_{args.runner}_{args.bucket}{quantized}{lora}"
    with gzip.open(args.out_dir / f"{name}.hlo.txt.gz", "wt") as f:
        f.write(text)
    kernels = hlo_kernels.parse(text)
    rows = hlo_kernels.grouped(kernels)
    (args.out_dir / f"{name}.kernels.json").write_text(
        json.dumps({"kernels": len(kernels), "rows": rows}, indent=1)
    )
    print(f"{name}: {len(kernels)} kernels")
    hlo_kernels.print_rows(rows, args.top)


if __name__ == "__main__":
    main()
