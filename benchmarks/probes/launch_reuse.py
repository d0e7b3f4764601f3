"""Does the host's launch of a model step pay for its buffers' new addresses?

A decode step's launch took 2.97 ms of host time at batch 1 on an H100 (5.08 with XLA's command
buffers off; 2026-12-06), and a verify step of speculative decoding, which nothing overlaps,
spends it in full. XLA records a step's kernels into command buffers (CUDA graphs) and records
a graph again, every command of it, whenever an allocation one of its commands reads or writes
sits at another address than at the last recording (``CommandBufferThunk``'s
``ShouldUpdateCommandBuffer``). Each step puts its packed inputs in a new buffer and gets a new
output; if those addresses move from step to step, every launch records the graphs again.

Each case times the host's call of the model step alone (the sampler left out), from an idle
device, the median of ``--iters`` calls, except where it says otherwise:

  fresh        as the runner runs it: the host batch put on the device in the call (a new
               buffer), the previous step's output released before the call
  same_input   the one input buffer, put once, every call (its address never moves)
  held         fresh, with the previous step's input and output still held during the call
               (as the engine holds a step in flight while it launches the next)
  pipelined    the engine's own loop (``ModelRunner.dispatch`` and ``sample`` of step n + 1
               while step n runs, then n collected: ``benchmarks.common.pipelined_times``):
               the host's time of the dispatch and the sampler's launch
  queued_same  same_input, each call made while the previous one still runs (its output
               held until then): do a running step's buffers move the next one's?

Tried and dropped (2026-12-07, an H100): the step's inputs copied on the device into buffers of
fixed addresses by a small program that donates the last call's (so the graphs would keep their
addresses). The copy cost more than it saved: from an idle device 1.72 ms against fresh's 1.26,
in the engine's loop 3.90 ms against 2.87 (each copy donates buffers the running step may still
read; where the time goes was not traced); batch-1 TPOT unchanged (5.98 ms), EAGLE-3's batch-1
step 10.54 against 9.44 ms. Also tried (2026-12-07, an H100): XLA's virtual-address remapping
(``XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP`` or ``SKIP_PROFILED``, with
``XLA_PYTHON_CLIENT_ALLOCATOR=vmm`` or not): slower in every case (pipelined 2.56-6.51 ms
against the default's 1.98 in the same call; benchmarks/reports/2026-12-07-session-twenty-one).

    python -m benchmarks.probes.launch_reuse [--batch 1] [--context 1024] [--out FILE]
    python -m benchmarks.probes.launch_reuse --smoke        # the tiny fixture, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from benchmarks.common import ROOT, decode_batch, pipelined_times
from jaxserve.config import builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step_programs import pack_step


def median_launch(call: Callable[[], Any], iters: int, hold: bool = False) -> float:
    """Median host seconds of ``call()``, each from an idle device; ``hold``: the previous
    call's result stays alive during the next."""
    jax.block_until_ready(call())
    times, previous = [], None
    for _ in range(iters):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        previous = out if hold else None
        del out
    del previous
    return statistics.median(times)


def median_queued(call: Callable[[], Any], iters: int) -> float:
    """Median host seconds of ``call()`` made while the previous call still runs."""
    previous = call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
        jax.block_until_ready(previous)
        previous = out
    jax.block_until_ready(previous)
    return statistics.median(times)


def launches(runner: ModelRunner, batch: int, context: int, iters: int) -> dict[str, float]:
    sched = decode_batch(runner, batch, context, np.random.default_rng(0))
    host_batch, _ = runner.inputs.build_batch(sched)
    programs = runner.programs
    packed, layout = pack_step(host_batch)
    device_input = programs.put(packed)

    def fresh() -> Any:
        runner.kv_cache, forward = programs.run_step(runner.kv_cache, host_batch)
        return forward.hidden, forward.packed

    def same_input() -> Any:
        runner.kv_cache, hidden, *_ = programs.step_fn(
            programs.weights, runner.kv_cache, device_input, programs.no_previous_ids, layout
        )
        return hidden

    return {
        "pipelined_ms": 1e3 * pipelined_times(runner, sched, iters)[1],
        "fresh_ms": 1e3 * median_launch(fresh, iters),
        "same_input_ms": 1e3 * median_launch(same_input, iters),
        "held_ms": 1e3 * median_launch(fresh, iters, hold=True),
        "queued_same_ms": 1e3 * median_queued(same_input, iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.context, args.iters = str(ROOT / "tests/fixtures/models/llama"), 32, 3
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        max_model_len=args.context + 16,
        max_num_seqs=max(16, args.batch),
        max_num_batched_tokens=max(16, args.batch),
        warmup=False,
        num_gpu_blocks_override=args.batch * (args.context // 16 + 2) + 64,
    )
    runner = ModelRunner(load_model_config(args.model), config)
    row = {"device": jax.devices()[0].device_kind, "batch": args.batch, "context": args.context}
    row |= launches(runner, args.batch, args.context, args.iters)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
