"""``jaxserve bench throughput``: offline output tokens/s, jaxserve against Hugging Face.

The same random-token prompts go through ``jaxserve.LLM.generate`` and through transformers'
continuous batching (``generate_batch``), each in its own subprocess (both frameworks want
the accelerator's memory), one after the other; the table gives output tokens/s of each and
the ratio. EOS is ignored, so every request produces exactly ``--output-len`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.config import builtin_config_dir
from jaxserve.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, dtype_name
from jaxserve.flag_names import command_flags, in_flag_terms
from jaxserve.units import COUNT_RULE, human_int

if TYPE_CHECKING:
    import jaxserve


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 30000), size=(num, length)).tolist()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine flags every offline benchmark takes (throughput, latency)."""
    parser.add_argument(
        "--model",
        default=str(builtin_config_dir("llama-3-8b")),
        help="model directory (weights are random when --load-format dummy)",
    )
    parser.add_argument(
        "--load-format",
        default="dummy",
        choices=["auto", "dummy"],
        help="auto: the model's safetensors; dummy: random weights of its shape",
    )
    parser.add_argument(
        "--max-model-len",
        type=human_int,
        default=None,
        help=f"jaxserve's context limit ({COUNT_RULE}; default input + output length); the same "
        "value as a `jaxserve launch` gives the same compiled shapes (one warm cache serves both)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="most requests a step (default: per device)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=human_int,
        default=8192,
        help=f"most tokens in one engine step ({COUNT_RULE})",
    )
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        default="auto",
        help="weights and activations dtype; auto: bfloat16 on accelerators, float32 on the CPU",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="as serve's flag: fp8 / int8 weights quantized on load",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype, as `jaxserve launch` takes it (fp8: one byte per element)",
    )
    block = EngineConfig.block_size
    parser.add_argument("--block-size", type=int, default=block, help="as serve's: KV page tokens")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="as serve's flag: the share of device memory for weights, activations and KV cache",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="as serve's flag: devices"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_speculative_argument(parser)


def add_speculative_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='as serve\'s flag: speculative decoding, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\'; the mean acceptance length is reported',
    )


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--engine",
        default="jaxserve",
        choices=["jaxserve", "hf", "both"],
        help="which engine(s) to run; 'both' runs each in a subprocess",
    )
    parser.add_argument("--output-json", default=None, help="write the result here")


def make_llm(args: argparse.Namespace) -> jaxserve.LLM:
    """``jaxserve.LLM`` from the engine flags (`add_engine_arguments`); the context limit
    defaults to ``--input-len`` + ``--output-len``. A flag out of range, or a model that is not
    there, ends the command with one line that names the flag."""
    import jaxserve
    from jaxserve.runner.capacity import CapacityError

    try:
        return jaxserve.LLM(
            args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len or args.input_len + args.output_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            speculative_config=getattr(args, "speculative_config", None),
        )
    except ValueError as exc:
        flags = command_flags(add_engine_arguments)
        message = in_flag_terms(str(exc), flags)
        if isinstance(exc, CapacityError):  # found before a weight is made, as serve says it
            message = f"{args.model} does not fit: {message}"
        raise SystemExit(f"error: {message}") from None


def run_jaxserve(args: argparse.Namespace) -> dict:
    import jaxserve

    start = time.perf_counter()
    llm = make_llm(args)
    startup = time.perf_counter() - start
    prompts = make_prompts(args.num_prompts, args.input_len, llm.engine.vocab_size, args.seed)
    params = jaxserve.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "engine": "jaxserve",
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "startup_seconds": startup,
        "num_compiled_shapes": llm.engine.num_compiled_shapes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_tokens": llm.engine.runner.capacity.num_tokens,
        "max_num_seqs": llm.engine.config.max_num_seqs,
        "block_size": llm.engine.config.block_size,
    }


def run_hf(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    attempts = ("paged|sdpa", "sdpa_paged", "paged_attention", "sdpa")
    model = None
    for attn in attempts:
        try:
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(
                    config, torch_dtype=torch.bfloat16, attn_implementation=attn
                )
            break
        except (ValueError, KeyError, ImportError):
            continue
    assert model is not None, f"no attention implementation of {attempts} was accepted"
    model.eval()
    prompts = make_prompts(args.num_prompts, args.input_len, config.vocab_size, args.seed)
    gen = GenerationConfig(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    start = time.perf_counter()
    # NOTE: no_grad, not inference_mode: generate_batch fills its static tensors from a worker
    # thread, which may not update inference tensors made here.
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    expected = args.num_prompts * args.output_len
    if generated != expected:
        raise RuntimeError(f"generate_batch produced {generated} of {expected} tokens")
    return {
        "engine": "hf",
        "attn_implementation": model.config._attn_implementation,
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
    }


def hf_unavailable() -> str | None:
    """Why the Hugging Face engine cannot run here (it needs PyTorch and a CUDA GPU), or None."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "needs PyTorch, which is not installed (pip install torch)"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU, and PyTorch sees none"
    return None


def run_throughput(args: argparse.Namespace) -> int:
    if args.engine != "both":
        if args.engine == "hf" and (problem := hf_unavailable()) is not None:
            print(f"jaxserve bench throughput: error: --engine hf {problem}", file=sys.stderr)
            return 2
        result = run_jaxserve(args) if args.engine == "jaxserve" else run_hf(args)
        result.update(
            num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
        )
        print_table({args.engine: result}, args)  # the numbers: --output-json
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("hf", "jaxserve"):
            if engine == "hf" and (problem := hf_unavailable()) is not None:
                results[engine] = {"engine": engine, "error": problem}
                continue
            out = os.path.join(tmp, f"{engine}.json")
            cmd = [
                sys.executable,
                "-m",
                "jaxserve.bench.throughput",
                *_forward(args),
                "--engine",
                engine,
                "--output-json",
                out,
            ]
            proc = subprocess.run(cmd, check=False)
            if proc.returncode == 0:
                results[engine] = json.loads(Path(out).read_text())
            else:
                results[engine] = {"engine": engine, "error": f"exit code {proc.returncode}"}
    print_table(results, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return 0 if "error" not in results.get("jaxserve", {}) else 1


def _forward(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--load-format",
        args.load_format,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        *(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--dtype",
        args.dtype,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--block-size",
        str(args.block_size),
        "--seed",
        str(args.seed),
        *(["--quantization", args.quantization] if args.quantization else []),
        *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
    ]


def print_table(results: dict, args: argparse.Namespace) -> None:
    print(
        f"\nOffline throughput: {args.num_prompts} prompts, {args.input_len} in / "
        f"{args.output_len} out, EOS ignored"
    )
    print(f"{'engine':10s} {'seconds':>9s} {'out tok/s':>11s}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:10s} {r['error']}")
        else:
            print(f"{name:10s} {r['seconds']:9.1f} {r['output_tokens_per_s']:11.1f}")
    if all("error" not in r for r in results.values()) and len(results) == 2:
        ratio = results["jaxserve"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        print(f"ratio jaxserve / hf: {ratio:.1f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_throughput_arguments(parser)
    return run_throughput(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
