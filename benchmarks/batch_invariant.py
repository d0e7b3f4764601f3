"""What batch-invariant mode (``--batch-invariant``) costs: the decode step and offline
throughput with the mode off and on, on the same model and settings.

For each mode one ``jaxserve.LLM`` with dummy weights (warmed up: every bucket compiled) is
timed on
  decode     B sequences with ``--context`` cached tokens decode one token each: model and
             sampler steps dispatched back to back (device ms, ``common.time_device``),
  offline    ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len``
             tokens each, through ``LLM.generate`` (output tokens/s),
and the table gives each mode's numbers and on / off.

    python -m benchmarks.batch_invariant --out bi.json         # Llama-3-8B shape, bf16 (H200)
    python -m benchmarks.batch_invariant --smoke --out bi.json # the tiny fixture on the CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxserve
from benchmarks.common import ROOT, decode_batch, time_device
from jaxserve import SamplingParams
from jaxserve.config import builtin_config_dir
from jaxserve.runner.step import SchedulerOutput


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    # (2,048, the engine's default: each larger bucket is one more program to compile, twice)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="the tiny fixture, on the CPU")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/llama")
        args.batches, args.context, args.iters = "1,4", 32, 3
        args.num_prompts, args.input_len, args.output_len = 8, 24, 8
        args.max_num_batched_tokens = 64
    return args


def make_llm(args: argparse.Namespace, batch_invariant: bool) -> jaxserve.LLM:
    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(args.context + 16, args.input_len + args.output_len)
    # The smoke run compiles each shape as it comes (its times then include compiles).
    smoke = {"num_gpu_blocks_override": 512, "warmup": False} if args.smoke else {}
    return jaxserve.LLM(
        args.model,
        load_format="dummy",
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=max(256, *batches) if not args.smoke else max(8, *batches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_invariant=batch_invariant,
        **smoke,
    )


def step_memory(llm: jaxserve.LLM) -> dict[str, Any]:
    """The largest compiled model step's buffers as XLA planned them (GiB) beside the
    activation headroom the engine reserved for it: a step whose temporaries exceed the
    headroom runs out of memory beside a full KV cache."""
    runner: Any = llm.engine.runner
    bucket = runner.buckets.token_buckets[-1]
    compiled = runner.programs.compiled_steps.get(bucket)  # (the smoke run warms nothing up)
    analysis = (compiled or runner.programs.lower_step(bucket).compile()).memory_analysis()
    gib = 1024**3
    out = {
        "bucket": bucket,
        "temp_gib": getattr(analysis, "temp_size_in_bytes", 0) / gib,
        "argument_gib": getattr(analysis, "argument_size_in_bytes", 0) / gib,
        "output_gib": getattr(analysis, "output_size_in_bytes", 0) / gib,
        "headroom_gib": runner.capacity.activation_bytes / gib,
    }
    print(
        f"  step of {bucket} tokens: temporaries {out['temp_gib']:.2f} GiB, arguments "
        f"{out['argument_gib']:.2f} GiB; activation headroom {out['headroom_gib']:.2f} GiB",
        flush=True,
    )
    return out


def time_decode(llm: jaxserve.LLM, args: argparse.Namespace) -> dict[int, float]:
    """Device ms of a decode step per batch size, on the engine's runner (its own rows,
    released after)."""
    runner: Any = llm.engine.runner
    rng = np.random.default_rng(0)
    out = {}
    for batch in (int(b) for b in args.batches.split(",")):
        sched = decode_batch(runner, batch, args.context, rng)
        device, _ = time_device(runner, sched, args.iters)
        out[batch] = device * 1e3
        finished = [item.seq.seq_id for item in sched.scheduled]
        runner.inputs.update_states(SchedulerOutput([], 0, finished_seq_ids=finished))
        print(f"  decode batch {batch}: {out[batch]:.2f} ms", flush=True)
    return out


def time_offline(llm: jaxserve.LLM, args: argparse.Namespace) -> float:
    """Output tokens per second of one offline run (after a short one that warms up)."""
    rng = np.random.default_rng(1)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"  offline: {tokens} tokens in {seconds:.2f} s", flush=True)
    return tokens / seconds


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "context": args.context,
        "offline": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
    }
    for mode in (False, True):
        print(f"batch_invariant={mode}", flush=True)
        llm = make_llm(args, mode)
        memory = step_memory(llm)
        decode = time_decode(llm, args)
        try:
            offline: float | None = time_offline(llm, args)
        except jax.errors.JaxRuntimeError as exc:  # the row says so; the table still prints
            print(f"  offline failed: {str(exc).splitlines()[0][:300]}", flush=True)
            offline = None
        results["on" if mode else "off"] = {
            "decode_ms": decode,
            "offline_tokens_per_s": offline,
            "step_memory": memory,
        }
        llm.shutdown()
        del llm
        gc.collect()
    off, on = results["off"], results["on"]
    print(f"\n{'':>18} {'off':>9} {'on':>9} {'on/off':>7}")
    for batch, ms in off["decode_ms"].items():
        print(f"{f'decode ms, B={batch}':>18} {ms:9.2f} {on['decode_ms'][batch]:9.2f} "
              f"{on['decode_ms'][batch] / ms:7.2f}")  # fmt: skip
    tps_off, tps_on = off["offline_tokens_per_s"], on["offline_tokens_per_s"]
    if tps_off and tps_on:
        print(f"{'offline tok/s':>18} {tps_off:9.1f} {tps_on:9.1f} {tps_on / tps_off:7.2f}")
    else:
        print(f"{'offline tok/s':>18} {tps_off or 'failed':>9} {tps_on or 'failed':>9}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
