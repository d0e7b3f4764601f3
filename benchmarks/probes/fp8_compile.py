"""What an fp8 step's compile costs, and what XLA's options trade for it (issue 36, item 5).

An fp8 cold start took 146-168 s on the H200 against 77 s in bf16, the 2,048-token fp8 step
alone 75 s. This compiles the model step of the buckets given (dummy Llama-3-8B, no persistent
cache, no in-memory reuse) in bf16 and with ``--quantization fp8``, each under several sets of
XLA options, and times each compiled step on a padding batch of its bucket (the GEMMs at full
size: what the options change):

  default            XLA's options (the autotuner picks each GEMM by timing),
  autotune0          ``xla_gpu_autotune_level=0`` (each GEMM by the shape's heuristic),
  cublas             ``xla_gpu_enable_triton_gemm=False`` (no Triton GEMMs to autotune),
  cublas-autotune0   both.

These are the sets ``$JAXSERVE_FP8_XLA_OPTIONS`` gives the served fp8 programs
(``jaxserve/runner/programs.py``: ``FP8_XLA_OPTION_SETS``).
The option set whose compile is short and whose step is no slower is the one the fp8 programs
should take. Each row also says what the compiled step's GEMMs are (its custom calls by
target: cuBLAS(Lt) and its fp8 form, ``gemms``) and how many of its instructions transpose or
copy fp8 arrays (``fp8_moves``): cuBLASLt's fp8 GEMM wants both operands K-minor, and the
weights are stored ``[in, out]``, so XLA may move them at every step (issue 36, item 2: is
W8A8 prefill on fp8 tensor cores?).

    python -m benchmarks.probes.fp8_compile                 # on the H200, about 6 minutes
    python -m benchmarks.probes.fp8_compile --smoke         # tiny CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.common import ROOT
from jaxserve.config import builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.programs import FP8_XLA_OPTION_SETS, FP8_XLA_OPTIONS_ENV
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step_programs import pack_step

OPTION_SETS = FP8_XLA_OPTION_SETS


def step_ms(runner: ModelRunner, compiled: Any, bucket: int, repeats: int) -> float:
    """Median ms of the compiled step on a padding batch of ``bucket`` tokens."""
    programs = runner.programs
    packed, _ = pack_step(programs.inputs.padding_step(bucket)[0])
    args = (programs.put(packed), programs.no_previous_ids)
    kv = runner.kv_cache
    times = []
    for _ in range(repeats + 1):  # the first call is not timed
        start = time.perf_counter()
        kv, hidden, *_ = compiled(runner.weights, kv, *args)
        jax.block_until_ready(hidden)
        times.append(time.perf_counter() - start)
    runner.kv_cache = kv
    return 1e3 * float(np.median(times[1:]))


def gemm_kinds(hlo: str) -> tuple[dict[str, int], int]:
    """(custom-call target -> count for the GEMM-like ones, instructions that transpose or copy
    an fp8 array) of a compiled program's HLO text."""
    kinds: dict[str, int] = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
        if any(word in target.lower() for word in ("gemm", "matmul", "triton", "cublas")):
            kinds[target] = kinds.get(target, 0) + 1
    moves = sum(
        1
        for line in hlo.splitlines()
        if re.search(r"= f8e\w+\[[^\]]*\]\S* (transpose|copy)\(", line.strip())
    )
    return kinds, moves


def measure(mode: str, args: argparse.Namespace, option_sets: list[str]) -> list[dict]:
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        quantization="fp8" if mode == "fp8" else None,
        max_model_len=args.max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=max(args.buckets),
        warmup=False,
        num_gpu_blocks_override=args.blocks,
    )
    # The runner's programs are jitted with no option set of their own (the served fp8 default
    # is autotune0): each row's set is then the only one its compile applies.
    served = os.environ.get(FP8_XLA_OPTIONS_ENV)
    os.environ[FP8_XLA_OPTIONS_ENV] = "default"
    try:
        runner = ModelRunner(load_model_config(args.model), config)
    finally:
        if served is None:
            os.environ.pop(FP8_XLA_OPTIONS_ENV)
        else:
            os.environ[FP8_XLA_OPTIONS_ENV] = served
    runner.allocate_kv_cache()
    rows = []
    for bucket in args.buckets:
        for name in option_sets:
            jax.clear_caches()  # no in-memory executable reuse between the measured compiles
            start = time.perf_counter()
            lowered = runner.programs.lower_step(bucket, runner.kv_cache)
            compiled = lowered.compile(compiler_options=OPTION_SETS[name] or None)
            compile_s = time.perf_counter() - start
            ms = step_ms(runner, compiled, bucket, args.repeats)
            gemms, moves = gemm_kinds(compiled.as_text())
            rows.append(
                {
                    "mode": mode,
                    "bucket": bucket,
                    "options": name,
                    "compile_s": compile_s,
                    "ms": ms,
                    "gemms": gemms,
                    "fp8_moves": moves,
                }
            )
            print(
                f"{mode:5s} bucket {bucket:5d} {name:19s} compile {compile_s:6.1f} s, "
                f"step {ms:8.2f} ms, GEMMs {gemms}, fp8 moves {moves}",
                flush=True,
            )
    runner.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--buckets", default="16,2048")
    parser.add_argument("--modes", default="bf16,fp8")
    parser.add_argument("--options", default=",".join(OPTION_SETS), help="option sets to try")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=2048, help="KV blocks (enough for a step)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/llama")
        args.buckets, args.max_model_len, args.blocks, args.repeats = "16,32", 128, 64, 2
        args.options = "default"
    args.buckets = [int(b) for b in args.buckets.split(",")]
    os.environ["JAXSERVE_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jaxserve-fp8-compile-")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # every compile runs
    option_sets = args.options.split(",")
    rows = [row for mode in args.modes.split(",") for row in measure(mode, args, option_sets)]
    print(
        "\n| mode | bucket | options | compile s | step ms | fp8 moves |\n"
        "|---|---:|---|---:|---:|---:|"
    )
    for r in rows:
        cells = (r["mode"], r["bucket"], r["options"], f"{r['compile_s']:.1f}", f"{r['ms']:.2f}",
                 r["fp8_moves"])  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
