"""Quantized routed experts (``--quantization fp8 | int8`` on a mixture of experts): the stacked
expert QArray, the grouped matmul over fp8 / int8 weights (the Pallas Triton kernel interpreted
on the CPU, lowered for the H200, natively on a GPU; ragged_dot elsewhere), the MoE layer's error
against bf16, loading and dummy weights of every MoE family, tensor and expert parallelism on
virtual devices, and DeepSeek-V3's capacity on 8 x H200.

Measured on the CPU (docs/quantization.md): one fp8-expert MoE layer (random inputs, 8 experts,
top 2) within 0.06 x its largest output of bf16, int8 within 0.012 x; on the MoE fixtures, fp8
experts alone (Linear weights unquantized) keep Hugging Face's 20 greedy tokens on all five.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import MoeConfig, builtin_config_dir
from jaxserve.models import decoder, moe
from jaxserve.models.batch import make_kv_cache_for
from jaxserve.models.families.registry import layer_fields, load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.models.quant import QArray, dequantize, quantize, quantize_experts
from jaxserve.models.quant_scheme import QuantScheme, resolve_scheme, weight_bytes
from jaxserve.runner.parallel.sharding import weight_specs
from pallas_kernels.grouped_matmul import dispatch as gm
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul import triton as gmt
from tests.conftest import fixture_dir, run_with_devices
from tests.test_model_parity import PAGE, one_sequence_batch
from tests.test_quantized_checkpoints import make_quantized_module

FP8 = QuantScheme(method="fp8", weight_format="fp8")
INT8 = QuantScheme(method="int8", weight_format="int8")
DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss")
EXPERT_FIELDS = ("experts_gate", "experts_up", "experts_down")


def _random_experts(rng, num_experts: int, size_k: int, size_n: int) -> jax.Array:
    return jnp.asarray(rng.normal(size=(num_experts, size_k, size_n)) / np.sqrt(size_k))


def _numpy_grouped(lhs, q, scale, group_sizes) -> np.ndarray:
    """Each group's rows times its dequantized matrix, in float64; zeros past the groups."""
    lhs = np.asarray(lhs.astype(jnp.float32), np.float64)
    weights = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(scale)[:, None, :]
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    start = 0
    for group, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ weights[group]
        start += size
    return out


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_experts_quantize_per_expert_and_output_channel(fmt: str) -> None:
    """Each expert [in, out] is quantized as ``quantize`` quantizes its [out, in] Linear weight;
    the host (loading) and device (dummy weights) paths agree, and an all-zero channel stays 0."""
    w = np.random.default_rng().normal(size=(3, 40, 24)).astype(np.float32)
    w[1, :, 5] = 0.0
    experts = quantize_experts(w, fmt)
    assert experts.is_experts and experts.q.shape == (3, 40, 24) and experts.scale.shape == (3, 24)
    assert (experts.in_shape, experts.out_shape) == ((40,), (24,))
    for e in range(3):
        one = quantize(w[e].T, fmt, (40,), (24,))
        np.testing.assert_array_equal(experts.q[e].T.astype(np.float32), one.q.astype(np.float32))
        np.testing.assert_allclose(experts.scale[e], one.scale, rtol=1e-6)
    device = jax.jit(quantize_experts, static_argnums=1)(jnp.asarray(w), fmt)
    np.testing.assert_array_equal(
        np.asarray(device.q.astype(jnp.float32)), experts.q.astype(np.float32)
    )
    back = np.asarray(dequantize(device, jnp.float32))  # [E, in, out]
    assert np.all(back[1, :, 5] == 0)
    step = 1 / 16 if fmt == "fp8" else 1 / 254  # half an e4m3 ulp / half an int8 step
    amax = np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(back - w) <= step * (np.abs(w) if fmt == "fp8" else amax) + amax / 3e3)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group_sizes: tuple[int, ...]
    num_rows: int  # >= sum(group_sizes); the rest must come out zero
    size_k: int
    size_n: int
    dtype: str = "bfloat16"
    fmt: str = "fp8"
    config: gmt.GroupedMatmulConfig = gmt.GroupedMatmulConfig(block_m=16, block_n=32, block_k=32)


CPU_CASES = [
    # Uneven groups inside 16-row blocks, empty groups, K and N the tiles do not divide, and
    # rows past the groups' sum.
    Case("fp8_uneven_ragged_tiles", (5, 0, 21, 3, 0, 9), 45, 40, 48),
    # int8 values, f32 rows (the CPU's dtype).
    Case("int8_f32", (3, 4, 0, 2), 12, 32, 32, "float32", "int8"),
]


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_kernel_and_ragged_dot_match_the_reference(case: Case) -> None:
    """The kernel (interpreted) and the ragged_dot path, on fresh random inputs, against the
    jnp reference and numpy (float64, dequantized weights); rows past the sum exactly zero."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    lhs = jnp.asarray(rng.normal(size=(case.num_rows, case.size_k)), dtype)
    experts = quantize_experts(
        _random_experts(rng, len(case.group_sizes), case.size_k, case.size_n), case.fmt
    )
    sizes = jnp.asarray(case.group_sizes, jnp.int32)
    want = _numpy_grouped(lhs, experts.q, experts.scale, sizes)
    atol = 1e-4 if case.dtype == "float32" else 3e-2
    out = gmt.grouped_matmul(
        lhs, experts.q, sizes, experts.scale, config=case.config, interpret=True
    )
    xla = gm.grouped_matmul(lhs, experts.q, sizes, experts.scale)
    ref = reference.grouped_matmul(lhs, experts.q, sizes, experts.scale)
    for got in (out, xla, ref):
        assert got.shape == (case.num_rows, case.size_n) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, err_msg=f"{seed=}")
        assert (np.asarray(got[sum(case.group_sizes) :]) == 0).all()


def test_the_kernel_takes_quantized_experts_only_with_their_scales() -> None:
    lhs = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    fp8 = jax.ShapeDtypeStruct((4, 16, 32), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((4, 32), jnp.float32)
    assert gmt.unsupported_reason(lhs, fp8, scale) is None
    assert "dtypes bfloat16/float8_e4m3fn" in str(gmt.unsupported_reason(lhs, fp8))
    wrong = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    assert "must be float32[4, 32]" in str(gmt.unsupported_reason(lhs, fp8, wrong))
    bf16 = jax.ShapeDtypeStruct((4, 16, 32), jnp.bfloat16)
    assert "fp8 e4m3 or int8 weights" in str(gmt.unsupported_reason(lhs, bf16, scale))


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize(
    ("num_rows", "dtype"),
    [(16 * 8, jnp.float8_e4m3fn), (2048 * 8, jnp.float8_e4m3fn), (16 * 8, jnp.int8)],
    ids=["fp8_decode", "fp8_prefill", "int8_decode"],
)
def test_quantized_kernel_lowers_to_triton_for_the_h200(
    num_rows: int, dtype, verify_triton_modules
) -> None:
    """DeepSeek-V3's gate/up shape per device at -tp 8 (K 7168 -> N 256, 256 experts) with fp8
    (or int8) weights: the Triton module verifies, the weights entering it in one byte."""
    lhs = jax.ShapeDtypeStruct((num_rows, 7168), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((256, 7168, 256), dtype)
    scale = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    sizes = jax.ShapeDtypeStruct((256,), jnp.int32)
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(gmt.grouped_matmul).trace(lhs, rhs, sizes, scale)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "ragged_dot" not in text
    assert ("f8E4M3FN" if dtype == jnp.float8_e4m3fn else "xi8") in text  # one byte a weight


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


GPU_CASES = [
    # Qwen3-30B-A3B's gate/up (K 2048 -> N 768) and down (768 -> 2048), 128 experts.
    Case("qwen3_decode_b1_gate", (1,) * 8 + (0,) * 120, 128, 2048, 768),
    Case("qwen3_decode_b64_down", tuple(range(8)) * 16, 512, 768, 2048),
    Case("qwen3_prefill_gate", (128,) * 128, 16384, 2048, 768),
    # DeepSeek-V3 at -tp 8: gate/up (7168 -> 256) and down (256 -> 7168), 256 experts.
    Case("dsv3_decode_b8_gate", (1,) * 64 + (0,) * 192, 64, 7168, 256),
    Case("dsv3_prefill_down", (64,) * 256, 16384, 256, 7168),
    Case("int8_skewed_down", (8000, 0, 0, 4000) + (0,) * 124, 16384, 768, 2048, fmt="int8"),
]


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_native_fp8_kernel_matches_the_reference(case: Case) -> None:
    """Natively, with the default tiles for each shape, against the jnp reference (the same
    fp8 values and scales) and within bf16 rounding of it."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(case.num_rows, case.size_k)), jnp.bfloat16)
    experts = jax.jit(quantize_experts, static_argnums=1)(
        _random_experts(rng, len(case.group_sizes), case.size_k, case.size_n), case.fmt
    )
    sizes = jnp.asarray(case.group_sizes, jnp.int32)
    out = jax.jit(gmt.grouped_matmul)(lhs, experts.q, sizes, experts.scale)
    want = jax.jit(reference.grouped_matmul)(lhs, experts.q, sizes, experts.scale)
    got, ref = np.asarray(out, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, ref, atol=3e-2, rtol=3e-2, err_msg=f"{seed=}")
    assert (np.asarray(out[sum(case.group_sizes) :]) == 0).all()


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
def test_fp8_experts_take_the_kernel_on_a_gpu(monkeypatch) -> None:
    """moe.expert_mlp over fp8 experts on a GPU runs the Triton kernel by default, and gives
    ragged_dot's rows (JAXSERVE_GROUPED_MATMUL=xla)."""
    monkeypatch.delenv(gm.GROUPED_MATMUL_ENV, raising=False)
    rng = np.random.default_rng()
    experts = [
        quantize_experts(_random_experts(rng, 8, k, n), "fp8")
        for k, n in ((256, 128), (256, 128), (128, 256))
    ]
    rows = jnp.asarray(rng.normal(size=(160, 256)), jnp.bfloat16)
    args = (rows, jnp.asarray([30, 0, 2, 100] + [0] * 4, jnp.int32), *experts)
    jaxpr = str(jax.make_jaxpr(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args))
    assert jaxpr.count("grouped_matmul_triton") == 3 and "ragged_dot" not in jaxpr
    got = jax.jit(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args)
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "xla")
    want = jax.jit(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.05, rtol=0.05
    )


def _moe_inputs(rng, num_experts=8, hidden=64, inner=32, tokens=40):
    w = [
        jnp.asarray(rng.normal(size=shape) * 0.15, jnp.float32)
        for shape in ((num_experts, hidden, inner),) * 2 + ((num_experts, inner, hidden),)
    ]
    router = jnp.asarray(rng.normal(size=(hidden, num_experts)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    return x, router, w, MoeConfig(num_experts, 2, inner, norm_topk_prob=True)


@pytest.mark.parametrize(("fmt", "max_error"), [("fp8", 0.08), ("int8", 0.02)])
def test_a_quantized_moe_layer_stays_close_to_bf16(fmt: str, max_error: float) -> None:
    """One MoE layer (8 experts, top 2) on random inputs: the quantized experts' output within
    ``max_error`` x the largest output of the unquantized layer (measured: fp8 0.05, int8
    0.01), and exactly the layer over the dequantized experts (the scale is all that differs)."""
    x, router, w, config = _moe_inputs(np.random.default_rng())

    @jax.jit  # one program: the four layers compiled together
    def layers(x, router, w):
        experts = [quantize_experts(a, fmt) for a in w]
        deq = [dequantize(a, jnp.float32) for a in experts]
        return (
            moe.moe_block(x, moe.MoeWeights(router, *w), config, jax.nn.silu),
            moe.moe_block(x, moe.MoeWeights(router, *experts), config, jax.nn.silu),
            moe.moe_block(x, moe.MoeWeights(router, *deq), config, jax.nn.silu),
            moe.reference_moe(x, moe.MoeWeights(router, *experts), config, jax.nn.silu),
        )

    want, got, over_dequantized, oracle = (np.asarray(y) for y in layers(x, router, w))
    np.testing.assert_allclose(got, over_dequantized, atol=1e-5)
    np.testing.assert_allclose(got, oracle, atol=1e-5)
    assert np.abs(got - want).max() < max_error * np.abs(want).max()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_moe_family_loads_its_experts_quantized(family: str) -> None:
    """fp8 on load: each family's routed experts are fp8 QArrays [E, in, out] with [E, out]
    scales, equal to quantizing the bf16 experts; the router and shared expert stay as they
    are; the model keeps the fixture's clear greedy tokens."""
    config = load_model_config(fixture_dir(family))
    plain = load_weights(fixture_dir(family), config, jnp.float32)
    weights = load_weights(fixture_dir(family), config, jnp.float32, scheme=FP8)
    layer = next(i for i, lw in enumerate(weights.layers) if lw.router is not None)
    lw, ref = weights.layers[layer], plain.layers[layer]
    for name in EXPERT_FIELDS:
        got, bf16 = getattr(lw, name), getattr(ref, name)
        assert isinstance(got, QArray) and got.q.dtype == jnp.float8_e4m3fn
        assert got.q.shape == bf16.shape and got.scale.shape == (bf16.shape[0], bf16.shape[2])
        want = quantize_experts(np.asarray(bf16), "fp8")
        np.testing.assert_array_equal(
            np.asarray(got.q.astype(jnp.float32)), want.q.astype(np.float32)
        )
    assert not isinstance(lw.router, QArray) and not isinstance(lw.shared_gate, QArray)
    on_device = sum(x.nbytes for x in jax.tree.leaves(weights))
    assert weight_bytes(config, 4, FP8) == on_device


def test_dummy_weights_quantize_the_experts_and_count_their_bytes() -> None:
    """Dummy weights (benchmarks) quantize the same random experts, and ``weight_bytes``
    counts every device byte (fp8 values, f32 scales per expert and output channel)."""
    config = load_model_config(fixture_dir("mixtral"))
    dense = dummy_weights(config, jnp.bfloat16, seed=5)
    quantized = dummy_weights(config, jnp.bfloat16, seed=5, scheme=FP8)
    up = quantized.layers[1].experts_up
    assert isinstance(up, QArray) and up.q.dtype == jnp.float8_e4m3fn
    want = quantize_experts(dense.layers[1].experts_up, "fp8")
    np.testing.assert_array_equal(np.asarray(up.q.astype(jnp.float32)), want.q.astype(jnp.float32))
    on_device = sum(x.nbytes for x in jax.tree.leaves(quantized))
    assert weight_bytes(config, 2, FP8) == on_device
    assert weight_bytes(config, 2, INT8) == on_device


def test_quantized_experts_shard_as_the_bf16_experts() -> None:
    """Tensor parallel: values on M (gate/up's out, down's in), scales on gate/up's M and
    whole for down's H; expert parallel: both on E."""
    P = jax.sharding.PartitionSpec
    config = load_model_config(fixture_dir("qwen3_moe"))
    tp = weight_specs(config, 2, FP8).layers[0]
    ep = weight_specs(config, 2, FP8, expert_parallel=True).layers[0]
    assert (tp.experts_gate.q, tp.experts_gate.scale) == (P(None, None, "tp"), P(None, "tp"))
    assert (tp.experts_down.q, tp.experts_down.scale) == (P(None, "tp", None), P(None, None))
    assert (ep.experts_up.q, ep.experts_up.scale) == (P("tp", None, None), P("tp", None))
    assert (ep.experts_down.q, ep.experts_down.scale) == (P("tp", None, None), P("tp", None))
    assert tp.experts_gate.act_quant is False  # weight-only on every device


SHARDED_SCRIPT = textwrap.dedent("""
    import json
    import os
    import jax
    import numpy as np
    from jaxserve.models import moe
    from jaxserve.models.quant import quantize_experts
    from jaxserve.runner.parallel.expert_parallel import sharded_experts
    from jaxserve.runner.parallel.sharding import make_mesh
    rng = np.random.default_rng()
    x = rng.normal(size=(13, 16)).astype(np.float32)
    ids = rng.integers(0, 8, size=(13, 2)).astype(np.int32)
    ids[11:] = 8  # padding: no expert
    w = rng.random((13, 2)).astype(np.float32)
    gate, up = (quantize_experts(a, "fp8") for a in rng.normal(size=(2, 8, 16, 8)))
    down = quantize_experts(rng.normal(size=(8, 8, 16)), "fp8")
    want = moe.run_experts(x, ids, w, gate, up, down, act=jax.nn.silu)
    for n, ep, path in [(4, True, "triton"), (2, False, "xla")]:
        os.environ["JAXSERVE_GROUPED_MATMUL"] = path
        experts = sharded_experts(make_mesh(n, devices=jax.devices()[:n]), "tp", ep)
        fn = jax.jit(lambda *a: experts(*a, act=jax.nn.silu))
        jaxpr = str(jax.make_jaxpr(fn)(x, ids, w, gate, up, down))
        got = fn(x, ids, w, gate, up, down)
        print(json.dumps({"ep": ep, "kernels": jaxpr.count("grouped_matmul_triton"),
                          "max_error": float(np.abs(np.asarray(got - want)).max())}))
""")


def test_expert_and_tensor_parallel_fp8_experts_give_one_devices_output() -> None:
    """Under shard_map on virtual devices, split whole (4, all-to-all, on the kernel) or sliced
    (2, all-reduce, ragged_dot), fp8 experts give the one-device output."""
    runs = [json.loads(line) for line in run_with_devices(SHARDED_SCRIPT, 4).splitlines()]
    assert [(r["ep"], r["kernels"]) for r in runs] == [(True, 3), (False, 0)]
    for run in runs:
        assert run["max_error"] < 1e-4, run


def _capacity_json(capsys, *args: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*args, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_deepseek_v3_fits_one_h200_host_with_fp8_experts(capsys) -> None:
    """671B parameters at -tp 8 on H200: bf16 weights do not fit; fp8 experts plan to start,
    and the weight bytes per device are, counted by hand, 61 routed layers' experts at a byte
    a weight plus their scales, and everything else in bf16 (Linear weights in fp8)."""
    model = str(builtin_config_dir("deepseek-v3"))
    args = (model, "-tp", "8", "--device-memory", "H200", "--max-model-len", "32K")
    plan = _capacity_json(capsys, *args, "-q", "fp8")
    assert plan["kv_cache_tokens"] > 32768 and plan["max_concurrency"] > 1
    config = load_model_config(model)
    assert config.moe is not None
    hidden, inner, experts = config.hidden_size, config.moe.intermediate_size, 256
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    assert (moe_layers, inner, hidden) == (58, 2048, 7168)
    expert_bytes = moe_layers * (3 * experts * hidden * inner + experts * (2 * inner + hidden) * 4)
    expert_params = moe_layers * 3 * experts * hidden * inner
    linear = sum(
        int(np.prod(f.shape_for(config)))
        for i in range(config.num_layers)
        for f in layer_fields(config, i)
        if f.name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    )
    linear_scales = sum(
        int(np.prod(f.hf_shape_for(config)[:1]))
        for i in range(config.num_layers)
        for f in layer_fields(config, i)
        if f.name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    )
    rest = weight_bytes(config, 2, None) - 2 * (expert_params + linear)
    by_hand = expert_bytes + linear + 4 * linear_scales + rest
    assert weight_bytes(config, 2, FP8) == by_hand
    assert plan["weight_bytes"] == by_hand // 8
    assert 79 < by_hand / 8 / 2**30 < 80  # 79.24 GiB per device


BLOCK = 16  # the fixture's block scales: 16 x 16 (the published checkpoint's are 128 x 128)
FP8_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}


def _fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight [out, in] as DeepSeek publishes it: fp8 values, f32 ``weight_scale_inv``
    [ceil(out / 16), ceil(in / 16)] (edge blocks partial), and the weight they make."""
    rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    padded = np.zeros((rows * BLOCK, cols * BLOCK), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = np.abs(padded.reshape(rows, BLOCK, cols, BLOCK)).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-12) / 448).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[: w.shape[0], : w.shape[1]]
    q = np.clip(w / expanded, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale, q.astype(np.float32) * expanded


def _write_fp8_deepseek(model_dir) -> dict[str, np.ndarray]:
    """The DeepSeek-V3 fixture as its fp8 checkpoint: every layer's Linear weight (latent
    attention, dense MLP, experts, shared experts) block-scaled, the router, norms, embedding
    and lm_head as they are; returns each fp8 weight's dequantized values by name."""
    src = fixture_dir("deepseek_v3")
    shutil.copytree(src, model_dir)
    raw = json.loads((src / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps(raw | {"quantization_config": FP8_BLOCK_CONFIG})
    )
    tensors, dequantized = {}, {}
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            is_linear = name.startswith("model.layers.") and name.endswith("proj.weight")
            if not is_linear:
                tensors[name] = w
                continue
            q, scale, dequantized[name] = _fp8_blocks(w)
            tensors[name] = q
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    make_quantized_module.write_safetensors(model_dir / "model.safetensors", tensors)
    return dequantized


def test_deepseek_v3_fp8_block_checkpoint_loads_and_keeps_the_greedy_tokens(tmp_path) -> None:
    """DeepSeek-V3's published layout (fp8 with 128 x 128 ``weight_scale_inv`` blocks, here
    16 x 16 on the fixture): the experts are dequantized and quantized again per (expert,
    output channel), the latent attention and shared expert dequantized to the model's dtype,
    o_proj and the dense MLP read with their block scales; the fixture's clear greedy tokens
    stay (12 of 12), the logits' median error 0.085 (fp32 golden logits up to 4.3)."""
    model_dir = tmp_path / "dsv3-fp8"
    dequantized = _write_fp8_deepseek(model_dir)
    config = load_model_config(model_dir)
    scheme = resolve_scheme(None, model_dir)
    assert scheme is not None and scheme.group_size == BLOCK and scheme.from_checkpoint
    weights = load_weights(model_dir, config, jnp.float32, scheme=scheme)
    lw = weights.layers[1]
    base = "model.layers.1."
    down = lw.experts_down
    assert isinstance(down, QArray) and down.q.dtype == jnp.float8_e4m3fn
    stacked = np.stack([dequantized[f"{base}mlp.experts.{e}.down_proj.weight"].T for e in range(8)])
    want = quantize_experts(stacked, "fp8")  # rounded twice: blocks, then per channel
    np.testing.assert_allclose(np.asarray(down.scale), want.scale, rtol=1e-6)
    back = np.asarray(dequantize(down, jnp.float32))  # within an e4m3 step of the blocks'
    assert np.all(np.abs(back - stacked) <= np.abs(stacked) / 8 + want.scale[:, None, :] / 64)
    assert lw.wq_b is not None and lw.shared_up is not None
    np.testing.assert_allclose(  # [Q, N, A] from q_b_proj [N A, Q]
        np.asarray(lw.wq_b).reshape(24, -1), dequantized[f"{base}self_attn.q_b_proj.weight"].T
    )
    np.testing.assert_allclose(
        np.asarray(lw.shared_up), dequantized[f"{base}mlp.shared_experts.up_proj.weight"].T
    )
    assert isinstance(lw.wo, QArray) and lw.wo.scale.shape == (64, 48 // BLOCK)  # blocks kept
    assert not isinstance(lw.router, QArray)
    golden = np.load(fixture_dir("deepseek_v3") / "golden.npz")
    ids = golden["prompt2_ids"].tolist()
    cache = make_kv_cache_for(config, 32, PAGE, jnp.float32)
    batch = one_sequence_batch(ids, 0, list(range(32)), 32 * PAGE)
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(weights, cache, batch, config)
    got = np.asarray(decoder.compute_logits(weights, hidden, config.final_logit_softcap))
    ref = golden["prefill2_logits"]
    # NOTE: no bound on the largest error: the fixture's block quantization alone moves a few
    # tokens' routing (loaded in fp32 from its dequantized values, the logits are as far off,
    # 1.1 x the largest; from this checkpoint 0.05 x the largest of those).
    assert np.median(np.abs(got - ref)) < 0.15
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert np.all(got.argmax(-1)[clear] == ref.argmax(-1)[clear])
