"""`jaxserve capacity`: hand-computed numbers for Llama-3-8B on an H200, and agreement with
the engine's own allocation on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import jaxserve
from jaxserve.bench.capacity import add_capacity_arguments, parse_memory, run_capacity
from jaxserve.config import builtin_config_dir
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from tests.conftest import fixture_dir, free_port, wait_for

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
    # The default --max-num-seqs on an H200 holds as many 2,048-token sequences as the cache
    # does (427, below the device's 1,024): the sampler reserves 512 rows (f32 logits x 10).
    activations = 2048 * (4 * 14336 + 6 * 4096) * 2 + 512 * 128256 * 40 + (512 + 768) * 1024**2
    budget = int(150_109_945_856 * 0.9) - weights - activations  # what an H200 reports
    assert out["weight_bytes"] == weights
    assert out["kv_bytes_per_token"] == kv_per_token == 131072
    assert out["num_blocks"] == budget // (16 * kv_per_token)
    assert out["kv_cache_tokens"] == out["num_blocks"] * 16
    assert out["max_concurrency"] == pytest.approx(out["kv_cache_tokens"] / 8192)
    assert out["max_num_seqs"] == out["kv_cache_tokens"] // 2048 == 427


def test_the_plan_keeps_room_for_what_compiled_programs_hold() -> None:
    """768 MiB of the headroom (1/32 of a small device) is for what warm-up's compile leaves
    in use: an fp8 engine on an H100 kept 0.66 GiB there, outside the plan, and its first
    sampler step ran out of memory. ``step_bytes`` is the rest: what a step may take, which
    warm-up checks once that memory is held."""
    from jaxserve.runner.capacity import PROGRAMS_BYTES, plan_capacity, programs_bytes

    config = load_model_config(str(builtin_config_dir("llama-3-8b")))
    gib = 1 << 30
    assert programs_bytes(80 * gib) == PROGRAMS_BYTES == 768 * 1024**2
    assert programs_bytes(8 * gib) == gib // 4  # a small device: 1/32 of it
    plan = {"max_model_len": 2048, "memory_utilization": 0.9}
    big = plan_capacity(config, device_memory_bytes=80 * gib, **plan)
    assert big.activation_bytes - big.step_bytes == PROGRAMS_BYTES
    small = plan_capacity(config, device_memory_bytes=16 * gib, num_blocks_override=128, **plan)
    assert small.activation_bytes - small.step_bytes == 16 * gib // 32 == 512 * 1024**2


def test_the_plan_holds_every_sampler_variants_temporaries() -> None:
    """The plan keeps ``SAMPLER_F32_COPIES`` f32 copies of the sampler's logits for its
    temporaries: every variant's, as XLA plans them (the one doing everything: 9.1 copies
    here). An H100 engine ran out of memory in a sampler step that asked 9.45 copies where the
    plan had kept 6."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.runner.capacity import SAMPLER_F32_COPIES
    from jaxserve.runner.packing import pack
    from jaxserve.runner.programs import sample_step
    from jaxserve.runner.sampling import SamplerFlags, SamplingInputs

    rows, vocab = 64, 8192
    sample = jax.jit(
        functools.partial(sample_step, num_rows=rows), static_argnames=("layout", "flags")
    )
    copies = {}
    for flags in SamplerFlags.variants():
        adjust = flags.adjust_logits
        inputs = SamplingInputs.padding(
            rows, vocab, 40 if adjust else 0, 256 if adjust else 0, use_mask=flags.use_mask
        )
        packed, layout = pack(inputs)
        logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
        compiled = sample.lower(logits, packed, layout=layout, flags=flags).compile()
        copies[flags] = compiled.memory_analysis().temp_size_in_bytes / (rows * vocab * 4)
    assert max(copies.values()) <= SAMPLER_F32_COPIES, copies
    assert max(copies.values()) > SAMPLER_F32_COPIES - 2  # the bound is not loose either


def test_tensor_parallel_and_fp8_scale_the_cache(capsys) -> None:
    model = str(builtin_config_dir("llama-3-8b"))
    on_80gb = ["--device-memory", "80GB", "--max-num-seqs", "256"]  # the same sampler rows
    base = capacity(capsys, model, *on_80gb)
    tp2 = capacity(capsys, model, *on_80gb, "-tp", "2")
    fp8 = capacity(capsys, model, *on_80gb, "--kv-cache-dtype", "fp8")
    assert tp2["weight_bytes"] == base["weight_bytes"] // 2
    assert tp2["kv_bytes_per_token"] == base["kv_bytes_per_token"] // 2
    assert fp8["kv_bytes_per_token"] == base["kv_bytes_per_token"] // 2
    assert fp8["num_blocks"] == pytest.approx(2 * base["num_blocks"], abs=1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_capacity_matches_the_engine_on_cpu(capsys, kv_cache_dtype) -> None:
    memory = 96 * 1024**2
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
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
        "--kv-cache-dtype",
        kv_cache_dtype,
    )
    runner = llm.engine.runner
    assert out["num_blocks"] == runner.num_blocks
    assert out["kv_cache_dtype"] == {"auto": "float32", "fp8": "fp8_e4m3"}.get(
        kv_cache_dtype, kv_cache_dtype
    )
    size_line = f"KV cache size: {out['kv_cache_tokens']:,} tokens"
    assert any(line.startswith(size_line) for line in llm.engine.capacity_lines())
    # What is allocated is what was planned: blocks x block size x bytes per token.
    cache_bytes = sum(x.nbytes for layer in runner.kv_cache for x in layer)
    assert cache_bytes == out["num_blocks"] * out["block_size"] * out["kv_bytes_per_token"]


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
    assert parse_memory("16G") == 16 * GiB  # the k/K rule of every count
    assert parse_memory("h200") == 150_109_945_856
    with pytest.raises(argparse.ArgumentTypeError, match="H200"):
        parse_memory("lots")


def test_the_h200_preset_plans_what_launch_logged_on_an_h200(capsys) -> None:
    # benchmarks/reports/2026-12-02-engine-on-the-h200: every start of the launch stage (dummy
    # Llama-3-8B, 4,096 context, 2,048 batched tokens, utilization 0.9) logged these lines on the
    # H200 (895,520 tokens, 218.63x, 109.32 GiB), before the plan kept 768 MiB for what the
    # compiled programs hold (``capacity.PROGRAMS_BYTES``) and 4 more f32 copies of the
    # sampler's 256 rows of logits (``SAMPLER_F32_COPIES``): 10,160 tokens fewer now.
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    argv = [str(builtin_config_dir("llama-3-8b")), "--device-memory", "H200"]
    args = parser.parse_args([*argv, "--max-model-len", "4096", "--max-num-seqs", "256"])
    assert run_capacity(args) == 0
    out = capsys.readouterr().out
    assert "KV cache size: 885,360 tokens" in out
    assert "Maximum concurrency for 4,096 tokens per request: 216.15x" in out
    assert "Model weights take 14.96 GiB" in out and "KV cache memory: 108.08 GiB" in out
    assert "8.03B parameters, bfloat16 weights" in out


def test_without_an_accelerator_capacity_says_so_and_names_the_fix(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([str(builtin_config_dir("llama-3-8b"))])) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no accelerator found (JAX sees only the CPU)")
    assert "--device-memory H200 (or any size, such as 80GB)" in err
    # A model that fits is planned as launch would run it here, with the same note.
    assert run_capacity(parser.parse_args([])) == 0
    captured = capsys.readouterr()
    assert "No accelerator found" in captured.err and "--device-memory H200" in captured.err
    assert "4.20M parameters, float32 weights" in captured.out  # the demo model


def test_capacity_uses_the_dtype_launch_would(capsys) -> None:
    on_cpu = capacity(capsys)  # the demo model, this machine (a CPU)
    on_device = capacity(capsys, "--device-memory", "2GiB")  # an accelerator of that size
    assert (on_cpu["dtype"], on_device["dtype"]) == ("float32", "bfloat16")
    assert not on_cpu["accelerator"] and on_device["accelerator"]
    assert on_cpu["weight_bytes"] == 2 * on_device["weight_bytes"]
    assert capacity(capsys, "--dtype", "bfloat16")["dtype"] == "bfloat16"


@pytest.mark.parametrize("kv_flags", [[], ["--kv-cache-dtype", "fp8"]], ids=["auto", "fp8"])
def test_capacity_agrees_with_launch_log_lines(tmp_path, capsys, kv_flags) -> None:
    """The demo model with default flags on this CPU: the lines `jaxserve capacity` prints
    are the lines `jaxserve launch` logs (same dtype, memory and defaults)."""
    port = free_port()
    log_path = tmp_path / "launch.log"
    command = [sys.executable, "-m", "jaxserve.cli", "launch", "--host", "127.0.0.1",
               "--port", str(port), "--compilation-cache-dir", str(tmp_path / "xla"),
               *kv_flags]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:  # the capacity lines come before compiling: no need to wait for more
        wait_for(
            lambda: "Maximum concurrency" in log_path.read_text() or process.poll() is not None,
            120,
            "the capacity lines",
        )
    finally:
        process.kill()
        process.wait(10)
    launch_log = log_path.read_text()
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args(kv_flags)) == 0
    lines = capsys.readouterr().out.splitlines()
    planned = [
        line for line in lines if line.startswith(("Model weights", "Available", "KV", "Max"))
    ]
    assert len(planned) == 4
    for line in planned:
        assert line in launch_log, (line, launch_log)
    kv_dtype = "fp8_e4m3" if kv_flags else "float32"
    assert f"tokens (KV cache dtype {kv_dtype})" in planned[2]


def test_a_mixture_of_experts_counts_every_expert(capsys) -> None:
    """Qwen3-30B-A3B: all 128 experts of its 48 layers are resident, 8 per token active."""
    model = str(builtin_config_dir("qwen3-30b-a3b"))
    # (256 sequences a step: the default would hold the cache's 353 of 2,048 tokens)
    argv = ["--max-model-len", "8K", "--device-memory", "H200", "--max-num-seqs", "256"]
    out = capacity(capsys, model, *argv)
    assert out["num_params"] == 30_532_122_624
    assert out["num_active_params"] == 3_353_032_704
    assert out["weight_bytes"] == 30_532_122_624 * 2  # bf16, every expert
    kv_per_token = 2 * 48 * 4 * 128 * 2  # K and V x layers x kv heads x head_dim x bf16
    # The experts' rows (8 a token): gathered, gate/up/hidden, down, reordered; the f32 combine;
    # the router's f32 [T, E] x 3; the i32 order, inverse and ids.
    experts = 8 * (3 * 2048 + 3 * 768) * 2 + 4 * 8 * 2048 + 3 * 4 * 128 + 3 * 4 * 8
    per_token = (4 * 6144 + 6 * 2048) * 2 + experts
    activations = 2048 * per_token + 256 * 151936 * 40 + (512 + 768) * 1024**2
    budget = int(150_109_945_856 * 0.9) - out["weight_bytes"] - activations
    assert out["kv_bytes_per_token"] == kv_per_token
    assert out["num_blocks"] == budget // (16 * kv_per_token)
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([model, "--device-memory", "H200"])) == 0
    text = capsys.readouterr().out
    assert "30.53B parameters" in text
    assert "128 experts, 8 per token; 3.35B parameters active per token" in text


def test_gpt_oss_counts_its_stacked_experts_and_biases(capsys) -> None:
    """gpt-oss-20b (bf16): 32 experts stored as stacked tensors, 4 per token active."""
    model = str(builtin_config_dir("gpt-oss-20b"))
    out = capacity(capsys, model, "--max-model-len", "8K", "--device-memory", "H200")
    assert out["num_params"] == 20_914_757_184
    assert out["weight_bytes"] == 20_914_757_184 * 2  # bf16, every expert
    # Idle experts: 28 of 32 per layer, each gate_up, down and their biases.
    per_expert = 2880 * 2 * 2880 + 2 * 2880 + 2880 * 2880 + 2880
    assert out["num_active_params"] == 20_914_757_184 - 24 * 28 * per_expert
    assert out["kv_bytes_per_token"] == 2 * 24 * 8 * 64 * 2  # every layer keeps its blocks
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([model, "--device-memory", "H200"])) == 0
    assert "32 experts, 4 per token" in capsys.readouterr().out


def test_the_experts_reserve_counts_their_rows_per_device() -> None:
    """Qwen3-30B-A3B at 2,048 tokens: R = 16,384 rows of H 2,048 and M 768; a tensor-parallel
    device holds a slice of M, an expert-parallel one every device's worst-case rows and the
    all-to-all's buffers."""
    from jaxserve.runner.capacity import expert_activation_bytes

    config = load_model_config(builtin_config_dir("qwen3-30b-a3b"))
    rows, h, m = 2048 * 8, 2048, 768
    router, index = 3 * 4 * 2048 * 128, 3 * 4 * rows
    one = router + index + rows * (3 * h + 3 * m) * 2 + 4 * rows * h
    assert expert_activation_bytes(config, 2048, 2) == one
    sliced = router + index + rows * (3 * h + 3 * (m // 4)) * 2 + 4 * rows * h
    assert expert_activation_bytes(config, 2048, 2, tensor_parallel_size=4) == sliced
    # 3 devices: ceil(2048 / 3) = 683 tokens routed by each, 3 x 683 x 8 rows run by each.
    ep_rows = 3 * 683 * 8
    ep = router + 3 * 4 * ep_rows + ep_rows * (6 * h + 3 * m) * 2 + 4 * 683 * 8 * h
    assert expert_activation_bytes(config, 2048, 2, 3, expert_parallel=True) == ep
    dense = load_model_config(builtin_config_dir("llama-3-8b"))
    assert expert_activation_bytes(dense, 2048, 2) == 0


def test_the_experts_reserve_holds_what_xla_allocates_for_them(monkeypatch) -> None:
    """One MoE layer compiled by XLA, its grouped matmuls replaced by a stand-in that, like
    the GPU kernel, allocates only its output: XLA's own count of the temporaries fits in the
    reserve, from decode to prefill sizes."""
    import jax
    import jax.numpy as jnp

    from jaxserve.config import MoeConfig
    from jaxserve.models import moe
    from jaxserve.runner.capacity import expert_activation_bytes

    def stand_in(lhs, rhs, group_sizes):  # [R, K] x [G, K, N] -> [R, N], no temporary
        return (lhs[:, :1] * rhs[0, :1, :]).astype(lhs.dtype)

    hidden, inner, num_experts, top_k = 256, 64, 16, 4
    config = model_config_from_dict(
        dict(model_type="qwen3_moe", vocab_size=320, hidden_size=hidden, intermediate_size=96,
             moe_intermediate_size=inner, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, num_experts=num_experts, num_experts_per_tok=top_k)
    )  # fmt: skip
    assert config.moe is not None
    moe_config = MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=inner)
    spec = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    weights = moe.MoeWeights(
        spec((hidden, num_experts), bf16),
        spec((num_experts, hidden, inner), bf16),
        spec((num_experts, hidden, inner), bf16),
        spec((num_experts, inner, hidden), bf16),
    )
    monkeypatch.setattr(moe, "grouped_matmul", stand_in)
    for num_tokens in (16, 1024):
        layer = jax.jit(lambda x, w: moe.moe_block(x, w, moe_config, jax.nn.silu))
        compiled = layer.lower(spec((num_tokens, hidden), bf16), weights).compile()
        used = compiled.memory_analysis().temp_size_in_bytes
        assert 0 < used <= expert_activation_bytes(config, num_tokens, 2), num_tokens


def test_capacity_plans_expert_parallel_as_launch_would(capsys) -> None:
    """The experts' all-to-all buffers come out of the KV budget under expert parallelism."""
    model = str(builtin_config_dir("qwen3-30b-a3b"))
    flags = ("--max-model-len", "8K", "--device-memory", "H200", "-tp", "4")
    sliced = capacity(capsys, model, *flags)
    whole = capacity(capsys, model, *flags, "--enable-expert-parallel")
    assert whole["activation_bytes"] > sliced["activation_bytes"]
    assert whole["num_blocks"] < sliced["num_blocks"]


def test_lora_slots_are_counted_on_their_own_line(capsys) -> None:
    """--enable-lora: per slot, layer and projection A [in, R] + B [R, out] in bf16, out of
    the KV budget; under TP=2 the split matrices count half."""
    llama = str(builtin_config_dir("llama-3-8b"))
    flags = ("--device-memory", "H200", "--max-model-len", "8K")
    base = capacity(capsys, llama, *flags)
    lora = ("--enable-lora", "--max-loras", "8", "--max-lora-rank", "16")
    out = capacity(capsys, llama, *flags, *lora)
    # q, k, v, o, gate, up, down: (in + out) x rank, per slot and layer
    per_slot_layer = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert out["lora_bytes"] == 8 * 32 * per_slot_layer * 2 == 671_088_640  # 0.625 GiB
    assert base["lora_bytes"] == 0
    kv_bytes = out["kv_bytes_per_token"] * out["block_size"]
    assert out["num_blocks"] == (base["kv_budget_bytes"] - out["lora_bytes"]) // kv_bytes
    tp2 = capacity(capsys, llama, *flags, *lora, "-tp", "2")
    # Replicated: A of q/k/v/gate/up, B of o/down; split: the rest.
    replicated = 16 * (4096 * 5 + 4096 * 2)
    split = 16 * (4096 + 1024 * 2 + 4096 + 14336 * 3)
    assert tp2["lora_bytes"] == 8 * 32 * (replicated + split // 2) * 2
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([llama, *flags, *lora])) == 0
    text = capsys.readouterr().out
    assert "LoRA adapter slots take 0.62 GiB per device (8 slots of rank 16" in text


def test_the_engine_takes_the_lora_slots_out_of_the_kv_budget(capsys) -> None:
    import jax

    memory = 96 * 1024**2
    engine = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    with jaxserve.LLM(
        str(fixture_dir("llama")), dtype="float32", device_memory_bytes=memory, warmup=False,
        enable_lora=True, max_loras=3, max_lora_rank=8, **engine,
    ) as llm:  # fmt: skip
        core = llm.engine
        slots_bytes = sum(x.nbytes for x in jax.tree.leaves(core.lora_slots.weights))
        num_blocks = core.runner.num_blocks
        lines = core.capacity_lines()
    out = capacity(
        capsys, str(fixture_dir("llama")), "--max-model-len", "256", "--device-memory",
        str(memory), "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens",
        "32", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
    )  # fmt: skip
    assert out["lora_bytes"] == slots_bytes > 0  # what is allocated is what was counted
    assert out["num_blocks"] == num_blocks
    assert any(line.startswith("LoRA adapter slots take") for line in lines)


def test_a_gpu_without_a_memory_limit_plans_with_its_kinds_memory_or_the_drivers() -> None:
    """XLA_PYTHON_CLIENT_ALLOCATOR=platform reports no bytes_limit: the plan takes the table's
    figure for the device's kind, else nvidia-smi's total, else refuses (it planned for the
    CPU's 2 GiB before, and an 8B model did not fit an H200)."""
    from jaxserve.runner.capacity import (
        DEVICE_MEMORY_BYTES,
        CapacityError,
        gpu_memory_without_limit,
    )

    def no_driver() -> int | None:
        return None

    assert gpu_memory_without_limit("NVIDIA H200", no_driver) == DEVICE_MEMORY_BYTES["H200"]
    h100 = gpu_memory_without_limit("NVIDIA H100 80GB HBM3", no_driver)
    assert h100 == DEVICE_MEMORY_BYTES["H100-80GB"]
    assert gpu_memory_without_limit("NVIDIA L4", no_driver) == DEVICE_MEMORY_BYTES["L4"]
    assert gpu_memory_without_limit("NVIDIA L40S", no_driver) == DEVICE_MEMORY_BYTES["L40S"]
    assert gpu_memory_without_limit("NVIDIA RTX 6000 Ada", lambda: 48 * 2**30) == 48 * 2**30
    with pytest.raises(CapacityError, match="RTX 6000 Ada reports no memory limit"):
        gpu_memory_without_limit("NVIDIA RTX 6000 Ada", no_driver)


def test_the_allocator_share_is_raised_to_the_engines_never_lowered(monkeypatch) -> None:
    """``reserve_device_memory``: before the backend starts, the pool is at least the engine's
    share; a larger one already set (a trainer's room in the same process) stays; once the
    backend has started nothing changes (the capacity plan divides by what it started with)."""
    from jax._src import xla_bridge

    from jaxserve.runner.capacity import MEM_FRACTION_ENV, reserve_device_memory

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv(MEM_FRACTION_ENV, raising=False)
    reserve_device_memory(0.9)
    assert os.environ[MEM_FRACTION_ENV] == "0.9"
    monkeypatch.setenv(MEM_FRACTION_ENV, "0.95")
    reserve_device_memory(0.4)
    assert os.environ[MEM_FRACTION_ENV] == "0.95"
    monkeypatch.setenv(MEM_FRACTION_ENV, "0.3")
    reserve_device_memory(0.4)
    assert os.environ[MEM_FRACTION_ENV] == "0.4"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    reserve_device_memory(0.9)
    assert os.environ[MEM_FRACTION_ENV] == "0.4"


class _Device:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def memory_stats(self) -> dict:
        return self.stats


def test_the_start_warns_where_the_compile_left_less_than_the_planned_headroom(
    monkeypatch, caplog
) -> None:
    """Before the KV cache is made: the allocator's limit, less what is in use with the
    weights in place and less the cache, must hold the activation headroom; where it does not
    (a compile on an empty cache left 0.56 GiB in use on an H100, and a sampler step ran out
    of memory), a warning names the shortfall and what to change. The CPU backend keeps no
    such statistics: nothing is said."""
    from jaxserve.runner import warmup

    gib = 1 << 30
    stats = {"bytes_limit": 71 * gib, "largest_free_block_bytes": 55 * gib}

    def run(in_use: float) -> list[str]:
        caplog.clear()
        device = _Device({**stats, "bytes_in_use": int(in_use * gib)})
        monkeypatch.setattr(warmup.jax, "local_devices", lambda: [device])
        with caplog.at_level("INFO", logger="jaxserve.runner.warmup"):
            warmup.log_free_memory(53 * gib, int(2.5 * gib))
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    assert run(15.0) == []  # 71 - 15 - 53 = 3 GiB left, 2.5 planned
    assert run(15.5 + 0.5 / 1024) == []  # 0.5 MiB short: rounding, not a shortfall
    (warning,) = run(16.0)  # 2 GiB left
    assert "keeps 2.00 GiB" in warning and "512.0 MiB less than planned" in warning
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in warning and "--num-gpu-blocks-override" in warning
    monkeypatch.setattr(warmup.jax, "local_devices", lambda: [_Device({})])
    warmup.log_free_memory(53 * gib, int(2.5 * gib))  # the CPU's: no statistics, no line
