"""`jaxserve capacity`: hand-computed numbers for Llama-3-8B on an H200, and agreement with
the engine's own allocation on the CPU."""

from __future__ import annotations

import argparse
import json

import pytest

import jaxserve
from jaxserve.bench.capacity import add_capacity_arguments, parse_memory, run_capacity
from jaxserve.config import builtin_config_dir
from tests.conftest import fixture_dir

GiB = 1024**3


def capacity(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_8b_on_h200_by_hand(capsys) -> None:
    out = capacity(
        capsys,
        str(builtin_config_dir("llama-3-8b")),
        "--max-model-len",
        "8K",
        "--device-memory",
        "H200",
        "--memory-utilization",
        "0.9",
    )
    weights = 8_030_261_248 * 2  # parameters x bf16
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x head_dim x bf16
    activations = 2048 * (4 * 14336 + 6 * 4096) * 2 + 256 * 128256 * 24 + 512 * 1024**2
    budget = int(141e9 * 0.9) - weights - activations
    assert out["weight_bytes"] == weights
    assert out["kv_bytes_per_token"] == kv_per_token == 131072
    assert out["num_blocks"] == budget // (16 * kv_per_token)
    assert out["kv_cache_tokens"] == out["num_blocks"] * 16
    assert out["max_concurrency"] == pytest.approx(out["kv_cache_tokens"] / 8192)


def test_tensor_parallel_and_fp8_scale_the_cache(capsys) -> None:
    base = capacity(capsys, str(builtin_config_dir("llama-3-8b")), "--device-memory", "80GB")
    tp2 = capacity(
        capsys, str(builtin_config_dir("llama-3-8b")), "--device-memory", "80GB", "-tp", "2"
    )
    fp8 = capacity(
        capsys,
        str(builtin_config_dir("llama-3-8b")),
        "--device-memory",
        "80GB",
        "--kv-cache-dtype",
        "fp8",
    )
    assert tp2["weight_bytes"] == base["weight_bytes"] // 2
    assert tp2["kv_bytes_per_token"] == base["kv_bytes_per_token"] // 2
    assert fp8["kv_bytes_per_token"] == base["kv_bytes_per_token"] // 2
    assert fp8["num_blocks"] == pytest.approx(2 * base["num_blocks"], abs=1)


def test_capacity_matches_the_engine_on_cpu(capsys) -> None:
    memory = 96 * 1024**2
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        dtype="float32",
        device_memory_bytes=memory,
        warmup=False,
    )
    out = capacity(
        capsys,
        str(fixture_dir("llama")),
        "--max-model-len",
        "256",
        "--device-memory",
        str(memory),
        "--dtype",
        "float32",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
    )
    assert out["num_blocks"] == llm.engine.runner.num_blocks
    assert f"KV cache size: {out['kv_cache_tokens']:,} tokens" in llm.engine.capacity_lines()


def test_too_long_context_is_a_clear_error(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    args = parser.parse_args(
        [
            str(builtin_config_dir("llama-3-8b")),
            "--device-memory",
            "24GB",
            "--max-model-len",
            "1000k",
        ]
    )
    assert run_capacity(args) == 1
    assert "lower --max-model-len" in capsys.readouterr().err


def test_parse_memory() -> None:
    assert parse_memory("141GB") == 141 * 10**9
    assert parse_memory("16GiB") == 16 * GiB
    assert parse_memory("h200") == 141 * 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        parse_memory("lots")
