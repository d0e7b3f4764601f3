"""The grouped matmul of the experts: the Pallas Triton kernel against the per-group jnp
reference, its tile plan, the choice of path, and the expert MLP through it.

On CPU (CI) the kernel runs in Pallas interpret mode on tiny shapes and is lowered to Triton IR
for an (abstract) A100; the ``gpu`` tests run it natively on the Qwen3-30B-A3B expert shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import moe
from pallas_kernels.grouped_matmul import dispatch as gm
from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul import triton as gmt
from tests.conftest import run_with_devices

# The Pallas Triton backend warns at lowering that it is deprecated (jax 0.11).
DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group_sizes: tuple[int, ...]
    num_rows: int  # >= sum(group_sizes); the rest must come out zero
    size_k: int
    size_n: int
    dtype: str = "bfloat16"
    config: gmt.GroupedMatmulConfig = gmt.GroupedMatmulConfig(block_m=16, block_n=32, block_k=32)


CPU_CASES = [
    # Uneven groups that start and end inside 16-row blocks, empty groups among them.
    Case("uneven_empty", (5, 0, 21, 3, 0, 9), 38, 64, 64),
    # Every row in one group (of several), K and N that the tiles do not divide.
    Case("one_group_ragged_tiles", (0, 0, 50, 0), 50, 40, 48),
    # Rows past the groups' sum: a bucket's padding, zeros out.
    Case("rows_past_the_sum", (3, 4, 0, 2), 45, 32, 32),
    # Fewer rows than a tile (decode at batch 1), in fp16.
    Case("fewer_rows_than_a_tile", (1, 0, 1, 1), 6, 32, 64, "float16"),
    # No row in any group.
    Case("all_groups_empty", (0, 0, 0), 7, 32, 32),
    # A prefill-sized tile (64 rows) over many groups, f32 (the CPU's dtype).
    Case(
        "f32_large_tile",
        (40, 90, 0, 7),
        150,
        32,
        32,
        "float32",
        gmt.GroupedMatmulConfig(block_m=64, block_n=32, block_k=16),
    ),
]


def make_inputs(rng: np.random.Generator, case: Case) -> tuple[jax.Array, jax.Array, jax.Array]:
    dtype = jnp.dtype(case.dtype)
    lhs = rng.normal(size=(case.num_rows, case.size_k)).astype(np.float32)
    rhs = rng.normal(size=(len(case.group_sizes), case.size_k, case.size_n)).astype(np.float32)
    return (
        jnp.asarray(lhs, dtype),
        jnp.asarray(rhs / np.sqrt(case.size_k), dtype),
        jnp.asarray(case.group_sizes, jnp.int32),
    )


def numpy_grouped_matmul(lhs, rhs, group_sizes) -> np.ndarray:
    """Each group's rows times its matrix, in float64; zeros past the groups."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for group, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[group]
        start += size
    return out


def tolerance(dtype: str) -> float:
    return {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}[dtype]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    lhs, rhs, sizes = make_inputs(np.random.default_rng(seed), case)
    out = gmt.grouped_matmul(lhs, rhs, sizes, config=case.config, interpret=True)
    assert out.shape == (case.num_rows, case.size_n) and out.dtype == lhs.dtype
    ref = reference.grouped_matmul(lhs, rhs, sizes)
    want = numpy_grouped_matmul(lhs, rhs, sizes)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tolerance(case.dtype))
    np.testing.assert_allclose(
        np.asarray(out, np.float64), want, atol=tolerance(case.dtype), err_msg=f"{seed=}"
    )
    past = sum(case.group_sizes)
    assert (np.asarray(out[past:]) == 0).all()  # exactly zero, not merely small


def test_the_plan_visits_each_group_block_once_and_fits_the_grid():
    """Every (group, row block) a group's rows touch is one tile with that group's rows; the
    zero rows past the sum are covered; the rest of the fixed grid does nothing."""
    rng = np.random.default_rng()
    plan_tiles = jax.jit(gmt.plan_tiles, static_argnames=("num_rows", "block_m"))
    for _ in range(8):
        num_groups, block_m = int(rng.integers(1, 9)), int(rng.choice([16, 32]))
        sizes = rng.integers(0, 40, num_groups) * (rng.random(num_groups) < 0.7)
        num_rows = int(sizes.sum() + rng.integers(0, 30)) or 1
        plan = np.asarray(plan_tiles(jnp.asarray(sizes, jnp.int32), num_rows=num_rows,
                                     block_m=block_m))  # fmt: skip
        assert plan.shape == (4, gmt.num_tiles_for(num_rows, num_groups, block_m))
        segment, first_row, lo, hi = plan
        covered = np.zeros(num_rows, int)
        ends = np.append(np.cumsum(sizes), num_rows)
        starts = np.append(0, ends[:-1])
        for s, f, a, b in zip(segment, first_row, lo, hi, strict=True):
            if b <= a:
                continue
            assert f % block_m == 0 and f <= a < b <= f + block_m
            assert starts[s] <= a and b <= ends[s]
            covered[a:b] += 1
        assert (covered == 1).all(), (sizes, num_rows, block_m, plan)


def test_tiles_follow_the_rows_per_group():
    batch_1 = gmt.default_config(16 * 8, 128)  # decode: the 16-token bucket x top 8
    assert (batch_1.block_m, batch_1.block_n, batch_1.block_k) == (16, 128, 64)
    batch_64 = gmt.default_config(64 * 8, 128)
    assert (batch_64.block_m, batch_64.block_n, batch_64.block_k) == (16, 64, 128)
    assert gmt.default_config(256 * 8, 128).block_m == 64  # decode at batch 256
    assert gmt.default_config(2048 * 8, 128).block_m == 64  # a 2,048-token prefill
    assert gmt.default_config(8192 * 8, 128).block_m == 128  # 8,192 tokens
    assert gmt.default_config(8192 * 8, 128).num_stages == 3
    assert gmt.default_config(8192 * 8, 128, large_shared_memory=False).num_stages == 2  # L4
    with pytest.raises(ValueError, match="block_m=48 must be a power of two >= 16"):
        gmt.GroupedMatmulConfig(block_m=48)
    with pytest.raises(ValueError, match=r"self.num_warps=3 must be 1, 2, 4, 8 or 16"):
        gmt.GroupedMatmulConfig(num_warps=3)
    lhs, rhs = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((2, 8, 16), jnp.float16)
    with pytest.raises(ValueError, match="dtypes bfloat16/float16"):
        gmt.grouped_matmul(lhs, rhs, jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes.shape=\(3,\) must be \(2,\)"):
        gmt.grouped_matmul(lhs, rhs.astype(lhs.dtype), jnp.zeros(3, jnp.int32), interpret=True)


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("num_rows", [16 * 8, 2048 * 8], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind,cores", [("NVIDIA A100", 108), ("NVIDIA H200", 132)])
def test_lowers_to_triton_for_a100_and_h200(
    num_rows: int, kind: str, cores: int, verify_triton_modules
) -> None:
    """The Pallas -> Triton IR lowering of the Qwen3-30B-A3B expert shapes runs on the CPU,
    and the Triton module verifies, as XLA verifies it when it parses it on the GPU (a loop
    whose bounds differed in type passed the lowering and failed there); only ptxas is left."""
    lhs = jax.ShapeDtypeStruct((num_rows, 2048), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(gmt.grouped_matmul).trace(lhs, rhs, sizes)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "ragged_dot" not in text


def test_the_choice_of_path_and_its_override(monkeypatch):
    lhs = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    rhs = jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)
    monkeypatch.delenv(gm.GROUPED_MATMUL_ENV, raising=False)
    assert gm.choose_grouped_matmul(lhs, rhs) == ("xla", None)  # the CPU's first choice
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "triton")
    assert gm.choose_grouped_matmul(lhs, rhs) == (
        "triton",
        "JAXSERVE_GROUPED_MATMUL=triton: interpreted on the cpu",
    )
    int8 = jax.ShapeDtypeStruct((4, 16, 32), jnp.int8)
    path, why = gm.choose_grouped_matmul(lhs, int8)
    assert path == "xla" and "dtypes float32/int8" in str(why)
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "xla")
    assert gm.choose_grouped_matmul(lhs, rhs) == ("xla", "JAXSERVE_GROUPED_MATMUL=xla")
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "cublas")
    with pytest.raises(ValueError, match="JAXSERVE_GROUPED_MATMUL='cublas' must be one of"):
        gm.choose_grouped_matmul(lhs, rhs)


def test_expert_mlp_through_the_kernel_equals_ragged_dot(monkeypatch):
    """The three grouped matmuls of the experts' MLP (with GPT-OSS's biases and activation)
    forced onto the kernel give ragged_dot's rows; the jaxpr shows which ran."""
    rng = np.random.default_rng()
    num_experts, hidden, inner = 6, 32, 16
    sizes = np.array([4, 0, 9, 1, 0, 3], np.int32)
    rows = jnp.asarray(rng.normal(size=(20, hidden)), jnp.float32)  # 3 rows past the sum
    w_gate, w_up = jnp.asarray(rng.normal(size=(2, num_experts, hidden, inner)), jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(num_experts, inner, hidden)), jnp.float32)
    gate_bias, up_bias = jnp.asarray(rng.normal(size=(2, num_experts, inner)), jnp.float32)
    glu = functools.partial(moe.clamped_swiglu, limit=7.0, alpha=1.702)

    def run(*args):  # (a new function each time: make_jaxpr caches a function's trace)
        return moe.expert_mlp(*args, jax.nn.silu, gate_bias, up_bias, glu)

    args = (rows, jnp.asarray(sizes), w_gate, w_up, w_down)
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "xla")
    assert "grouped_matmul_triton" not in str(jax.make_jaxpr(lambda *a: run(*a))(*args))
    want = run(*args)
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "triton")
    jaxpr = str(jax.make_jaxpr(lambda *a: run(*a))(*args))
    assert jaxpr.count("grouped_matmul_triton") == 3 and "ragged_dot" not in jaxpr
    got = run(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert (np.asarray(got[17:]) == 0).all()


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


GPU_CASES = CPU_CASES + [
    # Qwen3-30B-A3B's gate/up (K 2048 -> N 768) and down (768 -> 2048), 128 experts.
    Case("qwen3_decode_b1_gate", (1,) * 8 + (0,) * 120, 128, 2048, 768),
    Case("qwen3_decode_b64_down", tuple(range(8)) * 16, 512, 768, 2048),
    Case("qwen3_prefill_gate", (128,) * 128, 16384, 2048, 768, "float16"),
    Case("skewed_prefill_down", (8000, 0, 0, 4000) + (0,) * 124, 16384, 768, 2048),
]


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_native_matches_reference(case: Case):
    """Natively, with the default tiles for each shape."""
    seed = int(np.random.default_rng().integers(2**31))
    lhs, rhs, sizes = make_inputs(np.random.default_rng(seed), case)
    out = jax.jit(gmt.grouped_matmul)(lhs, rhs, sizes)
    want = jax.jit(reference.grouped_matmul)(lhs, rhs, sizes)
    np.testing.assert_allclose(
        np.asarray(out, np.float32),
        np.asarray(want, np.float32),
        atol=tolerance(case.dtype),
        rtol=tolerance(case.dtype),
        err_msg=f"{seed=}",
    )


def test_a_moe_model_on_the_kernel_gives_the_tokens_of_ragged_dot(monkeypatch):
    """The tiny Qwen3-MoE fixture through ``LLM`` with its experts forced onto the kernel
    (interpreted): Hugging Face's greedy tokens, and ragged_dot's logprobs."""
    import jaxserve
    from tests.conftest import fixture_dir

    golden = np.load(fixture_dir("qwen3_moe") / "golden.npz")
    prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()}
    params = jaxserve.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    runs = {}
    for path in ("xla", "triton"):
        monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, path)
        llm = jaxserve.LLM(
            str(fixture_dir("qwen3_moe")), max_model_len=128, max_num_seqs=2,
            max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=64,
            dtype="float32", warmup=False,
        )  # fmt: skip
        out = llm.generate(prompt, params)[0].outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        runs[path] = (out.token_ids, logprobs)
    assert runs["triton"][0] == golden["long_greedy_ids"].tolist() == runs["xla"][0]
    np.testing.assert_allclose(runs["triton"][1], runs["xla"][1], atol=1e-4)


SHARDED_SCRIPT = textwrap.dedent("""
    import json
    import os
    import jax
    import numpy as np
    from jaxserve.models import moe
    from jaxserve.runner.parallel.expert_parallel import sharded_experts
    from jaxserve.runner.parallel.sharding import make_mesh
    rng = np.random.default_rng()
    x = rng.normal(size=(13, 8)).astype(np.float32)
    ids = rng.integers(0, 8, size=(13, 2)).astype(np.int32)
    ids[:5] = 3  # five tokens on one expert
    ids[11:] = 8  # padding: no expert
    w = rng.random((13, 2)).astype(np.float32)
    gate, up = rng.normal(size=(2, 8, 8, 4)).astype(np.float32)
    down = rng.normal(size=(8, 4, 8)).astype(np.float32)
    os.environ["JAXSERVE_GROUPED_MATMUL"] = "xla"
    want = moe.run_experts(x, ids, w, gate, up, down, act=jax.nn.silu)
    os.environ["JAXSERVE_GROUPED_MATMUL"] = "triton"
    for n, ep in [(4, True), (2, False)]:
        experts = sharded_experts(make_mesh(n, devices=jax.devices()[:n]), "tp", ep)
        fn = jax.jit(lambda *a: experts(*a, act=jax.nn.silu))
        jaxpr = str(jax.make_jaxpr(fn)(x, ids, w, gate, up, down))
        got = fn(x, ids, w, gate, up, down)
        print(json.dumps({"ep": ep, "kernels": jaxpr.count("grouped_matmul_triton"),
                          "ragged_dot": jaxpr.count("ragged_dot"),
                          "max_error": float(np.abs(np.asarray(got - want)).max())}))
""")


def test_expert_and_tensor_parallel_experts_run_on_the_kernel():
    """Under shard_map on 4 virtual devices, split whole (all-to-all) or sliced (all-reduce),
    the experts forced onto the kernel give ragged_dot's output on one device."""
    stdout = run_with_devices(SHARDED_SCRIPT, 4, timeout=300)
    runs = [json.loads(line) for line in stdout.strip().splitlines()]
    assert [r["ep"] for r in runs] == [True, False]
    for run in runs:
        assert run["kernels"] == 3 and run["ragged_dot"] == 0, run
        assert run["max_error"] < 1e-4, run


def test_startup_log_says_which_grouped_matmul_runs(monkeypatch):
    from jaxserve.config import builtin_config_dir
    from jaxserve.engine_config import EngineConfig
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner.devices import describe_experts

    qwen3 = load_model_config(builtin_config_dir("qwen3-30b-a3b"))
    ep = EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    monkeypatch.delenv(gm.GROUPED_MATMUL_ENV, raising=False)
    assert describe_experts(qwen3, ep) == (
        "Experts: 128, 8 per token (jax.lax.ragged_dot), expert parallel over 4"
    )
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "triton")
    assert describe_experts(qwen3, ep, jnp.bfloat16) == (
        "Experts: 128, 8 per token (Pallas Triton grouped matmul: "
        "JAXSERVE_GROUPED_MATMUL=triton: interpreted on the cpu), expert parallel over 4"
    )


def test_routing_changes_never_recompile_the_kernel():
    """Group sizes are data: one compiled kernel serves every routing, empty groups and
    rows past the sum included."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.normal(size=(24, 32)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(4, 32, 32)), jnp.bfloat16)
    # NOTE: interpret mode's first call imports modules that register a config option, which
    # changes every jit's trace context once (the GPU lowering does not): call it first.
    gmt.grouped_matmul(lhs, rhs, jnp.zeros(4, jnp.int32), interpret=True)
    run = jax.jit(functools.partial(gmt.grouped_matmul, interpret=True))
    for sizes in ([6, 6, 6, 6], [24, 0, 0, 0], [0, 0, 1, 2], [0, 0, 0, 0]):
        out = run(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        want = numpy_grouped_matmul(lhs, rhs, np.asarray(sizes))
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=0.1, rtol=0.02)
    assert run._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
def test_the_experts_take_the_kernel_on_a_gpu(monkeypatch):
    """moe.expert_mlp on a GPU runs the Triton kernel by default (no ragged_dot left), and
    JAXSERVE_GROUPED_MATMUL=xla brings ragged_dot back; both give the same rows."""
    monkeypatch.delenv(gm.GROUPED_MATMUL_ENV, raising=False)
    rng = np.random.default_rng()
    sizes = jnp.asarray([30, 0, 2, 100] + [0] * 4, jnp.int32)
    rows = jnp.asarray(rng.normal(size=(160, 256)), jnp.bfloat16)
    w_gate, w_up = jnp.asarray(rng.normal(size=(2, 8, 256, 128)) / 16, jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(8, 128, 256)) / 11, jnp.bfloat16)
    args = (rows, sizes, w_gate, w_up, w_down)
    jaxpr = str(jax.make_jaxpr(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args))
    assert jaxpr.count("grouped_matmul_triton") == 3 and "ragged_dot" not in jaxpr
    got = jax.jit(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args)
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "xla")
    want = jax.jit(lambda *a: moe.expert_mlp(*a, jax.nn.silu))(*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.05, rtol=0.05
    )
