"""Start-up: the weights load while the programs compile against their shapes, and with
``serve_while_compiling`` the engine takes requests once the smallest bucket has compiled, its
step budget rising as the others finish in the background (the decode-sized buckets, of up to
``max_num_seqs`` tokens, before the larger ones).

The fixture Llama in float32 with buckets of 16, 32 and 64 tokens.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.engine.core import EngineCore
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner import step_programs, warmup
from jaxserve.runner.model_weights import abstract_model_weights, model_weights
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step_programs import StepPrograms
from jaxserve.sampling_params import SamplingParams
from tests.conftest import fixture_dir, run_with_devices

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 200, size=40)]


def engine_config(**overrides) -> EngineConfig:
    fields = dict(
        model=str(fixture_dir("llama")),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=4,
        num_gpu_blocks_override=256,
        serve_while_compiling=True,
    )
    return EngineConfig(**{**fields, **overrides})


def generate(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(greedy tokens, the number of tokens of each step that ran, none above the budget)."""
    step_sizes: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule(*args):  # the step's drafts, with speculative decoding
        output = schedule(*args)
        if not output.is_empty:
            step_sizes.append(output.num_batched_tokens)
            assert output.num_batched_tokens <= core.runner.ready_tokens
        return output

    core.scheduler.schedule = recording_schedule
    core.add_request(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0))
    tokens: list[int] = []
    while core.num_unfinished():
        for output in core.step():  # deltas
            tokens += output.outputs[0].token_ids
    del core.scheduler.schedule
    return tokens, step_sizes


@pytest.fixture
def held_background(monkeypatch):
    """Holds the background compile at its start until the event is set (or the runner shuts
    down)."""
    release = threading.Event()
    compile_buckets = warmup.compile_buckets

    def held(programs, pool, buckets, start, check, raise_ready=False, **parts):
        stopping = programs.background.stopping
        while raise_ready and not release.wait(0.05) and not stopping.is_set():
            pass
        compile_buckets(programs, pool, buckets, start, check, raise_ready, **parts)

    monkeypatch.setattr(warmup, "compile_buckets", held)
    yield release
    release.set()


def test_the_engine_serves_the_compiled_buckets_first_and_every_bucket_once_compiled(
    held_background,
) -> None:
    reference = EngineCore(engine_config(serve_while_compiling=False))
    assert reference.runner.ready_tokens == 64
    assert reference.runner.programs.background.thread is None
    expected, steps = generate(reference, "ref", PROMPT)
    assert steps[0] == 40  # the whole prompt in one step

    core = EngineCore(engine_config())
    runner = core.runner
    programs = runner.programs
    assert runner.ready_tokens == 16
    assert sorted(programs.compiled_steps) == [16]
    tokens, steps = generate(core, "early", PROMPT)
    assert tokens == expected
    assert steps[:3] == [16, 16, 8]  # the prompt in chunks of the compiled bucket

    held_background.set()
    programs.background.thread.join(120)
    assert runner.ready_tokens == 64
    assert sorted(programs.compiled_steps) == [16, 32, 64]
    assert sorted(programs.compiled_prompt_lp) == [16, 32, 64]
    assert sorted(programs.compiled_logits) == [16, 32, 64]
    # the sampler variants belong to a sequence bucket: 4 rows for every token bucket here
    assert {rows for rows, _ in programs.compiled_samplers} == {4}
    assert len(programs.compiled_samplers) == len(runner.inputs.sampler_variants)
    # float32 means float32 in the background thread's programs too (no TF32 on a GPU)
    assert "operand_precision={highest" in programs.compiled_steps[64].as_text()
    tokens, steps = generate(core, "late", PROMPT[::-1])
    assert steps[0] == 40
    assert programs.step_fn._cache_size() == 0  # every step ran a warm-up executable
    core.shutdown()
    reference.shutdown()


def test_the_decode_buckets_compile_in_the_background_before_the_prefill_ones(
    held_background, caplog
) -> None:
    # 32 sequences: the 32-token bucket is a decode bucket, the 64-token one is not
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.warmup"):
        core = EngineCore(engine_config(max_num_seqs=32))
        runner = core.runner
        programs = runner.programs
        assert sorted(programs.compiled_steps) == [16] and runner.ready_tokens == 16
        # every matmul by the head compiles before the KV cache takes the device's memory:
        # the logits of every bucket, the prompt logprobs of the decode ones; the sampler
        # variants (no matmul) of the larger sequence buckets compile beside the cache
        assert sorted(programs.compiled_logits) == [16, 32, 64]
        assert sorted(programs.compiled_prompt_lp) == [16, 32]
        assert {rows for rows, _ in programs.compiled_samplers} == {16}
        assert len(programs.compiled_samplers) == len(runner.inputs.sampler_variants)
        held_background.set()
        programs.background.thread.join(120)
        assert {rows for rows, _ in programs.compiled_samplers} == {16, 32}  # 64 tokens: 32 rows
        assert len(programs.compiled_samplers) == 2 * len(runner.inputs.sampler_variants)
        assert sorted(programs.compiled_prompt_lp) == [16, 32, 64]
    log = caplog.text
    assert "Compiling the model step for 1 token bucket (16)\n" in log
    assert "Serving steps of up to 16 tokens; the buckets of 32, 64 tokens" in log
    # 32's step runs once compiled, before 64's programs start
    assert log.index("Steps of up to 32 tokens now run") < log.index(
        "Compiled model step for 64 tokens"
    )
    assert core.runner.ready_tokens == 64
    tokens, steps = generate(core, "after", PROMPT)
    assert len(tokens) == 6 and steps[0] == 40
    core.shutdown()


def test_the_interpreter_switches_threads_sooner_while_the_background_compiles(
    held_background,
) -> None:
    before = sys.getswitchinterval()
    core = EngineCore(engine_config())
    assert sys.getswitchinterval() == warmup.BACKGROUND_SWITCH_INTERVAL_S < before
    held_background.set()
    core.runner.programs.background.thread.join(120)
    assert sys.getswitchinterval() == before
    core.shutdown()


def test_a_bucket_that_fails_to_compile_leaves_the_engine_serving_the_smaller_ones(
    monkeypatch, caplog
) -> None:
    lower_step = StepPrograms.lower_step

    def failing(self, num_tokens, kv_cache=None):
        if num_tokens == 64:
            raise RuntimeError("no 64")
        return lower_step(self, num_tokens, kv_cache)

    monkeypatch.setattr(StepPrograms, "lower_step", failing)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.warmup"):
        core = EngineCore(engine_config())
        core.runner.programs.background.thread.join(120)
    assert core.runner.ready_tokens == 16  # 32's step compiled, its samplers never started
    assert "Compiling the buckets of [32, 64] tokens failed" in caplog.text
    assert "no 64" in caplog.text
    tokens, steps = generate(core, "after", PROMPT)
    assert len(tokens) == 6 and max(steps) == 16
    core.shutdown()


def test_shutdown_stops_the_background_compile_quietly(held_background, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.warmup"):
        core = EngineCore(engine_config())
        core.shutdown()  # returns once the compile thread has stopped
    assert not core.runner.programs.background.thread.is_alive()
    assert sorted(core.runner.programs.compiled_steps) == [16]
    assert core.runner.ready_tokens == 16
    assert "failed" not in caplog.text


def test_the_weights_load_while_the_programs_compile_against_their_shapes(caplog) -> None:
    with caplog.at_level(logging.INFO):
        runner = ModelRunner(
            load_model_config(str(fixture_dir("llama"))),
            engine_config(serve_while_compiling=False, max_num_batched_tokens=16),
        )
        assert isinstance(runner.weights.embed, jax.ShapeDtypeStruct)
        runner.warmup()
    assert isinstance(runner.weights.embed, jax.Array)
    head = runner.programs.head
    assert head is runner.weights.embed or head is runner.weights.lm_head
    assert runner.load_seconds > 0
    assert "Weights ready" in caplog.text


def test_a_load_error_ends_the_start(tmp_path) -> None:
    source = fixture_dir("llama")
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    (shard,) = source.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / shard.name)
    with pytest.raises(WeightsError, match="down_proj.weight.* is missing"):
        EngineCore(engine_config(model=str(tmp_path)))


@pytest.mark.parametrize(
    "family, quantization",
    [
        ("llama", None),
        ("gemma2", None),
        ("qwen3_moe", None),
        ("deepseek_v3", None),
        ("llama", "fp8"),
        ("llama", "int8"),
        ("mixtral", "int8"),
    ],
)
def test_the_weights_shapes_are_what_the_load_makes(family, quantization) -> None:
    model_config = load_model_config(str(fixture_dir(family)))
    config = engine_config(model=str(fixture_dir(family)), quantization=quantization)
    quant = QuantScheme(quantization, quantization) if quantization else None
    loaded, _ = model_weights(model_config, config, jnp.float32, None, quant)
    shapes = abstract_model_weights(model_config, jnp.float32, quant)
    assert jax.tree.structure(shapes) == jax.tree.structure(loaded)
    for shape, array in zip(jax.tree.leaves(shapes), jax.tree.leaves(loaded), strict=True):
        assert (shape.shape, shape.dtype) == (array.shape, array.dtype)


SHARDED_SHAPES_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.engine_config import EngineConfig
    from jaxserve.runner.model_weights import abstract_model_weights, model_weights
    from jaxserve.runner.parallel.sharding import prepare_tp
    for family, ep in (("qwen3", False), ("qwen3_moe", True)):
        path = f"tests/fixtures/models/{family}"
        model_config = load_model_config(path)
        tp = prepare_tp(model_config, 2, expert_parallel=ep)
        config = EngineConfig(model=path, tensor_parallel_size=2, enable_expert_parallel=ep)
        loaded, _ = model_weights(model_config, config, jnp.float32, tp.placement, None)
        shapes = abstract_model_weights(model_config, jnp.float32, None, tp.weight_shardings)
        same = all(
            (s.shape, s.dtype, s.sharding) == (a.shape, a.dtype, a.sharding)
            for s, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(loaded), strict=True)
        )
        print(family, same)
""")


def test_the_weights_shapes_carry_the_tensor_parallel_shardings() -> None:
    stdout = run_with_devices(SHARDED_SHAPES_SCRIPT, 2, timeout=300)
    assert stdout.split() == ["qwen3", "True", "qwen3_moe", "True"]


def test_pre_quantized_checkpoints_load_before_the_compile() -> None:
    model_config = load_model_config(str(fixture_dir("llama")))
    scheme = dataclasses.replace(QuantScheme("int8", "int8"), from_checkpoint=True)
    assert abstract_model_weights(model_config, jnp.float32, scheme) is None


class FakeLowered:
    """A lowered program whose compile fails with ``errors`` in turn, then returns "done";
    records how many compile at once and whether a retry had every slot."""

    def __init__(self, background, errors=(), hold_s=0.0, record=None):
        self.background, self.errors, self.hold_s = background, list(errors), hold_s
        self.record = (
            record if record is not None else {"now": 0, "most": 0, "lock": threading.Lock()}
        )
        self.calls, self.retry_had_every_slot = 0, []

    def compile(self):
        self.calls += 1
        if self.calls > 1:  # a retry: no slot is left for another compile
            free = self.background.slots.acquire(blocking=False)
            if free:
                self.background.slots.release()
            self.retry_had_every_slot.append(not free)
        with self.record["lock"]:
            self.record["now"] += 1
            self.record["most"] = max(self.record["most"], self.record["now"])
        try:
            time.sleep(self.hold_s)
            if self.errors:
                raise self.errors.pop(0)
            return "done"
        finally:
            with self.record["lock"]:
                self.record["now"] -= 1


OOM = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")


def test_shutdown_ends_a_background_compile_with_steps_queued_behind_the_workers() -> None:
    """More model steps than the pool has workers (2 on a 2-core machine): stopping ends the
    queued ones and the thread waiting for them. Cancelled in the queue instead, they never
    told ``as_completed``, and the server hung after SIGTERM."""
    background = step_programs.BackgroundCompile()
    lowered = {bucket: FakeLowered(background, hold_s=0.3) for bucket in (16, 32, 64, 128)}

    class Programs:
        compiled_steps: dict = {}

        def __init__(self) -> None:
            self.background = background

        def lower_step(self, bucket):
            return lowered[bucket]

    pool = concurrent.futures.ThreadPoolExecutor(1)
    background.pool = pool
    buckets = sorted(lowered)

    def compile_steps() -> None:
        with contextlib.suppress(concurrent.futures.CancelledError):
            warmup._compile_steps(
                Programs(), pool, buckets, 0.0, lambda: None, background.compile, False
            )

    background.thread = threading.Thread(target=compile_steps)
    background.thread.start()
    time.sleep(0.1)  # the first step compiles, three wait in the queue
    stopper = threading.Thread(target=background.stop)
    stopper.start()
    stopper.join(timeout=10)
    assert not stopper.is_alive() and not background.thread.is_alive()
    assert sum(program.calls for program in lowered.values()) == 1  # the queued ones ended


@pytest.fixture
def no_sleep(monkeypatch):
    monkeypatch.setattr(step_programs.time, "sleep", lambda s: None)


def test_a_background_compile_out_of_memory_compiles_again_alone(no_sleep) -> None:
    background = step_programs.BackgroundCompile()
    lowered = FakeLowered(background, [OOM, OOM])
    assert background.compile(lowered) == "done"
    assert lowered.calls == 3 and lowered.retry_had_every_slot == [True, True]


def test_a_background_compile_gives_up_after_its_retries_and_other_errors_at_once(
    no_sleep,
) -> None:
    background = step_programs.BackgroundCompile()
    always = FakeLowered(background, [OOM] * 10)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        background.compile(always)
    assert always.calls == 1 + step_programs.BACKGROUND_RETRIES
    other = FakeLowered(background, [jax.errors.JaxRuntimeError("INTERNAL: bad")])
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        background.compile(other)
    assert other.calls == 1
    background.stopping.set()
    with pytest.raises(concurrent.futures.CancelledError):
        background.compile(FakeLowered(background))


def test_background_compiles_run_four_at_a_time() -> None:
    background = step_programs.BackgroundCompile()
    record = {"now": 0, "most": 0, "lock": threading.Lock()}
    programs = [FakeLowered(background, hold_s=0.05, record=record) for _ in range(10)]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        assert list(pool.map(background.compile, programs)) == ["done"] * 10
    assert record["most"] == step_programs.BACKGROUND_SLOTS == 4
