"""What the benchmark scripts share: the repository's root, the H200's bandwidth floor, how a
jitted call is timed, and the decode step through the runner (a batch of sequences with cached
context, timed back to back and in the engine's asynchronous loop).

decode_roofline.py and moe.py time the decode step with these; moe.py, skinny_matmul.py and
the probes time single jitted calls with ``best_time``; every floor divides bytes by
``BANDWIDTH``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.engine.request import Request, Sequence
from jaxserve.runner.step import ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.units import cdiv

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]  # the repository (tests/fixtures, jaxserve/assets)
BANDWIDTH = 4.3e12  # bytes/s, copy bandwidth measured on the H200


def best_time(fn, *args, iters: int = 20, runs: int = 3) -> float:
    """Seconds per call of ``fn(*args)`` dispatched ``iters`` times back to back (the best of
    ``runs`` such runs), after one call that compiles and warms up."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def decode_batch(runner: ModelRunner, batch: int, context: int, rng) -> SchedulerOutput:
    """`batch` sequences with `context` cached tokens each, decoding their next token."""
    bs = runner.block_size
    pages_per = cdiv(context + 1, bs)
    pages = rng.permutation(runner.num_blocks)[: batch * pages_per].reshape(batch, pages_per)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    items = []
    for i in range(batch):
        prompt = rng.integers(100, 20000, size=context + 1).tolist()
        request = Request(str(i), None, prompt, params, arrival_time=0.0)
        seq = Sequence(str(i), request, 0, seed=i, block_ids=pages[i].tolist())
        seq.num_computed_tokens = context
        request.seqs.append(seq)
        items.append(ScheduledSeq(seq, 1, context, is_new=True))
    runner.inputs.update_states(SchedulerOutput(items, batch))  # rows for the sequences
    for item in items:
        item.is_new = False  # every timed step below reuses this schedule
    return SchedulerOutput(items, batch)


def time_device(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> tuple[float, float]:
    """Seconds per step of model + sampler dispatched back to back, and the host seconds of
    one such dispatch (the calls' return, not the device's work: XLA's kernel launches)."""
    host_batch, rows = runner.inputs.build_batch(sched)
    kv_lens = np.asarray(host_batch.kv_lens)  # host arrays until forward, as the runner's
    flags = runner.inputs.sampler_flags(rows, kv_lens)
    inputs = runner.inputs.sampling_inputs([i.seq for i in sched.scheduled], rows, kv_lens, flags)

    programs = runner.programs

    def step():
        runner.kv_cache, forward = programs.run_step(runner.kv_cache, host_batch)
        return programs.sample(forward, inputs, flags).token_ids

    jax.block_until_ready(step())
    samples, launches = [], []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = step()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    for _ in range(iters):  # each from an idle device: nothing to wait behind
        launch = time.perf_counter()
        out = step()
        launches.append(time.perf_counter() - launch)
        jax.block_until_ready(out)
    return min(samples), statistics.median(launches)


def time_pipelined(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> float:
    """Median seconds per step with step n + 1 dispatched before step n is read back."""
    return pipelined_times(runner, sched, iters)[0]


def pipelined_times(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> tuple[float, float]:
    """Medians of the engine's asynchronous loop (step n + 1 dispatched and sampled before
    step n is read back): seconds per step, and the host's seconds of the dispatch and the
    sampler's launch alone."""
    previous = runner.dispatch(sched)
    runner.sample(previous, None)
    periods, launches = [], []
    for _ in range(iters + 2):
        start = time.perf_counter()
        step = runner.dispatch(sched, previous)
        runner.sample(step, None)
        launches.append(time.perf_counter() - start)
        runner.collect(previous)
        periods.append(time.perf_counter() - start)
        previous = step
    runner.collect(previous)
    return statistics.median(periods[2:]), statistics.median(launches[2:])
