"""The gate/up GEMM with SwiGLU in its epilogue (``pallas_kernels/swiglu_matmul``): the Mosaic
GPU kernel in Pallas interpret mode against its reference on fresh random inputs (tiles that
fit the shapes and tiles halved to fit them), what it refuses, its switch
(``JAXSERVE_SWIGLU_MATMUL``), and a dense MLP and a served model through it."""

from __future__ import annotations

import dataclasses
import json
import math
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxserve
from jaxserve.models import decoder
from jaxserve.models.layers import FusedProjections, LayerWeights
from jaxserve.runner.devices import startup_lines
from pallas_kernels.swiglu_matmul import dispatch, reference
from pallas_kernels.swiglu_matmul import mosaic_gpu as sm
from tests.conftest import fixture_dir


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    dtype: str = "bfloat16"
    config: sm.SwigluMatmulConfig = sm.SwigluMatmulConfig()


CASES = [
    Case("default_tiles", 128, 128, 192),
    Case("n96_halves_block_n_to_32", 128, 64, 96),  # the test fixtures' intermediate size
    Case("f16_small_tiles_k96", 256, 96, 128, "float16", sm.SwigluMatmulConfig(64, 32, 32, 2)),
    Case("block_k_128_two_stages", 128, 256, 64, config=sm.SwigluMatmulConfig(128, 64, 128, 2)),
    # The persistent, warp-specialized form: 12 tiles of 2 x 64 rows over 2 programs (block_n
    # halved to 32 for N = 96), and the probe's tiles of 2 x 128 rows.
    Case("persistent_12_tiles", 512, 64, 96, config=sm.SwigluMatmulConfig(64, 32, 32, 2, True)),
    Case("persistent_128_rows", 256, 128, 64, config=sm.SwigluMatmulConfig(128, 64, 64, 3, True)),
    # The ping-pong schedule: 6 pairs of 64-row tiles over 2 programs (N = 128 in 4 tiles of
    # 32), each pair's K loop 4 steps a member through a ring of 3 stages.
    Case(
        "pingpong_6_pairs", 192, 128, 128, config=sm.SwigluMatmulConfig(64, 32, 32, 3, True, True)
    ),
]


def assert_close(out: jax.Array, want: jax.Array, message: str = "") -> None:
    """The kernel's output against the reference's: the same float32 values rounded once, so
    within a bf16 ulp of the largest."""
    got, ref = np.asarray(out, np.float32), np.asarray(want, np.float32)
    atol = 2**-7 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=2**-7, atol=atol, err_msg=message)


def inputs(case: Case, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), case.dtype)
    w = jnp.asarray(rng.standard_normal((case.k, 2 * case.n)) / np.sqrt(case.k), case.dtype)
    return x, w


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case, capfd) -> None:
    """Both products in float32, SwiGLU, one rounding: the reference's values to an ulp; the
    race detector finds no shared-memory access unordered with another (the persistent form's
    memory and compute warpgroups, its epilogue's store against the next tile's)."""
    x, w = inputs(case, seed=int(np.random.default_rng().integers(1000)))
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = sm.swiglu_matmul(x, w, config=case.config, interpret=params)
    assert "RACE DETECTED" not in capfd.readouterr().out
    want = reference.swiglu_matmul(x, w)
    assert out.shape == (case.m, case.n) and out.dtype == x.dtype
    assert_close(out, want)
    # against XLA's path (the product rounded before SwiGLU): close, not equal
    gate_up = x @ w
    xla = jax.nn.silu(gate_up[:, : case.n]) * gate_up[:, case.n :]
    got, ref = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - np.asarray(xla, np.float32)).max() < 0.05 * np.abs(ref).max()


def test_plan_halves_the_tiles_to_fit_and_the_kernel_refuses_the_rest() -> None:
    config = sm.SwigluMatmulConfig()
    assert sm.plan(96, 64, config) == sm.SwigluMatmulConfig(128, 32, 64, 4)
    assert sm.plan(3072, 1024, config) == config
    bf16 = jnp.bfloat16

    def reason(m: int, k: int, n2: int, dtype=bf16, w_dtype=bf16) -> str | None:
        x, w = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n2), w_dtype)
        return sm.unsupported_reason(x, w, config)

    assert reason(128, 64, 192) is None
    assert "multiple of 128 (its tile's rows)" in (reason(64, 64, 192) or "")
    persistent = dataclasses.replace(config, warp_specialized=True)
    assert persistent.rows == 256 and config.rows == 128
    x_128 = jax.ShapeDtypeStruct((128, 64), bf16)
    w_192 = jax.ShapeDtypeStruct((64, 192), bf16)
    assert "multiple of 256" in (sm.unsupported_reason(x_128, w_192, persistent) or "")
    assert "odd width" in (reason(128, 64, 191) or "")
    assert "N must be a multiple of 16" in (reason(128, 64, 2 * 40) or "")
    assert "K of 32" in (reason(128, 48, 192) or "")
    assert "bfloat16 or float16" in (reason(128, 64, 192, jnp.float32, jnp.float32) or "")
    assert "both alike" in (reason(128, 64, 192, bf16, jnp.float16) or "")
    x, w = inputs(Case("bad", 64, 64, 96), 0)
    with pytest.raises(ValueError, match="swiglu_matmul: 64 rows"):
        sm.swiglu_matmul(x, w, interpret=True)
    x, w = inputs(Case("big", 128, 128, 128), 0)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        sm.swiglu_matmul(x, w, config=sm.SwigluMatmulConfig(128, 128, 128, 8), interpret=True)
    with pytest.raises(ValueError, match="bytes of shared memory"):  # 5 stages of 384 rows
        x, w = inputs(Case("tall", 256, 128, 128), 0)
        sm.swiglu_matmul(x, w, config=dataclasses.replace(persistent, num_stages=5), interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        sm.SwigluMatmulConfig(block_m=32)


def as_hopper(monkeypatch, capability: str = "9.0") -> None:
    """The dispatch's view of the process: one NVIDIA GPU of ``capability``."""
    gpu = types.SimpleNamespace(compute_capability=capability)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch.jax, "devices", lambda *a, **k: [gpu])


def test_the_switch_is_auto_by_default_and_names_its_path(monkeypatch) -> None:
    """``auto`` (the default) takes the kernel on one Hopper GPU for steps of at least 128
    rows over a hidden size of at most 2,048 (where it beat XLA's GEMM and pass), XLA's path
    elsewhere; ``off`` never, ``on`` wherever its tiles fit."""
    x, w = (
        jax.ShapeDtypeStruct((128, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 192), jnp.bfloat16),
    )
    assert dispatch.requested() == "auto"
    assert dispatch.choose() == ("xla", "the kernel is Mosaic GPU; this is the cpu backend")
    assert dispatch.takes(x, w) is None
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "off")
    assert dispatch.describe() == (
        "SwiGLU: XLA's gate/up GEMM, then a pass of its own (JAXSERVE_SWIGLU_MATMUL=off)"
    )
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "on")
    assert dispatch.takes(x, w) == "interpret"  # the CPU
    small = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16)
    assert dispatch.takes(small, w) is None  # a decode bucket: fewer rows than a tile
    monkeypatch.delenv("JAXSERVE_SWIGLU_MATMUL")
    as_hopper(monkeypatch)
    big = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
    assert dispatch.takes(big, w) == "mosaic_gpu" and dispatch.takes(small, w) is None
    wide, wide_w = (  # Llama-3-8B's hidden size: the kernel lost to XLA's GEMM and pass there
        jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16),
    )
    assert dispatch.config_for(wide, wide_w) is not None and dispatch.takes(wide, wide_w) is None
    at_limit, at_limit_w = (
        jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048, 256), jnp.bfloat16),
    )
    assert dispatch.takes(at_limit, at_limit_w) == "mosaic_gpu"
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "on")
    assert dispatch.takes(wide, wide_w) == "mosaic_gpu"
    monkeypatch.delenv("JAXSERVE_SWIGLU_MATMUL")
    assert dispatch.describe() == (
        "SwiGLU: in the gate/up GEMM's epilogue on the Pallas Mosaic GPU kernel, steps of at "
        "least 128 tokens and a hidden size of at most 2048 where its tiles fit "
        "(JAXSERVE_SWIGLU_MATMUL=auto)"
    )
    as_hopper(monkeypatch, "8.0")
    assert dispatch.choose()[1].startswith("compute capability 8.0")
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "fast")
    with pytest.raises(ValueError, match="JAXSERVE_SWIGLU_MATMUL"):
        dispatch.choose()


def test_the_dispatch_takes_the_persistent_form_where_its_tiles_fill() -> None:
    """Rows in tiles of 2 x 128: the persistent form; 128 rows: the simple form; fewer: none."""
    w = jax.ShapeDtypeStruct((64, 192), jnp.bfloat16)

    def rows(m: int):
        return dispatch.config_for(jax.ShapeDtypeStruct((m, 64), jnp.bfloat16), w)

    persistent = rows(512)
    assert persistent is not None and persistent.warp_specialized and persistent.rows == 256
    assert rows(384) == sm.SwigluMatmulConfig()  # 128 rows a tile
    assert rows(64) is None


def test_the_epilogue_schedule_switch_picks_the_pingpong_tiles(monkeypatch) -> None:
    """``JAXSERVE_EPILOGUE_SCHEDULE``: cooperative by default; ``pingpong`` takes the ping-pong
    tiles where they fit (an even number of column tiles), the cooperative forms elsewhere."""
    x = jax.ShapeDtypeStruct((16384, 1024), jnp.bfloat16)
    qwen3_w = jax.ShapeDtypeStruct((1024, 2 * 3072), jnp.bfloat16)
    bge_w, bge_b = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16), jnp.zeros(4096, jnp.bfloat16)
    monkeypatch.delenv("JAXSERVE_EPILOGUE_SCHEDULE", raising=False)
    assert dispatch.schedule() == "cooperative" and dispatch.gelu_config() == sm.GELU_CONFIG
    assert dispatch.config_for(x, qwen3_w) == dispatch.CONFIGS[0]
    monkeypatch.setenv("JAXSERVE_EPILOGUE_SCHEDULE", "pingpong")
    assert dispatch.config_for(x, qwen3_w) == sm.SWIGLU_PINGPONG_CONFIG
    assert dispatch.gelu_config() == sm.GELU_PINGPONG_CONFIG
    monkeypatch.setenv("JAXSERVE_GELU_MATMUL", "on")
    assert dispatch.gelu_takes(x, bge_w, bge_b) == "interpret"
    odd_w = jax.ShapeDtypeStruct((1024, 3 * 128), jnp.bfloat16)  # 3 column tiles of 128
    assert "even number" in (sm.unsupported_reason(x, odd_w, sm.GELU_PINGPONG_CONFIG, 1) or "")
    assert dispatch.gelu_takes(x, odd_w, jnp.zeros(384, jnp.bfloat16)) is None
    odd_qwen3 = jax.ShapeDtypeStruct((1024, 2 * 3 * 64), jnp.bfloat16)
    assert dispatch.config_for(x, odd_qwen3) == dispatch.CONFIGS[0]  # the cooperative form
    for config in (sm.GELU_PINGPONG_CONFIG, sm.SWIGLU_PINGPONG_CONFIG):
        assert sm.smem_bytes(config, 2, views=1 if config.block_n == 128 else 2) <= sm.SMEM_BYTES
    with pytest.raises(ValueError, match="schedule of the persistent form"):
        sm.SwigluMatmulConfig(pingpong=True)
    monkeypatch.setenv("JAXSERVE_EPILOGUE_SCHEDULE", "staggered")
    with pytest.raises(ValueError, match="JAXSERVE_EPILOGUE_SCHEDULE"):
        dispatch.configs()


def test_a_dense_mlp_takes_the_kernel_where_it_fits(monkeypatch) -> None:
    """A SwiGLU MLP of fused gate/up weights: on the kernel with the switch on (the product
    close to XLA's path), on XLA's path for another activation, with adapters, or few rows."""
    rng = np.random.default_rng(3)
    hidden, inter = 64, 96

    def weight(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.bfloat16)

    lw = LayerWeights(
        attn_norm=weight(hidden), wo=weight(4, 16, hidden), mlp_norm=weight(hidden),
        w_down=weight(inter, hidden),
        fused=FusedProjections(weight(hidden, 6, 16), weight(hidden, 2 * inter)),
    )  # fmt: skip
    x = jnp.asarray(rng.standard_normal((128, hidden)), jnp.bfloat16)
    calls = []
    kernel = dispatch.swiglu_matmul
    monkeypatch.setattr(dispatch, "swiglu_matmul", lambda *a: calls.append(a[2]) or kernel(*a))
    plain = np.asarray(decoder.mlp_block(lw, x), np.float32)
    assert not calls
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "on")
    fused = np.asarray(decoder.mlp_block(lw, x), np.float32)
    assert calls == ["interpret"]
    assert np.abs(fused - plain).max() < 0.05 * np.abs(plain).max()
    gelu = decoder._ACTIVATIONS["gelu_pytorch_tanh"]
    decoder.mlp_block(lw, x, gelu)
    decoder.mlp_block(lw, x[:16])
    assert calls == ["interpret"]


def test_a_served_model_takes_the_kernel_on_its_prompt_steps(monkeypatch) -> None:
    """The bf16 Llama fixture with the switch on: its 128-token prompt step runs the kernel in
    interpret mode (the decode steps' 16 rows do not fit a tile), the greedy tokens are those
    of XLA's path, and the start-up log names the path."""
    prompt = {"prompt_token_ids": list(np.random.default_rng(0).integers(3, 200, 120))}
    params = jaxserve.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    settings = dict(dtype="bfloat16", max_model_len=256, max_num_batched_tokens=128, warmup=False)
    model = str(fixture_dir("llama"))
    want = jaxserve.LLM(model, **settings).generate(prompt, params, use_tqdm=False)
    monkeypatch.setenv("JAXSERVE_SWIGLU_MATMUL", "on")
    calls = []
    kernel = dispatch.swiglu_matmul
    monkeypatch.setattr(
        dispatch, "swiglu_matmul", lambda *a: calls.append(a[0].shape) or kernel(*a)
    )
    llm = jaxserve.LLM(model, **settings)
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert calls and all(shape[0] == 128 for shape in calls)
    runner = llm.engine.runner
    lines = startup_lines(runner.model_config, llm.engine.config, jnp.bfloat16, 256)
    assert (
        "SwiGLU: in the gate/up GEMM's epilogue on the Pallas Mosaic GPU kernel in interpret "
        "mode, every step where its tiles fit (JAXSERVE_SWIGLU_MATMUL=on, Pallas interpret mode "
        "on the cpu backend)" in lines
    )


GELU_CASES = [  # (name, m, k, n, config): an encoder's intermediate GEMM, bias and GELU
    ("gelu_12_tiles_block_n_halved", 512, 64, 96, sm.SwigluMatmulConfig(64, 32, 32, 2, True)),
    ("gelu_default_tiles", 256, 128, 256, sm.GELU_CONFIG),
    ("gelu_pingpong", 192, 96, 256, sm.SwigluMatmulConfig(64, 64, 32, 4, True, True)),
]


def gelu_inputs(m: int, k: int, n: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w, jnp.asarray(rng.standard_normal(n), jnp.bfloat16)


@pytest.mark.parametrize(("name", "m", "k", "n", "config"), GELU_CASES, ids=lambda v: str(v))
def test_gelu_interpret_matches_reference(name, m, k, n, config, capfd) -> None:
    """gelu(x @ w + b): the product and bias in float32, GELU, one rounding (the bias tile
    copied by each compute warpgroup as its K loop starts); no race the detector finds."""
    x, w, b = gelu_inputs(m, k, n, int(np.random.default_rng().integers(1000)))
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = sm.gelu_matmul(x, w, b, config=config, interpret=params)
    assert "RACE DETECTED" not in capfd.readouterr().out
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close(out, reference.gelu_matmul(x, w, b), name)


def test_each_warpgroups_bias_row_starts_128_byte_aligned() -> None:
    """A tensor copy lands on 128-byte boundaries of shared memory: the second warpgroup's row
    of a 32-column bf16 tile is padded to 64 columns (its copy at 64 bytes stopped the GPU)."""
    assert sm.bias_row(32, 2) == 64 and sm.bias_row(128, 2) == 128 and sm.bias_row(96, 2) == 128
    for block_n in (32, 64, 96, 128, 256):
        assert sm.bias_row(block_n, 2) * 2 % sm.TMA_SMEM_ALIGNMENT == 0
        assert sm.bias_row(block_n, 2) >= block_n


def test_the_epilogues_normal_cdf_is_within_3e_7() -> None:
    """Phi through Abramowitz and Stegun's erfc (Mosaic GPU has no layout rule for erf)."""
    h = np.linspace(-12, 12, 40_001)
    want = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in h])
    got = np.asarray(sm.normal_cdf(jnp.asarray(h, jnp.float32)), np.float64)
    assert np.abs(got - want).max() < 3e-7


def test_the_epilogues_gelu_is_h_phi_h_within_3e_7_of_h() -> None:
    """The fused form (``h - h tail`` or ``h tail``, the constants folded) is h Phi(h)."""
    h = np.linspace(-12, 12, 40_001)
    want = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in h])
    got = np.asarray(sm.exact_gelu(jnp.asarray(h, jnp.float32)), np.float64)
    assert np.all(np.abs(got - want) <= 3e-7 * np.maximum(np.abs(h), 1.0))


def test_gelu_matmul_refuses_what_it_does_not_take() -> None:
    x, w, b = gelu_inputs(256, 64, 128, 0)
    with pytest.raises(ValueError, match="one bfloat16 value a column"):
        sm.gelu_matmul(x, w, b[:64], interpret=True)
    with pytest.raises(ValueError, match="persistent form only"):
        sm.gelu_matmul(x, w, b, config=sm.SwigluMatmulConfig(), interpret=True)
    with pytest.raises(ValueError, match="multiple of 256"):
        sm.gelu_matmul(x[:128], w, b, interpret=True)


def test_an_encoder_takes_the_gelu_kernel_when_asked(monkeypatch) -> None:
    """``JAXSERVE_GELU_MATMUL``: XLA's path on the CPU by default; ``on`` runs an exact-GELU
    encoder's intermediate GEMM on the kernel (interpret mode here), close to XLA's GEMM and
    pass; other activations and steps the tiles do not fill keep XLA's path; the log line
    names it."""
    from jaxserve.models.encoder import forward

    x, w, b = gelu_inputs(256, 64, 128, 1)
    lw = types.SimpleNamespace(w_in=w, b_in=b)
    gelu, relu = types.SimpleNamespace(hidden_act="gelu"), types.SimpleNamespace(hidden_act="relu")
    calls = []
    kernel = dispatch.gelu_matmul
    monkeypatch.setattr(dispatch, "gelu_matmul", lambda *a: calls.append(a[3]) or kernel(*a))
    plain = np.asarray(forward.intermediate(lw, x, gelu), np.float32)
    assert not calls and dispatch.describe(dispatch.GELU_ENV).endswith(
        "XLA's intermediate GEMM (bias and exact GELU), then a pass of its own "
        "(the kernel is Mosaic GPU; this is the cpu backend)"
    )
    monkeypatch.setenv("JAXSERVE_GELU_MATMUL", "on")
    fused = np.asarray(forward.intermediate(lw, x, gelu), np.float32)
    assert calls == ["interpret"]
    assert np.abs(fused - plain).max() < 0.05 * np.abs(plain).max()
    forward.intermediate(lw, x, relu)
    forward.intermediate(lw, x[:128], gelu)
    assert calls == ["interpret"]
    assert dispatch.describe(dispatch.GELU_ENV).startswith(
        "GELU: in the intermediate GEMM (bias and exact GELU)'s epilogue on the Pallas Mosaic "
        "GPU kernel in interpret mode"
    )


def test_an_encoder_runner_names_the_gelu_path_when_asked(monkeypatch, caplog) -> None:
    """The BERT fixture's start-up log: no GELU line while the switch is off, XLA's path by
    default on the CPU, the kernel's path once it is on."""
    bert = str(Path(__file__).parent / "fixtures" / "encoders" / "bert_embed")
    settings = dict(runner="pooling", max_model_len=64, max_num_batched_tokens=64, warmup=False)
    caplog.set_level("INFO", logger="jaxserve.runner.encoder_runner")
    monkeypatch.setenv("JAXSERVE_GELU_MATMUL", "off")
    jaxserve.LLM(bert, **settings).shutdown()
    assert not [r for r in caplog.messages if r.startswith("GELU:")]
    monkeypatch.delenv("JAXSERVE_GELU_MATMUL")
    jaxserve.LLM(bert, **settings).shutdown()
    assert [r for r in caplog.messages if r.startswith("GELU: XLA's intermediate GEMM")]
    monkeypatch.setenv("JAXSERVE_GELU_MATMUL", "on")
    jaxserve.LLM(bert, **settings).shutdown()
    assert [r for r in caplog.messages if r.startswith("GELU: in the intermediate GEMM")]


def shipped_mlps() -> set[tuple[int, int]]:
    """(hidden, intermediate) of every shipped config whose dense MLP is SwiGLU."""
    shapes = set()
    root = Path(__file__).resolve().parent.parent / "jaxserve/assets/configs"
    for path in sorted(root.glob("*/config.json")):
        config = json.loads(path.read_text())
        config = config.get("text_config", config)
        act = config.get("hidden_act") or config.get("hidden_activation") or "silu"
        if config.get("hidden_size") and config.get("intermediate_size") and act == "silu":
            shapes.add((config["hidden_size"], config["intermediate_size"]))
    return shapes


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_native_matches_reference(case: Case) -> None:
    seed = int(np.random.default_rng().integers(2**31))
    x, w = inputs(case, seed)
    want = jax.jit(reference.swiglu_matmul)(x, w)
    assert_close(sm.swiglu_matmul(x, w, config=case.config), want, f"{seed=}")


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
def test_native_matches_reference_at_every_shipped_mlp() -> None:
    """A 256-token step through each shipped SwiGLU MLP's gate/up weight the kernel takes, in
    each form the dispatch picks from."""
    seed = int(np.random.default_rng().integers(2**31))
    taken = 0
    for hidden, inter in sorted(shipped_mlps()):
        x, w = inputs(Case("shipped", 256, hidden, inter), seed)
        want = jax.jit(reference.swiglu_matmul)(x, w)
        for config in (sm.SWIGLU_PINGPONG_CONFIG, *dispatch.CONFIGS):
            if sm.unsupported_reason(x, w, config) is not None:
                continue
            taken += 1
            got = sm.swiglu_matmul(x, w, config=config)
            assert_close(got, want, f"{seed=} {hidden=} {inter=} {config=}")
    assert taken


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(("name", "m", "k", "n", "config"), GELU_CASES, ids=lambda v: str(v))
def test_gelu_native_matches_reference(name, m, k, n, config) -> None:
    seed = int(np.random.default_rng().integers(2**31))
    x, w, b = gelu_inputs(m, k, n, seed)
    want = jax.jit(reference.gelu_matmul)(x, w, b)
    assert_close(sm.gelu_matmul(x, w, b, config=config), want, f"{name} {seed=}")


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
def test_gelu_native_at_bge_larges_shape() -> None:
    """A 256-token step through BGE-large's intermediate GEMM (1,024 -> 4,096) and bias."""
    seed = int(np.random.default_rng().integers(2**31))
    x, w, b = gelu_inputs(256, 1024, 4096, seed)
    want = jax.jit(reference.gelu_matmul)(x, w, b)
    assert_close(sm.gelu_matmul(x, w, b), want, f"{seed=}")
    pingpong = sm.gelu_matmul(x, w, b, config=sm.GELU_PINGPONG_CONFIG)
    assert_close(pingpong, want, f"ping-pong {seed=}")
