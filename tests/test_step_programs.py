"""StepPrograms alone, with no runner: the fixture Llama's programs lowered against the shapes
of its weights and KV cache, one bucket compiled into the tables, then run on real weights."""

from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.batch import kv_page_shapes, make_kv_cache_for
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner import warmup
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.input_builder import InputBuilder
from jaxserve.runner.model_weights import abstract_model_weights, model_weights
from jaxserve.runner.step_programs import StepPrograms
from tests.conftest import fixture_dir

BLOCK_SIZE, NUM_BLOCKS = 4, 32


def make_programs(model_config: ModelConfig) -> StepPrograms:
    buckets = Buckets.of(
        max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, block_size=BLOCK_SIZE
    )
    inputs = InputBuilder(
        buckets,
        block_size=BLOCK_SIZE,
        max_model_len=64,
        max_num_seqs=4,
        num_slots=NUM_BLOCKS * BLOCK_SIZE,
        vocab_size=model_config.vocab_size,
        compact_samplers=True,  # 3 sampler variants to compile, not 20
    )
    k, v = kv_page_shapes(model_config, NUM_BLOCKS, BLOCK_SIZE)
    page = (jax.ShapeDtypeStruct(k, jnp.float32), jax.ShapeDtypeStruct(v, jnp.float32))
    return StepPrograms(
        model_config,
        buckets,
        inputs,
        weights=abstract_model_weights(model_config, jnp.float32, None),
        kv_cache_shapes=[page] * model_config.num_layers,
        dtype=jnp.float32,
    )


def test_step_programs_compile_a_bucket_and_run_it_without_a_runner() -> None:
    model_dir = fixture_dir("llama")
    model_config = load_model_config(str(model_dir))
    programs = make_programs(model_config)
    assert programs.buckets.token_buckets == (16, 32)
    assert programs.ready_tokens == 32  # no warm-up: every step runs, through the jit
    assert isinstance(programs.weights.embed, jax.ShapeDtypeStruct)

    programs.ready_tokens = 0  # as warm-up starts
    with programs.precision(), concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = time.perf_counter()
        warmup.compile_buckets(programs, pool, [16], start, lambda: None, raise_ready=True)
    assert programs.ready_tokens == 16
    assert sorted(programs.compiled_steps) == [16]
    assert sorted(programs.compiled_logits) == sorted(programs.compiled_prompt_lp) == [16]
    assert set(programs.compiled_samplers) == {
        (4, flags) for flags in programs.inputs.sampler_variants
    }
    assert len(programs.compiled_samplers) == 3

    config = EngineConfig(model=str(model_dir), dtype="float32")
    weights, _ = model_weights(model_config, config, jnp.float32, None, None)
    programs.set_weights(weights)
    kv_cache = make_kv_cache_for(model_config, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    with programs.precision():
        kv_cache = warmup.run_smallest_step(programs, kv_cache)
    assert len(kv_cache) == model_config.num_layers
    # every call found its compiled program: nothing went through the jit
    assert programs.step_fn._cache_size() == 0
    assert programs.sample_fn._cache_size() == 0
    assert programs.logits_fn._cache_size() == 0


def test_first_steps_run_every_compiled_bucket_once_where_first_runs_pay(monkeypatch) -> None:
    """``warmup.run_first_steps``: the smallest bucket's step as before and, where a program's
    first run costs (a GPU: stood in for here), one padding step of each other compiled bucket
    through the greedy sampler, all on the compiled programs; off the GPU the smallest alone."""
    model_dir = fixture_dir("llama")
    model_config = load_model_config(str(model_dir))
    programs = make_programs(model_config)
    with programs.precision(), concurrent.futures.ThreadPoolExecutor(2) as pool:
        warmup.compile_buckets(programs, pool, [16, 32], time.perf_counter(), lambda: None)
    config = EngineConfig(model=str(model_dir), dtype="float32")
    programs.set_weights(model_weights(model_config, config, jnp.float32, None, None)[0])
    kv_cache = make_kv_cache_for(model_config, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    ran = []
    run_step = programs.run_step
    monkeypatch.setattr(
        programs,
        "run_step",
        lambda kv, batch, *a: ran.append(batch.num_tokens) or run_step(kv, batch, *a),
    )
    with programs.precision():
        kv_cache = warmup.run_first_steps(programs, kv_cache)
        assert ran == [16, 16]  # the CPU: the smallest bucket and its pending-token feed
        monkeypatch.setattr(warmup, "runs_every_bucket", lambda: True)
        ran.clear()
        kv_cache = warmup.run_first_steps(programs, kv_cache)
    assert ran == [16, 16, 32]
    assert len(kv_cache) == model_config.num_layers
    assert programs.step_fn._cache_size() == 0 and programs.sample_fn._cache_size() == 0
    monkeypatch.undo()
    assert not warmup.runs_every_bucket()
