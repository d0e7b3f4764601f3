"""Decode MBU grid through the real engine path (runner + model + attention kernel).

For each batch x context: B sequences with `context` tokens already in a paged KV cache
(random contents, shuffled pages) decode one token each. Reported per step:
  device ms  back-to-back model+sampler steps on the same inputs (host dispatch overlapped),
  sync ms    ModelRunner.execute end to end (host inputs, dispatch, device, token fetch),
  wall ms    per step of the engine's asynchronous loop: dispatch step n + 1, then read
             step n back (what serving runs; the on-device token feed is not exercised),
  floor ms   bytes_step / 4.3 TB/s with bytes_step = weights (less the embedding, unless
             tied to the output projection) + the KV read (a sliding layer reads its window)
             (at the KV cache dtype's bytes: an fp8 cache reads half of bf16's),
  MBU        floor / device,   host gap = wall - device.

    python -m benchmarks.decode_roofline                 # Llama-3-8B shape, dummy bf16 weights
    python -m benchmarks.decode_roofline --kv-cache-dtype fp8   # the same over an fp8 KV cache
    python -m benchmarks.decode_roofline --smoke         # tiny CPU run (CI smoke test)
    python -m benchmarks.decode_roofline --quantization fp8 [--kv-cache-dtype fp8]

With --quantization the floor counts the quantized weight bytes (values and scales), so MBU
stays a fraction of what that mode must read; compare modes by device ms or tokens/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import BANDWIDTH, ROOT, decode_batch, time_device, time_pipelined
from jaxserve.config import ModelConfig, builtin_config_dir
from jaxserve.engine_config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.quant_scheme import weight_bytes as quantized_weight_bytes
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step import SchedulerOutput


def kv_read_tokens(config: ModelConfig, length: int) -> int:
    """Tokens of KV one sequence of ``length`` reads in a step, summed over the layers: a
    sliding-window layer reads only its window."""
    return sum(
        min(length, window) if (window := config.layer_window(layer)) else length
        for layer in range(config.num_layers)
    )


def log_memory(stage: str) -> None:
    """Device memory in use after each stage (the first H200 run ran out of memory here)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        print(
            f"memory after {stage}: {stats['bytes_in_use'] / 2**30:.2f} GiB in use of "
            f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB",
            flush=True,
        )


def fill_cache_randomly(runner: ModelRunner, seed: int) -> None:
    """Layer by layer, freeing each old layer first: the cache is most of the device memory, and
    a second copy of it does not fit (the first H200 run ran out of memory here)."""
    key = jax.random.key(seed)
    runner.kv_cache = list(runner.kv_cache)
    for layer, (k_pages, v_pages) in enumerate(runner.kv_cache):
        shape, dtype, sharding = k_pages.shape, k_pages.dtype, k_pages.sharding
        runner.kv_cache[layer] = None
        k_pages.delete()
        v_pages.delete()
        key, a, b = jax.random.split(key, 3)
        # bf16 normals, cast to the cache dtype (an fp8 cache: the values at scale 1.0).
        runner.kv_cache[layer] = jax.block_until_ready(
            (
                jax.device_put(jax.random.normal(a, shape, jnp.bfloat16).astype(dtype), sharding),
                jax.device_put(jax.random.normal(b, shape, jnp.bfloat16).astype(dtype), sharding),
            )
        )


def time_wall(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> float:
    runner.execute(sched)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--smoke", action="store_true", help="tiny model and grid, on the CPU")
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="also write a Perfetto trace of a few steps of each --profile-batches cell here",
    )
    parser.add_argument("--profile-batches", default="1,64")
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/llama")
        args.batches, args.contexts, args.iters = "1,4", "32", 3

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model_config = load_model_config(args.model)
    max_len = max(contexts) + 16
    # KV for the largest batch x context that fits next to the weights (B=256 x 4096 does not
    # in bf16; an fp8 cache holds twice the tokens).
    max_tokens = 600_000 * (1 if args.kv_cache_dtype == "auto" else 2)
    fits = [b * (c + 16) for b in batches for c in contexts if b * (c + 16) <= max_tokens]
    num_blocks = 512 if args.smoke else max(fits) // 16 + 64
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=max_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(16, max(batches)),
        warmup=False,
        num_gpu_blocks_override=num_blocks,
    )
    runner = ModelRunner(model_config, config)
    log_memory("weights and KV cache")
    fill_cache_randomly(runner, 0)
    log_memory("random KV fill")
    itemsize = runner.dtype.itemsize
    # The embedding is gathered, not read whole: the floor leaves it out (it stays unquantized),
    # unless it is also the output projection (tied, as in Gemma), which reads all of it.
    embedding = model_config.vocab_size * model_config.hidden_size * itemsize
    weight_bytes = quantized_weight_bytes(model_config, itemsize, runner.quant)
    if not model_config.tie_word_embeddings:
        weight_bytes -= embedding
    per_token = runner.capacity.kv_bytes_per_token  # all layers, K and V, in the cache's dtype
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"weights {weight_bytes / 1e9:.2f} GB, KV {runner.kv_dtype} {per_token} B/token, "
        f"{runner.num_blocks * runner.block_size:,} KV tokens"
    )
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        for batch in batches:
            if batch * (context + 1) > runner.num_blocks * runner.block_size:
                print(f"skip batch {batch} x context {context}: does not fit")
                continue
            sched = decode_batch(runner, batch, context, rng)
            device, launch = time_device(runner, sched, args.iters)
            sync = time_wall(runner, sched, args.iters)
            wall = time_pipelined(runner, sched, args.iters)
            if args.profile_dir and str(batch) in args.profile_batches.split(","):
                trace_dir = Path(args.profile_dir) / f"b{batch}_ctx{context}"
                with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                    time_wall(runner, sched, 3)
            step_bytes = weight_bytes + batch * kv_read_tokens(model_config, context + 1) * (
                per_token // model_config.num_layers
            )
            floor = step_bytes / BANDWIDTH
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "device_ms": device * 1e3,
                    "launch_ms": launch * 1e3,
                    "sync_ms": sync * 1e3,
                    "wall_ms": wall * 1e3,
                    "floor_ms": floor * 1e3,
                    "mbu": floor / device,
                    "host_gap_ms": (wall - device) * 1e3,
                    "tokens_per_s": batch / wall,
                }
            )
            finished = [item.seq.seq_id for item in sched.scheduled]
            runner.inputs.update_states(SchedulerOutput([], 0, finished_seq_ids=finished))
            r = rows[-1]
            print(
                f"row batch={batch} ctx={context} device_ms={r['device_ms']:.2f} "
                f"launch_ms={r['launch_ms']:.2f} "
                f"sync_ms={r['sync_ms']:.2f} wall_ms={r['wall_ms']:.2f} "
                f"floor_ms={r['floor_ms']:.2f} mbu={r['mbu']:.1%}",
                flush=True,
            )
            if args.output_json:
                Path(args.output_json).write_text(json.dumps({"rows": rows}, indent=2))
    print(
        f"\n{'batch':>5} {'ctx':>5} {'device ms':>9} {'sync ms':>8} {'wall ms':>8} "
        f"{'floor ms':>8} {'MBU':>6} {'gap ms':>7} {'tok/s':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} {r['context']:5d} {r['device_ms']:9.2f} {r['sync_ms']:8.2f} "
            f"{r['wall_ms']:8.2f} "
            f"{r['floor_ms']:8.2f} {r['mbu']:6.1%} {r['host_gap_ms']:7.2f} "
            f"{r['tokens_per_s']:9.1f}"
        )
    if args.output_json:
        meta = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "dtype": str(runner.dtype),
            "quantization": runner.quant.describe() if runner.quant is not None else None,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": per_token,
            "kv_cache_dtype": str(runner.kv_dtype),
            "kv_tokens": runner.num_blocks * runner.block_size,
            "model": args.model,
        }
        Path(args.output_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
