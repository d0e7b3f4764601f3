"""The attention reference's temporaries (GPT-OSS's sinks and window on the jnp path): the
planner reserves what XLA allocates where the reference runs (the CPU), nothing where a Pallas
kernel does (a named accelerator)."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import pytest

import jaxserve
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import builtin_config_dir
from pallas_kernels.ragged_paged_attention import reference
from tests.conftest import fixture_dir

MARGIN = 1.3  # the planner's figure is within [1, MARGIN] x XLA's


@pytest.mark.parametrize(
    "shape",
    [
        (16, 4, 2, 16, 256, False, None, jnp.float32),  # the fixtures' shapes
        (2048, 4, 2, 16, 256, True, 16, jnp.float32),  # GPT-OSS's sinks and window
        (256, 8, 1, 64, 1024, True, 128, jnp.bfloat16),  # GPT-OSS-20B per device at -tp 8
    ],
    ids=lambda s: f"T{s[0]}-sinks{s[5]}",
)
def test_planned_reference_temporaries_match_xla(shape) -> None:
    tokens, heads, kv_heads, head_dim, max_kv, sinks, window, dtype = shape
    page, seqs = 16, min(tokens, 256)
    spec = jax.ShapeDtypeStruct
    args = [
        spec((tokens, heads, head_dim), dtype),
        spec((seqs * 2, page, kv_heads, head_dim), dtype),
        spec((seqs * 2, page, kv_heads, head_dim), dtype),
        spec((seqs,), jnp.int32),
        spec((seqs, max_kv // page), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((1,), jnp.int32),
    ] + ([spec((heads,), jnp.float32)] if sinks else [])

    def step(*a):
        options = {"sinks": a[-1]} if sinks else {}
        return reference.ragged_paged_attention(
            *a[:7], sm_scale=0.1, sliding_window=window, **options
        )

    xla = jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes
    planned = reference.temporary_bytes(tokens, heads, kv_heads, head_dim, max_kv, sinks=sinks)
    assert xla <= planned <= MARGIN * xla, (planned, xla)


def capacity_json(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_gpt_oss_reserves_the_reference_only_where_it_runs(capsys, monkeypatch) -> None:
    """GPT-OSS-20B on an H200 runs attention on the Mosaic GPU kernel (sinks included):
    nothing reserved. With JAXSERVE_ATTENTION=reference the plan of this backend reserves
    the reference's rows x context."""
    model = str(builtin_config_dir("gpt-oss-20b"))
    argv = [model, "--max-model-len", "8K", "--device-memory"]
    h200 = capacity_json(capsys, *argv, "H200")
    assert h200["reference_attention_bytes"] == 0
    assert capacity_json(capsys, *argv, "8000GB")["reference_attention_bytes"] == 0  # the CPU
    monkeypatch.setenv("JAXSERVE_ATTENTION", "reference")
    ref = capacity_json(capsys, *argv, "8000GB")
    # 2,048 rows x 8,192 positions x 8 KV heads x 64 x f32, keys and values; 64 heads' scores
    # (with the sink column: four copies).
    gathered = 2 * 2048 * 8192 * 8 * 64 * 4
    scores = 4 * 2048 * 64 * 8193 * 4
    assert ref["reference_attention_bytes"] == gathered + scores + 2 * 2048 * 64 * 64 * 4


def test_gpt_oss_fixture_step_within_its_plan(monkeypatch) -> None:
    """``LLM()``'s 8,192-token steps with the reference asked for: XLA's temporaries of the
    largest step fit in the activations planned (the reference's share named in the capacity
    line)."""
    monkeypatch.setenv("JAXSERVE_ATTENTION", "reference")
    llm = jaxserve.LLM(str(fixture_dir("gpt_oss")), warmup=False, num_gpu_blocks_override=128)
    runner = llm.engine.runner
    step = runner.programs.lower_step(8192).compile().memory_analysis()
    assert runner.capacity.reference_attention_bytes > 0
    assert step.temp_size_in_bytes <= runner.capacity.activation_bytes
    assert "pure-jnp attention reference" in runner.capacity.lines()[0]
