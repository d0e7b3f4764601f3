"""The skinny-matmul kernel against its jnp reference, its tile plan and its switch.

On the CPU the kernel runs in Pallas interpret mode on the Llama projections scaled down
(hidden 256), with K and N that the tiles do not divide, and is lowered to Triton IR for an
(abstract) H200. Fresh random inputs every run; the seed is in the failure message.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import quant
from jaxserve.models.quant import weight_layout
from pallas_kernels.skinny_matmul import dispatch, reference
from pallas_kernels.skinny_matmul import triton as sm
from tests.conftest import fixture_dir

DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    x_dtype: str = "bfloat16"
    w_dtype: str = "bfloat16"  # bfloat16 | float16 | float8_e4m3fn | int8
    num_splits: int | None = None  # None: the plan's
    block_n: int | None = None
    block_k: int | None = None

    @property
    def w_layout(self) -> str:  # 8-bit weights are QArrays: [N, K]
        return "nk" if self.w_dtype in ("float8_e4m3fn", "int8") else "kn"

    @property
    def config(self) -> sm.SkinnyConfig:
        return sm.SkinnyConfig(self.block_n, self.block_k, self.num_splits)


# Llama-3-8B's projections at hidden 256 (fused qkv, o, gate/up, down, lm_head); 32-wide tiles
# so that every call has several N blocks and K steps. Sizes that are no multiple of a tile
# (200, 300, 1000) exercise the masks.
CPU_CASES = [
    Case("qkv_m1_bf16", 1, 256, 384, block_n=32, block_k=32),
    Case("o_m3_split4_bf16", 3, 256, 256, num_splits=4, block_n=32, block_k=32),
    Case("gate_up_m16_fp16", 16, 256, 896, "float16", "float16", block_n=64, block_k=64),
    Case("down_m64_split2_bf16", 64, 448, 256, num_splits=2, block_n=64, block_k=64),
    Case("lm_head_m3_ragged", 3, 200, 1000, block_n=128, block_k=64),
    Case("qkv_m1_fp8_split3", 1, 256, 384, w_dtype="float8_e4m3fn", num_splits=3, block_n=64),
    Case("down_m16_fp8_ragged", 16, 300, 200, w_dtype="float8_e4m3fn", block_n=32, block_k=64),
    Case("o_m64_fp8_fp16", 64, 256, 256, "float16", "float8_e4m3fn", block_n=64, block_k=64),
    Case("gate_up_m3_int8", 3, 256, 512, w_dtype="int8", num_splits=2, block_n=64, block_k=64),
    Case("down_m1_int8_ragged_fp16", 1, 300, 100, "float16", "int8", block_n=32, block_k=64),
]  # fmt: skip


def make_inputs(rng: np.random.Generator, case: Case):
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), case.x_dtype)
    shape = (case.k, case.n) if case.w_layout == "kn" else (case.n, case.k)
    w = rng.standard_normal(shape, np.float32) / np.sqrt(case.k)
    scale = None
    if case.w_layout == "nk":  # quantized per output channel, as quant.quantize does
        limit = 127.0 if case.w_dtype == "int8" else 448.0
        amax = np.abs(w).max(axis=1)
        w = np.clip(w / (amax / limit)[:, None], -limit, limit)
        w = np.round(w) if case.w_dtype == "int8" else w
        scale = jnp.asarray(amax / limit, jnp.float32)
    return x, jnp.asarray(w, case.w_dtype), scale


def assert_matches(out: jax.Array, ref: jax.Array, seed: int) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    # Both sum in f32 (in another order); the output is rounded to 16 bits once.
    tol = 1e-2 * max(1.0, float(np.abs(ref32).max()))
    np.testing.assert_allclose(out32, ref32, atol=tol, rtol=1e-2, err_msg=f"{seed=}")


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    x, w, scale = make_inputs(np.random.default_rng(seed), case)
    out = sm.skinny_matmul(x, w, scale, w_layout=case.w_layout, config=case.config, interpret=True)
    assert_matches(out, reference.skinny_matmul(x, w, scale, w_layout=case.w_layout), seed)


def test_float32_logits_from_a_tied_embedding():
    """compute_logits' tied case: the embedding [V, H] read as an [N, K] weight, f32 out."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 96)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((300, 96)), jnp.float32)
    config = sm.SkinnyConfig(block_n=64, block_k=32)
    out = sm.skinny_matmul(x, embed, w_layout="nk", config=config, interpret=True)
    ref = jnp.einsum("NH,VH->NV", x, embed, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_bf16_input_with_float32_output():
    x, w, _ = make_inputs(np.random.default_rng(0), CPU_CASES[0])
    out = sm.skinny_matmul(x, w, out_dtype=jnp.float32, config=CPU_CASES[0].config, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(
        out, reference.skinny_matmul(x, w, out_dtype=jnp.float32), rtol=1e-5, atol=1e-5
    )


LOWERING_CASES = [
    Case("llama_qkv_m8_bf16", 8, 4096, 6144),
    Case("llama_qkv_m8_fp8", 8, 4096, 6144, w_dtype="float8_e4m3fn"),
    *CPU_CASES[4:],  # masked loads of every weight format (fp8 and int8 zeros), fp16 x
]


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: c.name)
def test_lowers_to_triton_for_an_h200(case: Case, verify_triton_modules) -> None:
    """The Pallas -> Triton IR lowering (fp8 converts and masked loads included)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    x = jax.ShapeDtypeStruct((case.m, case.k), jnp.dtype(case.x_dtype))
    w_shape = (case.k, case.n) if case.w_layout == "kn" else (case.n, case.k)
    w = jax.ShapeDtypeStruct(w_shape, jnp.dtype(case.w_dtype))
    scale = jax.ShapeDtypeStruct((case.n,), jnp.float32) if case.w_layout == "nk" else None

    def call(x, w, s):
        return sm.skinny_matmul(x, w, s, w_layout=case.w_layout, config=case.config)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(call).trace(x, w, scale).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_plan_splits_k_only_while_the_grid_is_short():
    def splits(m: int, k: int, n: int, itemsize: int = 2, layout: str = "kn") -> int:
        tiles = sm.plan(m, k, n, itemsize, layout, 132, sm.SkinnyConfig())
        assert tiles.num_splits is not None
        return tiles.num_splits

    assert splits(1, 4096, 6144) == 8  # qkv: 48 N blocks x 8 = 384 programs
    assert splits(1, 14336, 4096) == 16  # down: 32 x 16
    assert splits(1, 4096, 28672) == 4  # gate/up: 224 x 4
    assert splits(1, 4096, 128256) == 1  # lm_head: 1,002 blocks fill the GPU alone
    # At 64 rows the f32 partial sums would cost more than a tenth of the weight's bytes.
    assert splits(64, 4096, 6144) == 1
    assert splits(16, 4096, 6144) == 4
    # fp8 [N, K]: N tiles narrowed first (contiguous rows whatever their number), then split.
    fp8_qkv = sm.plan(1, 4096, 6144, 1, "nk", 132, sm.SkinnyConfig())
    assert (fp8_qkv.block_n, fp8_qkv.block_k, fp8_qkv.num_splits) == (16, 256, 2)  # 768
    fp8_gate_up = sm.plan(1, 4096, 28672, 1, "nk", 132, sm.SkinnyConfig())
    assert (fp8_gate_up.block_n, fp8_gate_up.num_splits) == (32, 1)  # 896 programs
    tiles = sm.plan(1, 200, 40, 2, "kn", 132, sm.SkinnyConfig())
    assert (tiles.block_n, tiles.block_k) == (64, 128)  # tiles shrink to small shapes


def test_bad_calls_name_the_field_and_the_limit():
    x = jnp.zeros((65, 32), jnp.bfloat16)
    w = jnp.zeros((32, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"m=65 rows: the kernel takes 1 to 64"):
        sm.skinny_matmul(x, w, interpret=True)
    with pytest.raises(ValueError, match=r"disagree on K"):
        sm.skinny_matmul(x[:1], w.T, interpret=True)
    with pytest.raises(ValueError, match=r"w dtype float16: the kernel takes x's dtype"):
        sm.skinny_matmul(x[:1], w.astype(jnp.float16), interpret=True)
    with pytest.raises(ValueError, match=r"scale float32\[8\] must be float32\[16\]"):
        sm.skinny_matmul(x[:1], w, jnp.ones(8, jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two >= 16"):
        sm.SkinnyConfig(block_n=48)


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(dispatch.SKINNY_ENV, raising=False)
    assert dispatch.takes(1) is None  # off by default
    assert dispatch.describe().startswith("Skinny matmul: off")
    monkeypatch.setenv(dispatch.SKINNY_ENV, "auto")
    assert dispatch.takes(1) is None  # auto: NVIDIA GPUs only
    assert "this is the cpu backend" in dispatch.describe()
    monkeypatch.setenv(dispatch.SKINNY_ENV, "on")
    assert dispatch.takes(64) == "interpret" and dispatch.takes(65) is None
    monkeypatch.setenv(dispatch.MAX_TOKENS_ENV, "16")
    assert dispatch.takes(16) == "interpret" and dispatch.takes(17) is None
    assert dispatch.describe() == (
        "Skinny matmul: Pallas Triton kernel in interpret mode for steps of up to 16 tokens "
        "(JAXSERVE_SKINNY_MATMUL=on, Pallas interpret mode on the cpu backend)"
    )
    monkeypatch.setenv(dispatch.MAX_TOKENS_ENV, "65")
    with pytest.raises(ValueError, match=r"JAXSERVE_SKINNY_MATMUL_MAX_TOKENS=65 must be in"):
        dispatch.takes(1)
    monkeypatch.setenv(dispatch.SKINNY_ENV, "yes")
    with pytest.raises(ValueError, match=r"JAXSERVE_SKINNY_MATMUL='yes' must be one of"):
        dispatch.takes(1)


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


# The same grid at the real Llama-3-8B shapes, natively.
GPU_CASES = CPU_CASES + [
    Case(f"llama_{name}_m{m}_{w}", m, k, n, w_dtype=w)
    for name, k, n, dtypes in (
        ("qkv", 4096, 6144, ("bfloat16", "float8_e4m3fn")),
        ("down", 14336, 4096, ("bfloat16", "float8_e4m3fn", "int8")),
        ("lm_head", 4096, 128256, ("bfloat16",)),  # (never quantized)
    )
    for m in (1, 16, 64)
    for w in dtypes
]


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_native_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    x, w, scale = make_inputs(np.random.default_rng(seed), case)
    out = jax.jit(
        lambda x, w, s: sm.skinny_matmul(x, w, s, w_layout=case.w_layout, config=case.config)
    )(x, w, scale)
    assert_matches(out, reference.skinny_matmul(x, w, scale, w_layout=case.w_layout), seed)


# -- the model on the kernel ---------------------------------------------------------------------


def _generate(quantization: str | None) -> tuple[list[int], list[float]]:
    golden = np.load(fixture_dir("llama") / "golden.npz")
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        quantization=quantization,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        warmup=False,
    )
    prompt = {"prompt_token_ids": golden["prompt_ids"].tolist()}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    out = llm.generate(prompt, params)[0].outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
    return out.token_ids, logprobs


def test_linear_reads_the_weight_layout_from_the_einsum():
    assert weight_layout("TH,HXD->TXD") == ("kn", 1)  # fused qkv [H, N + 2K, D]
    assert weight_layout("TND,NDH->TH") == ("kn", 2)  # o [N, D, H]
    assert weight_layout("NH,VH->NV") == ("nk", 1)  # a tied embedding [V, H]
    assert weight_layout("TH,EHM->TEM") is None  # experts: E is no output axis of the weight
    assert weight_layout("TNL,NLD->TND") is None  # N is a batch axis
    assert weight_layout("BTH,HD->BTD") is None  # two leading axes


LINEAR_CASES = [
    ("TND,NDH->TH", (3, 4, 16), (4, 16, 40), None),  # o [N, D, H]
    ("NH,VH->NV", (2, 32), (100, 32), None),  # a tied embedding, f32 logits
    ("TH,HI->TI", (2, 3, 64), (64, 48), "int8"),  # two leading axes of x
    ("TH,HI->TI", (5, 64), (64, 48), "fp8"),
]


@pytest.mark.parametrize("spec,x_shape,w_shape,quantized", LINEAR_CASES)
def test_linear_on_the_kernel_matches_xla(monkeypatch, spec, x_shape, w_shape, quantized):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    out_dtype = jnp.float32 if spec.startswith("NH") else None
    if quantized is not None:
        w = quant.quantize(quant.to_out_in(w, 1), quantized, w_shape[:1], w_shape[1:])
    monkeypatch.setenv(dispatch.SKINNY_ENV, "off")
    expected = quant.linear(x, w, spec, out_dtype)
    calls = []
    kernel = sm.skinny_matmul
    monkeypatch.setattr(sm, "skinny_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv(dispatch.SKINNY_ENV, "on")
    out = quant.linear(x, w, spec, out_dtype)
    assert calls and out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_model_on_the_kernel_gives_the_plain_tokens(monkeypatch, caplog, quantization: str | None):
    """JAXSERVE_SKINNY_MATMUL=on: every matmul of every step (prefill chunks of up to 32 tokens
    and decodes) runs the kernel in interpret mode: the fused qkv and gate/up (unquantized) or
    the int8 QArrays, o, down and the lm_head."""
    check_model_on_the_kernel(monkeypatch, caplog, quantization, "on", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_model_on_the_native_kernel_gives_the_plain_tokens(
    monkeypatch, caplog, quantization: str | None
):
    """The same with JAXSERVE_SKINNY_MATMUL=auto, natively on one GPU (where XLA's f32 matmuls
    may round their inputs to TF32, and the kernel's do not)."""
    check_model_on_the_kernel(monkeypatch, caplog, quantization, "auto", tol=2e-2)


def check_model_on_the_kernel(
    monkeypatch, caplog, quantization: str | None, mode: str, tol: float
) -> None:
    monkeypatch.delenv(dispatch.SKINNY_ENV, raising=False)
    plain_ids, plain_logprobs = _generate(quantization)
    calls: list[tuple[str, tuple[int, ...]]] = []
    kernel = sm.skinny_matmul

    def counted(x, w, *args, **kwargs):
        calls.append((str(w.dtype), tuple(w.shape)))
        return kernel(x, w, *args, **kwargs)

    monkeypatch.setattr(sm, "skinny_matmul", counted)
    monkeypatch.setenv(dispatch.SKINNY_ENV, mode)
    caplog.set_level(logging.INFO, logger="jaxserve")
    ids, logprobs = _generate(quantization)
    assert dispatch.describe() in caplog.messages  # the start-up log says which path runs
    assert ids == plain_ids
    np.testing.assert_allclose(logprobs, plain_logprobs, rtol=tol, atol=tol)
    shapes = {shape for _, shape in calls}
    if quantization is None:  # hidden 64, 4 + 2 x 2 heads of 16, intermediate 96, vocab
        assert {(64, 128), (64, 64), (64, 192), (96, 64)} <= shapes
    else:  # [out, in], joined as the plain weights are: q/k/v, o, gate/up, down
        assert {(128, 64), (64, 64), (192, 64), (64, 96)} <= shapes
        assert ("int8", (192, 64)) in calls
    assert any(shape[0] == 64 and shape[1] > 192 for shape in shapes)  # lm_head [H, V]
