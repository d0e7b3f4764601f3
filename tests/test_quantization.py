"""Weights quantized on load (--quantization fp8 | int8): round trips, the quantized matmul
against numpy, each mode against the unquantized fixture model within a documented tolerance,
device checks, unsupported formats, the CLI / LLM wiring, sharding and capacity.

Tolerances on the fixtures (random tiny models, logits up to ~5, std ~1.2; measured on llama
and qwen3, 56 prompt positions): fp8 weight-only and W8A8 max logit error under 0.3 x the
largest logit (measured 0.09-0.21), greedy agreement 100% where the fp32 top-2 margin is above
0.5; int8 max error under 0.08 x the largest logit (measured 0.03-0.05), 100% above 0.5.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import ModelConfig, builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models import decoder, quant
from jaxserve.models.batch import make_kv_cache
from jaxserve.models.families.registry import layer_fields, load_model_config
from jaxserve.models.layers import Weights
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.models.loading.quant_checkpoint import pack_np
from jaxserve.models.quant import QArray, dequantize, linear, quantize, unpack_int4
from jaxserve.models.quant_scheme import (
    QuantizationError,
    QuantScheme,
    check_device,
    parse_checkpoint,
    resolve_scheme,
    weight_bytes,
)
from jaxserve.runner.capacity import DEVICE_MEMORY_BYTES, plan_capacity
from jaxserve.runner.parallel.sharding import weight_specs
from jaxserve.server.launch.flags import add_launch_arguments, engine_config_from_args
from tests.conftest import fixture_dir, run_with_devices
from tests.test_model_parity import PAGE, one_sequence_batch

FP8 = QuantScheme(method="fp8", weight_format="fp8")
INT8 = QuantScheme(method="int8", weight_format="int8")
W8A8 = dataclasses.replace(FP8, act_quant=True)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_round_trip_within_half_a_step(fmt: str) -> None:
    """Per output channel: int8 within half a step (amax / 127 / 2), fp8 within half an ulp of
    e4m3 (3 mantissa bits: 1/16 of the value, or of the channel's smallest normal)."""
    w = np.random.default_rng(0).normal(size=(48, 40)).astype(np.float32)
    w[3] = 0.0  # an all-zero channel stays zero
    q = quantize(w, fmt, (40,), (48,))
    back = np.asarray(dequantize(q, jnp.float32))
    amax = np.abs(w).max(axis=1, keepdims=True)
    if fmt == "int8":
        bound = amax / 127 / 2 + 1e-7
    else:
        bound = np.maximum(np.abs(w) / 16, amax / 448 * 2.0**-6 / 16) + 1e-7
    assert np.all(np.abs(back - w) <= bound)
    assert np.all(back[3] == 0)
    # The device path (dummy weights) gives the same values as the host path (loading).
    q_dev = jax.jit(quantize, static_argnums=(1, 2, 3))(jnp.asarray(w), fmt, (40,), (48,))
    np.testing.assert_array_equal(np.asarray(q_dev.q).astype(np.float32), q.q.astype(np.float32))
    np.testing.assert_allclose(np.asarray(q_dev.scale), q.scale, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_host_and_device_quantize_bit_for_bit(fmt: str) -> None:
    """Loading (numpy) and dummy weights (jit) round every scale and value alike: XLA turns a
    division by a constant or by a broadcast into a product with the reciprocal, so both are
    written that way. (As divisions, one scale in 20 and one quotient in 4 came out an ulp apart,
    and now and then a value rounded to the next step.)"""
    w = np.random.default_rng().normal(size=(2048, 256)).astype(np.float32)
    q = quantize(w, fmt, (256,), (2048,))
    q_dev = jax.jit(quantize, static_argnums=(1, 2, 3))(jnp.asarray(w), fmt, (256,), (2048,))
    np.testing.assert_array_equal(np.asarray(q_dev.scale), q.scale)
    np.testing.assert_array_equal(np.asarray(q_dev.q).astype(np.float32), q.q.astype(np.float32))


def test_int4_unpack_inverts_the_packing() -> None:
    values = np.random.default_rng(1).integers(0, 16, size=(5, 64)).astype(np.uint8)
    packed = pack_np(values)  # i32[5, 8], the first value in the lowest bits
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), values)


def _grouped(num_out: int, num_in: int, group: int, act_order: bool) -> tuple[QArray, np.ndarray]:
    """A 4-bit QArray and its f32 [out, in] weight, computed here without quant.py."""
    rng = np.random.default_rng(2)
    values = rng.integers(0, 16, size=(num_out, num_in)).astype(np.uint8)
    zero = rng.integers(0, 16, size=(num_out, num_in // group)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, size=(num_out, num_in // group)).astype(np.float32)
    g_idx = np.arange(num_in) // group
    if act_order:
        g_idx = rng.permutation(g_idx)
    w = (values.astype(np.float32) - zero[:, g_idx]) * scale[:, g_idx]
    q = QArray(
        q=jnp.asarray(pack_np(values)),
        scale=jnp.asarray(scale),
        zero=jnp.asarray(zero),
        g_idx=jnp.asarray(g_idx, jnp.int32) if act_order else None,
        in_shape=(num_in,),
        out_shape=(num_out // 8, 8),
    )
    return q, w


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_on_packed_groups_matches_numpy(act_order: bool, dtype) -> None:
    q, w = _grouped(32, 64, 16, act_order)
    x = np.random.default_rng(3).normal(size=(3, 64)).astype(np.float32)
    y = linear(jnp.asarray(x, dtype), q, "unused for a QArray")
    assert y.shape == (3, 4, 8) and y.dtype == dtype  # out_shape restored, x's dtype kept
    x_in = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: 8 bits of the weights and the output
    expected = x_in @ w.T
    np.testing.assert_allclose(
        np.asarray(y.astype(jnp.float32)).reshape(3, 32),
        expected,
        rtol=tol,
        atol=tol * np.abs(expected).max(),
    )


def test_w8a8_matches_a_per_token_fp8_reference(monkeypatch) -> None:
    """XLA's fp8 dot (fp8 operands, f32 accumulation) equals numpy on the same fp8 values."""
    monkeypatch.setattr(quant, "W8A8_MIN_TOKENS", 1)  # 5 tokens: a decode-sized matmul
    rng = np.random.default_rng(4)
    w = rng.normal(size=(24, 32)).astype(np.float32)
    x = rng.normal(size=(5, 32)).astype(np.float32) * np.array([[0.01], [1], [10], [0], [3]])
    q = quantize(w, "fp8", (32,), (24,), act_quant=True)
    y = np.asarray(jax.jit(lambda x: linear(x, q, ""))(jnp.asarray(x)))
    x_scale = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-12) / 448
    xq = (x / x_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    expected = (xq @ q.q.astype(np.float32).T) * x_scale * q.scale
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert np.all(y[3] == 0)  # an all-zero token


def test_fp8_weights_are_read_weight_only_in_decode_sized_steps() -> None:
    """Under W8A8_MIN_TOKENS tokens the fp8 weights are converted inside the GEMM and the
    activations stay unquantized (W8A8 at batch 1 took 7.1 ms a step on the H200, bf16 5.0)."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(24, 32)).astype(np.float32)
    q = quantize(w, "fp8", (32,), (24,), act_quant=True)
    for tokens in (1, quant.W8A8_MIN_TOKENS - 1):
        x = rng.normal(size=(tokens, 32)).astype(np.float32)
        y = np.asarray(jax.jit(lambda x: linear(x, q, ""))(jnp.asarray(x)))
        expected = (x @ q.q.astype(np.float32).T) * q.scale
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda x: linear(x, q, ""))(jnp.zeros((1, 32))))
    assert "f8_e4m3fn[1,32]" not in jaxpr  # no quantized activations
    big = jnp.zeros((quant.W8A8_MIN_TOKENS, 32))
    assert f"f8_e4m3fn[{quant.W8A8_MIN_TOKENS},32]" in str(
        jax.make_jaxpr(lambda x: linear(x, q, ""))(big)
    )


def _logits(weights: Weights, config: ModelConfig, ids: list[int]) -> np.ndarray:
    cache = make_kv_cache(
        config.num_layers, 16, PAGE, config.num_kv_heads, config.head_dim, jnp.float32
    )
    batch = one_sequence_batch(ids, 0, list(range(14)), 16 * PAGE)
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(weights, cache, batch, config)
    return np.asarray(decoder.compute_logits(weights, hidden, config.final_logit_softcap))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    ("scheme", "max_error"), [(FP8, 0.3), (W8A8, 0.3), (INT8, 0.08)], ids=["fp8", "w8a8", "int8"]
)
def test_each_mode_stays_close_to_the_unquantized_model(
    family: str, scheme: QuantScheme, max_error: float
) -> None:
    golden = np.load(fixture_dir(family) / "golden.npz")
    ref = golden["prefill2_logits"]  # f32[56, V] from transformers
    config = load_model_config(fixture_dir(family))
    weights = load_weights(fixture_dir(family), config, jnp.float32, scheme=scheme)
    assert isinstance(weights.layers[0].wq, QArray)
    assert weights.layers[0].wq.act_quant == scheme.act_quant
    got = _logits(weights, config, golden["prompt2_ids"].tolist())
    assert np.abs(got - ref).max() < max_error * np.abs(ref).max()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= 10
    assert np.all(got.argmax(-1)[clear] == ref.argmax(-1)[clear])


def test_dummy_weights_quantize_the_same_random_weights() -> None:
    config = load_model_config(fixture_dir("llama"))
    dense = dummy_weights(config, jnp.float32, seed=3)
    quantized = dummy_weights(config, jnp.float32, seed=3, scheme=INT8)
    wo = quantized.layers[1].wo
    assert isinstance(wo, QArray) and wo.in_shape == (4, 16) and wo.out_shape == (64,)
    expected = np.asarray(dense.layers[1].wo).reshape(64, 64).T  # [out, in]
    np.testing.assert_allclose(
        np.asarray(dequantize(wo, jnp.float32)), expected, atol=np.abs(expected).max() / 254
    )
    # The embedding, lm_head and norms stay in the model dtype.
    np.testing.assert_array_equal(np.asarray(quantized.embed), np.asarray(dense.embed))
    assert quantized.lm_head is not None and quantized.lm_head.dtype == jnp.float32
    assert not isinstance(quantized.layers[0].attn_norm, QArray)


@pytest.mark.parametrize("scheme", [FP8, INT8], ids=["fp8", "int8"])
def test_counted_bytes_are_the_device_bytes(scheme: QuantScheme) -> None:
    config = load_model_config(fixture_dir("phi3"))
    weights = dummy_weights(config, jnp.bfloat16, scheme=scheme)
    on_device = sum(x.nbytes for x in jax.tree.leaves(weights))
    assert weight_bytes(config, 2, scheme) == on_device


def test_fp8_needs_a_gpu_with_fp8() -> None:
    with pytest.raises(QuantizationError, match=r"'fp8'.*8\.9.*NVIDIA A100.*8\.0"):
        check_device(FP8, "gpu", "NVIDIA A100-SXM4-80GB", 8.0)
    assert check_device(INT8, "gpu", "NVIDIA A100-SXM4-80GB", 8.0).act_quant is False
    assert check_device(FP8, "gpu", "NVIDIA H200", 9.0).act_quant is True  # W8A8
    assert check_device(FP8, "cpu", "cpu", None).act_quant is False  # weight-only
    block = parse_checkpoint({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert check_device(block, "gpu", "NVIDIA H200", 9.0).act_quant is False  # weight-only
    per_tensor = parse_checkpoint({"quant_method": "fp8", "activation_scheme": "static"})
    assert check_device(per_tensor, "gpu", "NVIDIA H200", 9.0).act_quant is True
    with pytest.raises(QuantizationError, match="'fp8'.*NVIDIA A10G has 8.6"):
        check_device(per_tensor, "gpu", "NVIDIA A10G", 8.6)


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supp"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
            "format='pack-quantized'",
        ),
        (
            {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
            "ignored_layers",
        ),
    ],
)
def test_unsupported_checkpoint_formats_name_themselves(qc: dict, match: str) -> None:
    with pytest.raises(QuantizationError, match=match):
        parse_checkpoint(qc)


def _model_dir(tmp_path: Path, qc: dict | None) -> Path:
    config = json.loads((fixture_dir("llama") / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_flag_and_checkpoint_must_agree(tmp_path) -> None:
    awq = _model_dir(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 32})
    assert resolve_scheme(None, awq).method == "awq"  # type: ignore[union-attr]
    assert resolve_scheme("awq", awq).method == "awq"  # type: ignore[union-attr]
    with pytest.raises(QuantizationError, match="quantization='fp8' does not match.*'awq'"):
        resolve_scheme("fp8", awq)
    with pytest.raises(QuantizationError, match="load_format='dummy'"):
        resolve_scheme(None, awq, "dummy")
    plain = fixture_dir("llama")
    assert resolve_scheme(None, plain) is None
    with pytest.raises(QuantizationError, match="quantization='gptq' needs a checkpoint"):
        resolve_scheme("gptq", plain)
    with pytest.raises(ValueError, match="quantization='int4' must be one of"):
        EngineConfig(quantization="int4")


def test_launch_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["-q", "int8"])).quantization == "int8"
    assert engine_config_from_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "bitsandbytes"])


def test_quantized_shardings_follow_the_weight_axes() -> None:
    config = load_model_config(fixture_dir("llama"))
    specs = weight_specs(config, 2, FP8).layers[0]
    P = jax.sharding.PartitionSpec
    assert (specs.wq.q, specs.wq.scale) == (P("tp", None), P("tp"))  # column parallel
    assert (specs.wk.q, specs.wk.scale) == (P("kv", None), P("kv"))
    assert (specs.wo.q, specs.wo.scale) == (P(None, "tp"), P(None))  # row parallel
    assert (specs.w_down.q, specs.w_down.scale) == (P(None, "tp"), P(None))
    gptq = parse_checkpoint({"quant_method": "gptq", "bits": 4, "group_size": 32})
    down = weight_specs(config, 2, gptq).layers[0].w_down  # [H, I / 8], groups [H, I / 32]
    assert (down.q, down.scale, down.zero) == (P(None, "tp"), P(None, None), P(None, None))


def _capacity_json(capsys, *args: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*args, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_capacity_counts_quantized_weights_on_the_h200(capsys) -> None:
    """Llama-3-8B: fp8 Linear weights take about half (embedding and lm_head stay bf16),
    and the memory freed goes to the KV cache."""
    model = str(builtin_config_dir("llama-3-8b"))
    args = (model, "--device-memory", "H200", "--max-model-len", "8192", "--max-num-seqs", "256")
    bf16 = _capacity_json(capsys, *args)
    fp8 = _capacity_json(capsys, *args, "--quantization", "fp8")
    int8 = _capacity_json(capsys, *args, "-q", "int8")
    config = load_model_config(model)
    linear_params = config.num_layers * sum(
        int(np.prod(f.shape_for(config))) for f in layer_fields(config) if f.name[0] == "w"
    )
    saved = bf16["weight_bytes"] - fp8["weight_bytes"]
    assert 0.99 * linear_params < saved < linear_params  # a byte per weight, less the scales
    assert int8["weight_bytes"] == fp8["weight_bytes"] and fp8["quantization"] == "fp8"
    per_token = bf16["kv_bytes_per_token"]
    extra_tokens = fp8["kv_cache_tokens"] - bf16["kv_cache_tokens"]
    assert extra_tokens == pytest.approx(saved / per_token, rel=0.01)
    cap = plan_capacity(
        config,
        max_model_len=8192,
        device_memory_bytes=DEVICE_MEMORY_BYTES["H200"],
        memory_utilization=0.9,
        quant=FP8,
    )
    assert cap.num_blocks == fp8["num_blocks"]


def test_llm_quantizes_on_load_and_capacity_agrees(capsys, caplog) -> None:
    caplog.set_level(logging.INFO, logger="jaxserve")
    memory = 96 * 1024**2
    common = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        quantization="int8",
        dtype="float32",
        device_memory_bytes=memory,
        warmup=False,
        **common,  # type: ignore[arg-type]
    )
    runner = llm.engine.runner
    layer = runner.weights.layers[0]  # one device: gate/up (and q/k/v) joined, still int8
    assert runner.quant is not None and isinstance(layer.fused.w_gate_up, QArray)
    assert layer.w_up is None and layer.fused.w_gate_up.q.dtype == jnp.int8
    assert (
        "Quantization: quantized on load (int8, per-channel scales); weight-only (dequantized "
        "inside the matmul); embedding and lm_head unquantized" in caplog.messages
    )
    out = _capacity_json(
        capsys,
        str(fixture_dir("llama")),
        "--quantization",
        "int8",
        "--dtype",
        "float32",
        "--device-memory",
        str(memory),
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "32",
    )
    assert out["weight_bytes"] == runner.capacity.weight_bytes
    assert out["num_blocks"] == runner.num_blocks
    golden = np.load(fixture_dir("llama") / "golden.npz")
    prompt = {"prompt_token_ids": golden["prompt_ids"].tolist()}
    result = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # int8 keeps the fixture's greedy tokens (their margins are all above 0.1).
    assert result[0].outputs[0].token_ids == golden["greedy_ids"].tolist()[:4]


TP_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    import jaxserve
    from jaxserve import SamplingParams
    sys.path.insert(0, "scripts")
    from make_quantized import make_quantized
    fixture = Path("tests/fixtures/models/qwen3")
    golden = np.load(fixture / "golden.npz")
    prompt = {"prompt_token_ids": golden["prompt_ids"].tolist()}
    awq = make_quantized(fixture, Path(sys.argv[1]), "awq", 32)
    for model, quantization in ((fixture, "int8"), (awq, None)):
        for tp in (1, 2):
            llm = jaxserve.LLM(str(model), tensor_parallel_size=tp, quantization=quantization,
                               max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                               block_size=4, num_gpu_blocks_override=32, dtype="float32",
                               warmup=False)
            layer = llm.engine.runner.weights.layers[0]  # one device: q/k/v joined if they can be
            wq = layer.wq if layer.wq is not None else layer.fused.wqkv
            scale = wq.scale.addressable_shards[0].data
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))
            print(quantization, tp, scale.shape[0], out[0].outputs[0].token_ids)
""")


def test_tensor_parallel_quantized_weights_give_the_same_tokens(tmp_path) -> None:
    """int8 on load and an AWQ checkpoint at TP=2 (2 CPU devices, in a subprocess: the device
    count is fixed when JAX starts): scales split with their rows, tokens as at TP=1."""
    stdout = run_with_devices(TP_SCRIPT, 2, str(tmp_path / "awq"))
    rows = [line.split(" ", 3) for line in stdout.splitlines()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("int8", "1", "256"),  # one device: q/k/v joined (128 + 64 + 64 rows, each its scale)
        ("int8", "2", "64"),  # wq's output rows (and their scales) split over 2 devices
        ("None", "1", "128"),
        ("None", "2", "64"),
    ]
    assert rows[0][3] == rows[1][3] and rows[2][3] == rows[3][3]


def test_launch_refuses_an_unsupported_checkpoint_at_start_up(tmp_path) -> None:
    """bitsandbytes: one line naming the format, exit code 1, never a bf16 fallback."""
    for file in fixture_dir("llama").iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "launch", str(tmp_path), "--port", "0"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert f"Could not load {tmp_path}: quantization_config.quant_method='bitsandbytes'" in (
        proc.stdout + proc.stderr
    )


def test_w8a8_writes_its_dot_in_the_activations_16_bit_dtype(monkeypatch) -> None:
    """The fp8 dot of bf16 activations writes bf16 (half the bytes of float32), summed in f32,
    the scales applied after in f32: within bf16's rounding of the float32-written result."""
    monkeypatch.setattr(quant, "W8A8_MIN_TOKENS", 1)
    rng = np.random.default_rng(6)
    w = rng.normal(size=(24, 32)).astype(np.float32)
    q = quantize(w, "fp8", (32,), (24,), act_quant=True)
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: linear(x, q, ""))(x))
    (dot,) = [line for line in jaxpr.splitlines() if "= dot_general[" in line]
    assert ":bf16[5,24] = dot_general[" in dot
    y = np.asarray(jax.jit(lambda x: linear(x, q, ""))(x).astype(jnp.float32))
    x32 = x.astype(jnp.float32)
    want = np.asarray(jax.jit(lambda x: linear(x, q, ""))(x32))  # f32 written: the reference
    np.testing.assert_allclose(y, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())
    assert quant.w8a8_dot_dtype(x) == jnp.bfloat16 and quant.w8a8_dot_dtype(x32) == jnp.float32
    monkeypatch.setenv(quant.W8A8_DOT_DTYPE_ENV, "float32")  # the former dot, for benchmarks
    assert quant.w8a8_dot_dtype(x) == jnp.float32
    monkeypatch.setenv(quant.W8A8_DOT_DTYPE_ENV, "f16")
    with pytest.raises(ValueError, match="JAXSERVE_W8A8_DOT_DTYPE='f16' must be one of auto"):
        quant.w8a8_dot_dtype(x)


@pytest.mark.parametrize("fmt, act_quant", [("fp8", True), ("fp8", False), ("int8", False)])
def test_joined_per_channel_weights_give_each_projection_s_product(monkeypatch, fmt, act_quant):
    """q, k and v (and gate, up) quantized per channel join into one QArray (``quant.join``),
    each output channel with its own values and scale: the joined product is each part's,
    side by side (W8A8 quantizes the shared input once either way)."""
    monkeypatch.setattr(quant, "W8A8_MIN_TOKENS", 1)
    rng = np.random.default_rng(7)
    parts = [
        quantize(
            rng.normal(size=(rows, 32)).astype(np.float32), fmt, (32,), (rows // 8, 8), act_quant
        )
        for rows in (32, 16, 16)
    ]
    assert quant.joinable(parts)
    joined = quant.join(parts)
    assert (joined.in_shape, joined.out_shape, joined.act_quant) == ((32,), (8, 8), act_quant)
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    want = np.concatenate([np.asarray(linear(x, p, "")) for p in parts], axis=1)
    # (float32 sums of another GEMM width: within an ulp or two of each part's)
    np.testing.assert_allclose(np.asarray(linear(x, joined, "")), want, rtol=1e-5, atol=1e-5)


def test_grouped_packed_or_mixed_weights_are_not_joined() -> None:
    rng = np.random.default_rng(8)
    w = rng.normal(size=(16, 32)).astype(np.float32)
    fp8, int8 = quantize(w, "fp8", (32,), (16,)), quantize(w, "int8", (32,), (16,))
    grouped, _ = _grouped(16, 32, 8, act_order=False)
    assert not quant.joinable([fp8, int8])  # two formats
    assert not quant.joinable([fp8, quantize(w, "fp8", (32,), (16,), act_quant=True)])
    assert not quant.joinable([grouped, grouped])  # 4-bit, a scale per group
    assert not quant.joinable([fp8, jnp.asarray(w)])  # a plain array
