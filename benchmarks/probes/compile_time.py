"""Where start-up compile time goes: one model step bucket, lowered and compiled several ways.

The first H200 run of `jaxserve launch` (dummy Llama-3-8B) had not finished compiling its 8 token
buckets after 4 min 20 s: every layer lowered its own copy of the Mosaic GPU kernel (fixed; the 8
buckets now compile in about 40 s cold, 18 s from the cache). This script times, for the buckets
given:
  lower            tracing + lowering to StableHLO,
  compile kernel   XLA compile with the default attention (Mosaic GPU kernel on Hopper),
  compile ref      XLA compile with the pure-jnp reference attention instead,
  parallel         all buckets compiled in threads at once (what warm-up does).
Run it with XLA_FLAGS=--xla_gpu_autotune_level=0 as well to see the autotuner's share.

    python -m benchmarks.probes.compile_time           # Llama-3-8B shape, buckets 16,256
    python -m benchmarks.probes.compile_time --smoke   # tiny CPU run (CI smoke test)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import jax

from benchmarks.common import ROOT
from jaxserve.config import builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.programs import model_step
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step_programs import pack_step
from jaxserve.units import human_int
from pallas_kernels.ragged_paged_attention import reference


def timed(fn):
    jax.clear_caches()  # no in-memory executable reuse between the measured compiles
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--buckets", default="16,256")
    parser.add_argument("--max-model-len", type=human_int, default=4096)
    parser.add_argument("--smoke", action="store_true", help="tiny model, on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/llama")
        args.buckets, args.max_model_len = "16,32", 128
    buckets = [int(b) for b in args.buckets.split(",")]
    os.environ["JAXSERVE_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-compile-time-")
    model_config = load_model_config(args.model)
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=max(buckets),
        max_num_batched_tokens=max(buckets),
        warmup=True,
        num_gpu_blocks_override=1024,
    )
    runner = ModelRunner(model_config, config)
    # Every compile below must really compile: an empty cache directory that nothing is
    # written to, and no in-memory reuse (``timed`` clears the caches).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    programs = runner.programs
    kv = runner.abstract_kv_cache()
    reference_step = jax.jit(
        functools.partial(
            model_step, config=model_config, attention_fn=reference.ragged_paged_attention
        ),
        static_argnums=(4,),
        donate_argnames=("kv_cache",),
    )
    rows = []
    for bucket in buckets:
        lowered, t_lower = timed(lambda b=bucket: programs.lower_step(b, kv))
        _, t_kernel = timed(lowered.compile)
        packed, layout = pack_step(runner.inputs.padding_step(bucket)[0])
        ref_lowered = reference_step.lower(
            runner.weights, kv, packed, programs.no_previous_ids, layout
        )
        _, t_ref = timed(ref_lowered.compile)
        rows.append(
            {
                "bucket": bucket,
                "lower_s": t_lower,
                "compile_kernel_s": t_kernel,
                "compile_reference_s": t_ref,
            }
        )
        print(
            f"bucket {bucket}: lower {t_lower:.1f} s, compile with kernel {t_kernel:.1f} s, "
            f"with reference attention {t_ref:.1f} s",
            flush=True,
        )
    jax.clear_caches()
    lowered = [programs.lower_step(b, kv) for b in buckets]
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        _, t_parallel = timed(lambda: list(pool.map(lambda lo: lo.compile(), lowered)))
    print(
        f"all {len(buckets)} buckets compiled in parallel threads: {t_parallel:.1f} s "
        f"(sequential sum {sum(r['compile_kernel_s'] for r in rows):.1f} s)"
    )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {
                    "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__,
                    "rows": rows,
                    "parallel_s": t_parallel,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
