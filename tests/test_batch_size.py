"""The default ``--max-num-seqs``: vLLM's per-device ceiling, sized from the KV cache and the
token budget (``jaxserve/runner/batch_size.py``), in the engine, ``LLM`` and ``capacity``."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import builtin_config_dir
from jaxserve.engine.core import EngineCore
from jaxserve.engine_config import EngineConfig
from jaxserve.runner.batch_size import (
    BatchSize,
    ceiling_for,
    default_batch_size,
    planned_batch_size,
)

GiB = 1024**3


@pytest.mark.parametrize(
    ("platform", "kind", "memory", "ceiling"),
    [
        ("gpu", "NVIDIA H200", 150_109_945_856, 1024),
        ("gpu", "NVIDIA H100 80GB HBM3", 80 * 10**9, 1024),  # 74.5 GiB
        ("gpu", "NVIDIA A100-SXM4-80GB", 80 * 10**9, 256),  # vLLM leaves A100s at 256
        ("gpu", "NVIDIA L40S", 48 * 10**9, 256),
        ("tpu", "TPU v5p", 95 * GiB, 256),
        ("cpu", "cpu", 2 * GiB, 256),
    ],
)
def test_the_ceiling_is_vllms_per_device_default(platform, kind, memory, ceiling) -> None:
    assert ceiling_for(platform, kind, memory) == ceiling


def size(kv_tokens: int | None, *, ceiling=1024, max_model_len=2048, budget=2048) -> BatchSize:
    return default_batch_size(
        ceiling=ceiling,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
    )


def test_the_kv_cache_sets_the_count_between_256_and_the_ceiling() -> None:
    # Llama-3-8B on an H200 at 2,048 tokens: bf16 and fp8 caches.
    assert size(889_504).max_num_seqs == 434
    assert size(1_861_376).max_num_seqs == 908
    assert size(10**8).max_num_seqs == 1024  # the ceiling
    assert size(100_000).max_num_seqs == 256  # never below the old default
    # Sequences are counted at max_model_len when it is shorter than 2,048 tokens ...
    assert size(889_504, max_model_len=1024).max_num_seqs == 868
    # ... and at 2,048 tokens when it is longer, so a long context still batches.
    assert size(889_504, max_model_len=131_072).max_num_seqs == 434


def test_the_token_budget_bounds_the_count() -> None:
    batch = size(10**8, budget=512)
    assert batch.max_num_seqs == 512
    assert "--max-num-batched-tokens 512" in batch.reason
    assert size(10**8, ceiling=256, budget=64).max_num_seqs == 64


def test_an_unsized_plan_takes_the_ceiling() -> None:
    batch = size(None, ceiling=256)
    assert batch.max_num_seqs == 256
    assert "ceiling, 256" in batch.line()


def test_the_reason_names_what_set_the_count() -> None:
    assert "holds 434 sequences of 2,048 tokens" in size(889_504).reason
    assert "ceiling is 1,024" in size(889_504).reason
    assert "at least 256" in size(100_000).reason
    assert "this device's ceiling, 1,024" in size(10**8).reason


def test_the_plan_is_made_again_with_the_count_it_gave() -> None:
    """Fewer sampler rows leave more of the memory to the cache: the second plan's count
    stands when it needs no more sampler rows than the first's, else the first's."""
    plans = {1024: 2048 * 500, 500: 2048 * 600}  # 500 -> 512 rows; 600 would need 1,024
    batch = planned_batch_size(
        plans.__getitem__, ceiling=1024, max_model_len=2048, max_num_batched_tokens=2048
    )
    assert batch.max_num_seqs == 500
    plans = {1024: 2048 * 300, 300: 2048 * 310}  # both fit 512 rows: the second stands
    batch = planned_batch_size(
        plans.__getitem__, ceiling=1024, max_model_len=2048, max_num_batched_tokens=2048
    )
    assert batch.max_num_seqs == 310


def capacity_json(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("device", "kv_cache_dtype", "expected"),
    [("H200", "auto", 427), ("H200", "fp8", 835), ("A100-80GB", "auto", 256)],  # bf16 weights
)
def test_capacity_prints_the_default_launch_takes(capsys, device, kv_cache_dtype, expected) -> None:
    model = str(builtin_config_dir("llama-3-8b"))
    argv = [model, "--device-memory", device, "--max-model-len", "2048"]
    out = capacity_json(capsys, *argv, "--kv-cache-dtype", kv_cache_dtype)
    assert out["max_num_seqs"] == expected
    assert out["max_num_seqs_reason"]
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args(argv + ["--kv-cache-dtype", kv_cache_dtype])) == 0
    assert f"Sequences per step: --max-num-seqs {expected:,} by default" in capsys.readouterr().out


def test_capacity_keeps_the_flag(capsys) -> None:
    model = str(builtin_config_dir("llama-3-8b"))
    out = capacity_json(capsys, model, "--device-memory", "H200", "--max-num-seqs", "64")
    assert out["max_num_seqs"] == 64
    assert out["max_num_seqs_reason"] == "--max-num-seqs"


def test_the_engine_resolves_the_default_and_logs_it(caplog) -> None:
    """On the CPU the ceiling is 256 (the token budget's bound: ``default_batch_size``'s test);
    a given value stays."""
    base = dict(model="", max_model_len=256, warmup=False)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.batch_size"):
        core = EngineCore(EngineConfig(**base))
    try:
        assert core.config.max_num_seqs == 256
        assert core.scheduler.max_num_seqs == 256
        assert core.runner.inputs.pad_row == 256  # the runner's rows: one per sequence + 1
    finally:
        core.shutdown()
    assert "Sequences per step: --max-num-seqs 256 by default" in caplog.text
    given = EngineCore(EngineConfig(**base, max_num_seqs=8))
    try:
        assert given.config.max_num_seqs == given.scheduler.max_num_seqs == 8
    finally:
        given.shutdown()
