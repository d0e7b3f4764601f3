"""Multi-head latent attention's temporaries: the reference walks positions in blocks, the
capacity planner reserves what XLA allocates for it (checked with ``memory_analysis`` on the
CPU), and DeepSeek-V3 plans without tokens x max_model_len.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import builtin_config_dir
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner import capacity as cap
from pallas_kernels.fresh import fresh_full
from pallas_kernels.mla import reference as mla_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.conftest import fixture_dir

GiB = 1024**3


def ragged_batch(rng, q_lens, kv_lens, page_size, num_pages, pages_per_seq):
    order = rng.permutation(num_pages)
    page_indices = order[: len(q_lens) * pages_per_seq].reshape(len(q_lens), pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray([len(q_lens)], jnp.int32),
    )


@pytest.mark.parametrize("row_positions", [16, 64, 1 << 18])
def test_blocked_reference_is_one_head_attention_over_the_joined_latent(
    monkeypatch, row_positions
) -> None:
    """Whatever the block (one page, a few, the whole table), the walk over blocks gives the
    plain reference's one-KV-head attention over [c_kv, k_pe]; padding rows stay zero."""
    monkeypatch.setattr(mla_reference, "ROW_POSITIONS", row_positions)
    rng = np.random.default_rng(1)
    num_pages, page_size, heads, latent, rope_dim = 48, 4, 4, 32, 8
    q_lens, kv_lens = [5, 1, 3, 1], [23, 40, 3, 9]  # a chunk, decodes, a prefill
    num_tokens, pages_per_seq = 12, 10
    q_latent = jnp.asarray(rng.normal(size=(num_tokens, heads, latent)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(num_tokens, heads, rope_dim)), jnp.float32)
    ckv = jnp.asarray(rng.normal(size=(num_pages, page_size, 1, latent)), jnp.float32)
    kpe = jnp.asarray(rng.normal(size=(num_pages, page_size, 1, rope_dim)), jnp.float32)
    batch = ragged_batch(rng, q_lens, kv_lens, page_size, num_pages, pages_per_seq)
    if row_positions == 16:
        assert mla_reference.block_pages(num_tokens, page_size, pages_per_seq) == 1
    got = mla_reference.ragged_paged_mla_attention(q_latent, q_pe, ckv, kpe, *batch, sm_scale=0.3)
    joined = jnp.concatenate([ckv, kpe], axis=-1)
    q = jnp.concatenate([q_latent, q_pe], axis=-1)
    want = ragged_paged_attention(q, joined, joined, *batch, sm_scale=0.3)[..., :latent]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    assert not np.asarray(got[10:]).any()


def test_block_size_follows_the_step_not_the_context() -> None:
    # 2,048 rows take 128 positions a block whatever the page table's width; decode-sized
    # steps take up to 2,048 positions, capped by the table.
    assert mla_reference.block_pages(2048, 16, 10240) * 16 == 128
    assert mla_reference.block_pages(2048, 16, 2048) * 16 == 128
    assert mla_reference.block_pages(16, 16, 10240) * 16 == 2048
    assert mla_reference.block_pages(16, 16, 4) == 4
    assert mla_reference.block_pages(1 << 20, 16, 64) == 1


# (tokens, heads, latent, rope dims, page size, pages per sequence, cache dtype, query dtype):
# the fixture's shapes, and DeepSeek-V3's per device at -tp 8 (16 heads).
SHAPES = [
    (16, 4, 32, 8, 16, 64, jnp.float32, jnp.float32),
    (2048, 4, 32, 8, 16, 64, jnp.float32, jnp.float32),
    (256, 16, 512, 64, 16, 2048, jnp.bfloat16, jnp.bfloat16),
    (256, 16, 512, 64, 16, 2048, jnp.float8_e4m3fn, jnp.bfloat16),
]
# The planner's figure is at least what XLA allocates and at most this many times it.
MARGIN = 1.6


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-N{s[1]}-{jnp.dtype(s[6]).name}")
def test_planned_temporaries_match_xla(shape) -> None:
    tokens, heads, latent, rope_dim, page, pages, cache_dtype, q_dtype = shape
    seqs = min(tokens, 256)
    spec = jax.ShapeDtypeStruct
    args = (
        spec((tokens, heads, latent), q_dtype),
        spec((tokens, heads, rope_dim), q_dtype),
        spec((seqs * 2, page, 1, latent), cache_dtype),
        spec((seqs * 2, page, 1, rope_dim), cache_dtype),
        spec((seqs,), jnp.int32),
        spec((seqs, pages), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((1,), jnp.int32),
    )
    scale = {} if cache_dtype != jnp.float8_e4m3fn else {"ckv_scale": 0.5, "kpe_scale": 0.25}
    step = jax.jit(lambda *a: mla_reference.ragged_paged_mla_attention(*a, sm_scale=0.1, **scale))
    xla = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    planned = mla_reference.temporary_bytes(
        tokens, heads, latent, rope_dim, page, pages,
        jnp.dtype(cache_dtype).itemsize, jnp.dtype(q_dtype).itemsize,
    )  # fmt: skip
    assert xla <= planned <= MARGIN * xla, (planned, xla)


def _layers_temporaries(num_layers: int) -> int:
    """XLA's planned temporaries of ``num_layers`` reference calls, each layer's query the
    previous layer's output, as a step's layers chain."""
    tokens, heads, latent, rope_dim, page, pages = 256, 8, 256, 32, 16, 4
    spec = jax.ShapeDtypeStruct
    args = (
        spec((tokens, heads, latent), jnp.bfloat16),
        spec((tokens, heads, rope_dim), jnp.bfloat16),
        spec((64, page, 1, latent), jnp.bfloat16),
        spec((64, page, 1, rope_dim), jnp.bfloat16),
        spec((8,), jnp.int32),
        spec((8, pages), jnp.int32),
        spec((9,), jnp.int32),
        spec((1,), jnp.int32),
    )

    def layers(q, q_pe, *rest):
        for _ in range(num_layers):
            q = mla_reference.ragged_paged_mla_attention(q, q_pe, *rest, sm_scale=0.1)
        return q

    return jax.jit(layers).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_a_steps_layers_hold_one_calls_temporaries_not_one_a_layer() -> None:
    # Each call's loop starts from its own arrays (pallas_kernels.fresh): a constant start,
    # merged by XLA across the layers, kept a copy of the [T, N, L] f32 accumulator (2 MiB
    # here) live for every layer, beyond the one call the plan reserves.
    assert _layers_temporaries(6) - _layers_temporaries(3) < 256 * 1024


def test_fresh_full_is_its_value_whatever_the_input_holds() -> None:
    for first in (1.5, 0.0, -0.0, float("nan"), float("inf"), -float("inf")):
        like = jnp.asarray([first, 2.0], jnp.bfloat16)
        for value in (0.0, -1e30, 3.0):
            out = np.asarray(fresh_full(like, (2, 3), value, jnp.float32))
            np.testing.assert_array_equal(out, np.full((2, 3), value, np.float32))
            assert not np.signbit(out).any() or value < 0  # a zero start is +0
    ints = fresh_full(jnp.asarray([7], jnp.int32), (4,), 0, jnp.int32)
    assert ints.dtype == jnp.int32 and not np.asarray(ints).any()


def test_deepseek_v3_activations_do_not_grow_with_the_context() -> None:
    """The full model at -tp 8: a few GiB of activations (it was 1,763 GiB at its 163,840
    positions and 355 GiB at 32K), the same at every context."""
    config = load_model_config(builtin_config_dir("deepseek-v3"))

    def activations(max_model_len: int) -> int:
        plan = cap.plan_capacity(
            config,
            max_model_len=max_model_len,
            device_memory_bytes=8000 * 10**9,
            memory_utilization=0.9,
            tensor_parallel_size=8,
        )
        return plan.activation_bytes

    full = activations(163_840)
    assert 3 * GiB < full < 6 * GiB  # (5.02: the sampler's 10 copies, the programs' 768 MiB)
    assert activations(32 * 1024) == full == activations(4096)
    mla = cap.mla_attention_bytes(config, 2048, 32 * 1024, 16, tensor_parallel_size=8)
    assert 0.5 * GiB < mla < 1.5 * GiB  # 16 heads per device, not 128


@pytest.fixture(scope="module")
def long_fixture(tmp_path_factory) -> Path:
    """The DeepSeek-V3 fixture with 1,024 positions (the shipped one has 256)."""
    path = tmp_path_factory.mktemp("deepseek_v3_1024")
    shutil.copytree(fixture_dir("deepseek_v3"), path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fixture_serves_with_llm_defaults_within_its_plan(long_fixture) -> None:
    """``LLM()``'s defaults (8,192-token steps, 1,024 positions) start on the CPU, serve
    Hugging Face's greedy tokens, and the largest step's temporaries (XLA's count) are within
    the activations the plan reserved."""
    llm = jaxserve.LLM(str(long_fixture), warmup=False)
    runner = llm.engine.runner
    golden = np.load(fixture_dir("deepseek_v3") / "golden.npz")
    params = jaxserve.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": golden["prompt_ids"].tolist()}, params)
    assert out[0].outputs[0].token_ids == golden["greedy_ids"].tolist()
    largest = runner.programs.buckets.token_buckets[-1]
    assert largest == 8192
    step = runner.programs.lower_step(largest).compile().memory_analysis()
    assert step.temp_size_in_bytes <= runner.capacity.activation_bytes
    assert any("multi-head latent attention" in line for line in runner.capacity.lines())


def test_kernel_path_plans_its_output_and_names_the_path(capsys) -> None:
    """A named Hopper device (the H200) plans the Pallas Mosaic GPU MLA kernel (``auto``'s path
    there) and names it; the Triton kernel's plan: at DeepSeek-V3's shapes per device at -tp
    16 (8 heads, latent 512) a 2,048-token step fills the GPU unsplit, so one call holds its
    bf16 output, 2,048 x 8 x 512 x 2 bytes, as the Mosaic GPU kernel's does."""
    config = load_model_config(builtin_config_dir("deepseek-v3"))
    got = cap.mla_attention_bytes(config, 2048, 32768, 16, 16, 2, path="triton")
    assert got == 2048 * 8 * 512 * 2
    # 4 tokens of one prompt: 2 tiles of 8 tokens x 8 heads, whose 32K range splits while
    # 2 tiles x splits fill under two waves of 108 SMs (the kernels' count where the device
    # does not say, as on this CPU): 64 ways, f32 partials and lse
    splits = 64
    small = cap.mla_attention_bytes(config, 4, 32768, 16, 16, 2, path="triton")
    assert small == 4 * 8 * 512 * 2 + splits * 4 * 8 * 513 * 4
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    args = [str(builtin_config_dir("deepseek-v3")), "-tp", "16", "--device-memory", "H200"]
    assert run_capacity(parser.parse_args([*args, "--max-model-len", "32K"])) == 0
    text = capsys.readouterr().out
    assert "(of which 0.02 GiB for multi-head latent attention's temporaries on the Pallas " \
        "Mosaic GPU kernel path, per step" in text  # fmt: skip
    assert cap.mla_attention_bytes(config, 2048, 32768, 16, 16, 2, path="mosaic") == got
