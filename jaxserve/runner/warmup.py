"""Warm-up: every program a request can reach is compiled before the server takes traffic (or,
with ``serve_while_compiling``, those of the smallest bucket and every matmul by the head, the
rest in the background: ``warm_up``).

The model step is compiled ahead of time for every token bucket, in parallel threads (lowering
holds the GIL, XLA's compile does not); then the logits, the sampler variants and the
prompt-logprob program of every bucket (``compile_buckets``), each into its table of
``StepPrograms``. Then the runner waits for the weights, allocates the KV cache and runs one
step of the smallest bucket end to end (model step, both sampler kinds, and the pending-token
feed of every bucket, which compiles on that first call: ``run_smallest_step``), so a broken
program fails the start, not a request. ``ModelRunner.warmup`` says which buckets compile when
(``WarmUpPlan``) and does its own part between the compiles.

NOTE: off the GPU the larger buckets are compiled but not run: on the CPU the reference
attention's largest steps took 12-16 s of a demo start and most of its peak memory (2,048
tokens: 4.5 GB; ``LLM()``'s 8,192: 10.8 GB). On a GPU a program's first run costs more than
its compile said: the step logs of the H100 (2026-12-07) show 190-240 ms of dispatch for the
first 16,384- and 4,096-token pooling steps against 6-17 ms after (XLA records its command
buffers and loads the kernels on the first run), so there every bucket compiled before
serving runs once with padding (``run_first_steps``), and no request pays for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxserve.models.loading.load_progress import format_bytes
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.sampling import SamplerFlags
from jaxserve.runner.step_programs import POOLING_PROGRAMS, PROGRAMS, StepPrograms

_LOG = logging.getLogger(__name__)

# While the background lowers (Python under the interpreter lock), the engine thread waits for
# the lock at each handoff for up to the switch interval (5 ms by default): 16-token steps of
# the first request took about 90 ms each on the H200 (TTFT 2.5-3.3 s for 512 tokens).
BACKGROUND_SWITCH_INTERVAL_S = 0.0005


def enable_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir``: a second start loads what warm-up
    compiled instead of compiling it again."""
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # NOTE: every program, however quick to compile: the ~100 sampler and prompt-logprob
    # programs take 0.1-0.4 s each on the CPU; under a 0.5 s floor none was cached, and
    # compiling them again made 9 s of every warm start of the demo model.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@dataclasses.dataclass(frozen=True)
class WarmUpPlan:
    """Which token buckets compile before the engine serves (``first``) and which in the
    background, the decode-sized ones (up to the largest sequence bucket) before the rest."""

    first: list[int]
    decode: list[int]
    prefill: list[int]

    @classmethod
    def of(cls, buckets: Buckets, serve_while_compiling: bool) -> WarmUpPlan:
        tokens = list(buckets.token_buckets)
        if not serve_while_compiling:
            return cls(tokens, [], [])
        # NOTE: one model step, then serve. With a full compilation cache each step program
        # still lowers for 1.5-2 s (the Mosaic GPU attention kernel's lowering most of it):
        # the five decode buckets of 256 sequences made 10 s of a 31 s warm start of
        # Llama-3-8B on the H200. Serving 16-token steps meanwhile is better than not serving.
        # The programs with a matmul by the head (the logits of every bucket, the prompt
        # logprobs of the decode buckets) still compile first: XLA's autotuner times each new
        # number of rows on a copy of the head (1 GiB for Llama-3's vocabulary), which does
        # not fit beside the KV cache (measured: every sampler of a new bucket ran out of
        # memory there while the matmul was in them). The larger buckets' prompt logprobs, in
        # chunks of 128 rows, compiled beside it.
        decode = [b for b in tokens[1:] if b <= buckets.max_seq_bucket]
        return cls(tokens[:1], decode, tokens[1 + len(decode) :])


def warm_up(
    programs: StepPrograms,
    plan: WarmUpPlan,
    *,
    check: Callable[[], None],
    prepare: Callable[[], None],
    cache_dir: str,
    max_workers: int,
    headroom_bytes: int | None = None,
) -> int:
    """Compile the programs of ``plan.first`` and the matmuls by the head of the other
    buckets, then ``prepare`` (the runner's part: wait for the weights, allocate the KV cache,
    run one small step); the other buckets' programs then compile on a thread of their own
    while the engine serves, ``programs.ready_tokens`` rising as each bucket is ready. Returns
    the number of model step shapes compiled before serving; ``check`` raises the weights'
    load error (called between lowerings). ``headroom_bytes``: a step's headroom planned
    beside the KV cache (``Capacity.step_bytes``), which each compiled step's temporaries are
    checked against
    (``check_step_memory``: before the cache, and after the background compile)."""
    start = time.perf_counter()
    workers = max(1, min(max_workers, os.cpu_count() or 1))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    programs.ready_tokens = 0
    try:
        with fewer_collections():
            compile_buckets(programs, pool, plan.first, start, check)
            if plan.decode or plan.prefill:
                heads = ("logits", "prompt_logprobs")
                compile_buckets(programs, pool, plan.decode, start, check, steps=False, kinds=heads)
                compile_buckets(
                    programs, pool, plan.prefill, start, check, steps=False, kinds=heads[:1]
                )
        check_step_memory(programs, headroom_bytes)
        prepare()
    except BaseException:  # the compiles running finish before the interpreter exits
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    programs.compile_seconds = time.perf_counter() - start
    _LOG.info(
        "Compiled %d step shapes in %.1f s (compilation cache: %s)",
        len(plan.first),
        programs.compile_seconds,
        cache_dir,
    )
    programs.ready_tokens = plan.first[-1]
    if not plan.decode and not plan.prefill:
        pool.shutdown()
        return len(plan.first)
    _LOG.info(
        "Serving steps of up to %d tokens; the buckets of %s tokens compile in the background",
        plan.first[-1],
        ", ".join(map(str, plan.decode + plan.prefill)),
    )
    _start_background(programs, plan, pool, start, check, headroom_bytes)
    return len(plan.first)


def _start_background(
    programs: StepPrograms,
    plan: WarmUpPlan,
    pool: concurrent.futures.ThreadPoolExecutor,
    start: float,
    check: Callable[[], None],
    headroom_bytes: int | None,
) -> None:
    """The buckets after ``plan.first``, compiled on a thread of their own (``background``),
    the decode-sized ones first, the interpreter switching threads sooner meanwhile."""

    def compile_rest() -> None:
        group: list[int] = []
        try:
            # precision: a context of the thread that enters it, so entered here
            with programs.precision(), fewer_collections():
                for group in (plan.decode, plan.prefill):
                    if group:
                        compile_buckets(programs, pool, group, start, check, raise_ready=True)
            _LOG.info(
                "Compiled every bucket at %.1f s; steps of up to %d tokens run",
                time.perf_counter() - start,
                programs.buckets.token_buckets[-1],
            )
            check_step_memory(programs, headroom_bytes)
        except Exception:  # the engine keeps serving the steps it has compiled
            if not programs.background.stopping.is_set():  # else the runner shut down meanwhile
                _LOG.exception("Compiling the buckets of %s tokens failed", group)
        finally:
            pool.shutdown()
            if sys.getswitchinterval() == BACKGROUND_SWITCH_INTERVAL_S:  # else changed since
                sys.setswitchinterval(interval)

    programs.background.pool = pool
    interval = sys.getswitchinterval()
    sys.setswitchinterval(BACKGROUND_SWITCH_INTERVAL_S)
    programs.background.thread = threading.Thread(target=compile_rest, name="compile-rest")
    programs.background.thread.start()


@contextlib.contextmanager
def fewer_collections(threshold: int = 100_000) -> Iterator[None]:
    """The interpreter's youngest generation collected every ``threshold`` allocations
    instead of 700, while programs lower: lowering makes millions of short-lived objects, and
    each collection also runs JAX's callback into XLA. In the H200's warm start (a real 8B
    checkpoint) that callback alone took 5.0 s of the main thread's 33 s
    (``benchmarks/startup_profile.py``)."""
    before = gc.get_threshold()
    gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


# -- between the compiles: the runner's part (``prepare``) ---------------------------------


def log_weights_ready(waited_s: float, load_seconds: float) -> None:
    """The weights, loaded beside the compile, are in place."""
    _LOG.info(
        "Weights ready %.1f s after the compile (%.1f s to load, beside it)", waited_s, load_seconds
    )


def log_free_memory(kv_budget_bytes: int, headroom_bytes: int | None = None) -> None:
    """With the weights in place, before the KV cache: what the first device's allocator holds
    and the largest block it has free (the cache's per-layer arrays each need one block; a
    load that left its free memory in pieces fails here, and this line says so first); and,
    given a step's planned headroom (``Capacity.step_bytes``: the plan's part for what the
    compiled programs keep is in use by now), whether what the allocator has left beside the
    cache still holds it. On an H100 a compile on an empty cache left 0.56-0.66 GiB in use
    beyond the weights, before the plan kept room for it: the cache then left 1.83 GiB of a
    planned 2.48, and a sampler step ran out of memory. A shortfall under 1 MiB is not one."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "largest_free_block_bytes" not in stats:
        return  # the CPU backend keeps no such statistics
    largest = int(stats["largest_free_block_bytes"])
    in_use = int(stats.get("bytes_in_use", 0))
    _LOG.info(
        "Device memory with the weights in place: %s in use, largest free block %s",
        format_bytes(in_use),
        format_bytes(largest),
    )
    if largest < kv_budget_bytes:
        _LOG.warning(
            "The largest free block (%s) is smaller than the KV cache (%s): its allocation may "
            "fail; set fewer KV blocks (--num-gpu-blocks-override) or give the allocator more "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION above --gpu-memory-utilization; lowering the flag "
            "shrinks the allocator's pool with the cache)",
            format_bytes(largest),
            format_bytes(kv_budget_bytes),
        )
    limit = int(stats.get("bytes_limit", 0))
    left = limit - in_use - kv_budget_bytes
    if headroom_bytes is not None and limit and left < headroom_bytes - 2**20:
        _LOG.warning(
            "Beside the KV cache (%s) the allocator keeps %s for a step's temporaries, %s less "
            "than planned (%s is in use with the weights in place, what the compile left "
            "among it): a large step may run out of memory. Give the allocator that much more "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION above --gpu-memory-utilization; a restart on a "
            "warm compilation cache may leave less behind) or fewer KV blocks "
            "(--num-gpu-blocks-override)",
            format_bytes(kv_budget_bytes),
            format_bytes(max(left, 0)),
            format_bytes(headroom_bytes - left),
            format_bytes(in_use),
        )


HEADROOM_ADVICE = (
    "Smaller steps (--max-num-batched-tokens), fewer KV blocks (--num-gpu-blocks-override) or "
    "a larger allocator pool (XLA_PYTHON_CLIENT_MEM_FRACTION above --gpu-memory-utilization) "
    "give it room; a lower --gpu-memory-utilization does not, as the pool shrinks with the cache"
)
"""What gives a step's temporaries room beside the KV cache. The allocator's pool follows
--gpu-memory-utilization (``reserve_device_memory``), so lowering the flag shrinks the pool
and the cache together and leaves the headroom as it was."""


def check_step_memory(programs: StepPrograms, headroom_bytes: int | None) -> None:
    """Warn where a compiled model step's temporaries, as XLA planned them, exceed the
    activation headroom planned beside the KV cache for a step (``Capacity.step_bytes``; None:
    no check). Such a step can run out of device memory beside a full cache, or leave the
    sampler too little: batch-invariant mode on an H100 ran out of memory (its sampler asked
    for 2.16 GiB) after XLA planned its 2,048-token step above the 1.55 GiB of headroom (the
    cause, fixed since: ``pallas_kernels/fresh.py``); a plan that misses a program's
    temporaries shows here first."""
    if headroom_bytes is None or not checks_step_memory():
        return
    temps: dict[int, int] = {}
    for bucket, step in programs.compiled_steps.items():
        size = _temp_bytes(step)
        if size is not None:
            temps[bucket] = size
    if not temps:
        return  # (a backend without memory analysis)
    bucket = max(temps, key=lambda b: temps[b])
    if temps[bucket] <= headroom_bytes:
        return
    _LOG.warning(
        "The model step of %d tokens needs %s of temporary buffers, more than the %s of "
        "activation headroom planned beside the KV cache: it may run out of device memory "
        "when the cache is full. %s",
        bucket,
        format_bytes(temps[bucket]),
        format_bytes(headroom_bytes),
        HEADROOM_ADVICE,
    )


def check_program_memory(name: str, programs: list[Any], headroom_bytes: int | None) -> None:
    """As ``check_step_memory``, for programs that run between the model steps, out of the
    same headroom (``name``'s: a drafter's chains, each at its token bucket)."""
    if headroom_bytes is None or not checks_step_memory():
        return
    sizes = [size for size in map(_temp_bytes, programs) if size is not None]
    if not sizes or max(sizes) <= headroom_bytes:
        return
    _LOG.warning(
        "%s largest program needs %s of temporary buffers, more than the %s of activation "
        "headroom planned beside the KV cache: it may run out of device memory when the cache "
        "is full. %s",
        name,
        format_bytes(max(sizes)),
        format_bytes(headroom_bytes),
        HEADROOM_ADVICE,
    )


def checks_step_memory() -> bool:
    """Whether a step's temporaries come out of the device's own memory beside the KV cache
    (an accelerator's): the CPU's come from the host's, which the plan does not size (the demo
    model's 2,048-token step plans 2 GiB of them on the CPU, beside 188 MiB of headroom)."""
    return jax.default_backend() != "cpu"


def _temp_bytes(compiled: Any) -> int | None:
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # a backend or a program without one
        return None
    return getattr(analysis, "temp_size_in_bytes", None)


def log_kv_cache_allocated(kv_budget_bytes: int, seconds: float) -> None:
    _LOG.info("Allocated the KV cache (%s) in %.1f s", format_bytes(kv_budget_bytes), seconds)


def run_first_steps(programs: StepPrograms, kv_cache: Any) -> Any:
    """``run_smallest_step``, then on a GPU one padding step of every other bucket compiled so
    far through the model step and the greedy sampler (or the pooling program): each
    program's first run, which costs 0.2 s on a GPU (the module docstring), before serving.
    Returns the KV cache (donated to the steps)."""
    kv_cache = run_smallest_step(programs, kv_cache)
    if not runs_every_bucket():
        return kv_cache
    started = time.perf_counter()
    buckets = sorted(programs.compiled_steps)[1:]
    for bucket in buckets:
        kv_cache = _run_padding_step(programs, kv_cache, bucket)
    if buckets:
        _LOG.info(
            "Ran each step of %s tokens once in %.1f s (a program's first run)",
            ", ".join(map(str, buckets)),
            time.perf_counter() - started,
        )
    return kv_cache


def runs_every_bucket() -> bool:
    """Whether warm-up runs every compiled bucket once: on a GPU (the module docstring)."""
    return jax.default_backend() == "gpu"


def _run_padding_step(programs: StepPrograms, kv_cache: Any, bucket: int) -> Any:
    batch, inputs = programs.inputs.padding_step(bucket)
    kv_cache, forward = programs.run_step(kv_cache, batch)
    if programs.kinds == POOLING_PROGRAMS:
        jax.block_until_ready(programs.pool(forward))
    else:
        out = programs.sample(forward, inputs, SamplerFlags(all_greedy=True))
        jax.block_until_ready(out.token_ids)
    return kv_cache


def run_smallest_step(programs: StepPrograms, kv_cache: Any) -> Any:
    """One padding step of the smallest bucket through the model step and both sampler kinds,
    then one that reads its input ids from those samples (the pending-token feed); returns
    the KV cache (donated to the steps)."""
    batch, inputs = programs.inputs.padding_step(programs.buckets.token_buckets[0])
    kv_cache, forward = programs.run_step(kv_cache, batch)
    if programs.kinds == POOLING_PROGRAMS:  # a pooling runner samples nothing
        jax.block_until_ready(programs.pool(forward))
        return kv_cache
    for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
        out = programs.sample(forward, inputs, flags)
        jax.block_until_ready(out.token_ids)
    source = np.zeros(batch.num_tokens, np.int32)
    kv_cache, forward = programs.run_step(kv_cache, batch, source, out.token_ids)
    jax.block_until_ready(forward.hidden)
    return kv_cache


# -- compiling a set of buckets ------------------------------------------------------------


def compile_buckets(
    programs: StepPrograms,
    pool: concurrent.futures.ThreadPoolExecutor,
    buckets: list[int],
    start: float,
    check: Callable[[], None],
    raise_ready: bool = False,
    steps: bool = True,
    kinds: tuple[str, ...] | None = None,
) -> None:
    """The programs of ``buckets``: model steps first (unless ``steps`` is off), then those
    of ``kinds`` (None: all of the runner's) not compiled yet (the sampler variants belong to
    a sequence bucket, which several token buckets share); raises the weights' load error
    (``check``) as soon as it comes. ``raise_ready``: the background's compile, beside the KV cache
    (``BackgroundCompile.compile``), and ``programs.ready_tokens`` rises to each bucket whose
    programs (and all smaller buckets') are done."""
    # Each program's compile starts as soon as it is lowered, while the next one lowers; beside
    # the KV cache (the background), in the background's slots.
    compile_fn = programs.background.compile if raise_ready else _compile_whole_device
    todo = list(programs.uncompiled(buckets, kinds))
    if steps:
        ready_each = raise_ready and not todo
        _compile_steps(programs, pool, buckets, start, check, compile_fn, ready_each)
    if not todo:
        return
    # NOTE: after the steps, not beside them: XLA times candidate kernels on the device
    # while it compiles, and the steps' choices are the ones that matter.
    _log_compiling(todo, buckets)
    progress = _BucketProgress(programs, buckets, todo, start, raise_ready)
    futures = []
    specs: dict[int, jax.ShapeDtypeStruct] = {}  # the samplers' logits, per number of rows
    for kind, table, key, bucket in todo:
        _check(programs, check)
        future = pool.submit(compile_fn, programs.lower(kind, key, specs))
        future.add_done_callback(functools.partial(progress.done, bucket, table, key))
        futures.append((future, table, key))
    for future, table, key in futures:
        check()
        table[key] = future.result()  # the callback may not have run yet


def _log_compiling(todo: list[tuple[str, dict, Any, int]], buckets: list[int]) -> None:
    kinds = collections.Counter(kind for kind, *_ in todo)
    names = {"logits": "the logits", "prompt_logprobs": "the prompt logprobs", "pooling": "pooling"}
    what = [
        names.get(kind, f"{kinds[kind]} sampler variants")
        for kind in PROGRAMS + POOLING_PROGRAMS
        if kinds[kind]
    ]
    _LOG.info(
        "Compiling %s for the buckets of %s tokens (%d programs)",
        " and ".join([", ".join(what[:-1]), what[-1]] if len(what) > 1 else what),
        ", ".join(map(str, buckets)),
        len(todo),
    )


def _compile_steps(
    programs: StepPrograms,
    pool: concurrent.futures.ThreadPoolExecutor,
    buckets: list[int],
    start: float,
    check: Callable[[], None],
    compile_fn: Callable[[Any], Any],
    raise_ready: bool,
) -> None:
    """The model step of each bucket; ``raise_ready`` (their other programs already compiled):
    each bucket's steps run once it and every smaller bucket are done."""
    _LOG.info(
        "Compiling the model step for %d token bucket%s (%s)",
        len(buckets),
        "" if len(buckets) == 1 else "s",
        ", ".join(map(str, buckets)),
    )
    futures = {}
    for bucket in buckets:
        _check(programs, check)
        lowered = programs.lower_step(bucket)
        futures[pool.submit(compile_fn, lowered)] = bucket
    for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
        check()
        programs.compiled_steps[futures[future]] = future.result()
        _LOG.info(
            "Compiled model step for %d tokens (%d/%d) at %.1f s",
            futures[future],
            done,
            len(buckets),
            time.perf_counter() - start,
        )
        if raise_ready:
            _raise_ready(programs, buckets, lambda b: b in programs.compiled_steps)


def _raise_ready(
    programs: StepPrograms, buckets: list[int], is_done: Callable[[int], bool]
) -> None:
    """Raise ``programs.ready_tokens`` to the largest of ``buckets`` up to which every one is
    done (ascending; the smaller buckets outside them are ready already)."""
    ready = programs.ready_tokens
    for bucket in buckets:
        if not is_done(bucket):
            break
        ready = bucket
    if ready > programs.ready_tokens:
        _LOG.info("Steps of up to %d tokens now run", ready)
        programs.ready_tokens = ready


def _compile_whole_device(lowered: Any) -> Any:
    return lowered.compile()


def _check(programs: StepPrograms, check: Callable[[], None]) -> None:
    """Between lowerings: the weights' load error, or the runner's shutdown."""
    check()
    if programs.background.stopping.is_set():
        raise concurrent.futures.CancelledError("the runner shut down")


class _BucketProgress:
    """Called from the compiling threads as each of ``todo``'s programs finishes: puts it in
    its table, logs each token bucket whose programs have all compiled, and (``raise_ready``)
    raises ``programs.ready_tokens`` to the largest bucket up to which every bucket is done."""

    def __init__(
        self,
        programs: StepPrograms,
        buckets: list[int],
        todo: list[tuple[str, dict, Any, int]],
        start: float,
        raise_ready: bool,
    ) -> None:
        self.programs = programs
        self.buckets = buckets
        self.left = collections.Counter(bucket for *_, bucket in todo)
        self.start = start
        self.raise_ready = raise_ready
        self.num_buckets_done = len(buckets) - len(self.left)
        self.lock = threading.Lock()
        if raise_ready:  # buckets with nothing left to compile
            _raise_ready(programs, buckets, lambda b: self.left[b] == 0)

    def done(self, bucket: int, table: dict, key: Any, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # raised by compile_buckets (or shut down); the bucket never becomes ready
        table[key] = future.result()
        with self.lock:
            self.left[bucket] -= 1
            if self.left[bucket] > 0:
                return
            self.num_buckets_done += 1
            _LOG.info(
                "Compiled the programs of %d tokens (%d/%d) at %.1f s",
                bucket,
                self.num_buckets_done,
                len(self.buckets),
                time.perf_counter() - self.start,
            )
            if self.raise_ready:
                _raise_ready(self.programs, self.buckets, lambda b: self.left[b] == 0)
