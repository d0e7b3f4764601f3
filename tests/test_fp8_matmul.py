"""The fp8-matmul kernel against its jnp reference, its plan, its switch and the model on it.

On the CPU the kernel runs in Pallas interpret mode on Llama's projections scaled down (hidden
256), in both modes (W8A8 and weight-only), with K split and not, and is lowered for CUDA (the
Mosaic GPU lowering itself: layouts, the fp8 wgmma, the e4m3 -> f16 conversion in registers)
at the real Llama-3-8B shapes. Natively (``pytest -m gpu``) it runs every per-channel
projection shape of the shipped configs. Fresh random inputs every run; the seed is in the
failure message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import quant
from pallas_kernels.fp8_matmul import dispatch, reference
from pallas_kernels.fp8_matmul import mosaic_gpu as fm
from tests.conftest import fixture_dir
from tests.test_skinny_matmul import assert_matches  # the same products, another order

ROOT = Path(__file__).parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    act_quant: bool
    x_dtype: str = "bfloat16"
    config: fm.Fp8MatmulConfig = fm.Fp8MatmulConfig()


# Llama-3-8B's projections at hidden 256 (fused qkv, o, gate/up, down): rows that are and are
# not a multiple of 8, K split and not, both tile widths.
CPU_CASES = [
    Case("qkv_m1_w8a8", 1, 256, 384, True),
    Case("o_m5_weight_only_split2", 5, 256, 256, False, config=fm.Fp8MatmulConfig(num_splits=2)),
    Case("gate_up_m16_w8a8_n128", 16, 256, 896, True, config=fm.Fp8MatmulConfig(block_n=128)),
    Case("down_m33_weight_only", 33, 448, 256, False, "float16", fm.Fp8MatmulConfig(block_k=64)),
    Case("down_m64_w8a8_split7", 64, 448, 256, True, config=fm.Fp8MatmulConfig(64, 64, 2, 7)),
    Case("qkv_m8_weight_only_f32", 8, 256, 384, False, "float32"),
]


def make_inputs(rng: np.random.Generator, case: Case):
    """x, and a weight quantized per output channel as ``quant.quantize`` does."""
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), case.x_dtype)
    w = rng.standard_normal((case.n, case.k), np.float32) / np.sqrt(case.k)
    amax = np.abs(w).max(axis=1)
    q = np.clip(w / (amax / 448.0)[:, None], -448.0, 448.0)
    return x, jnp.asarray(q, jnp.float8_e4m3fn), jnp.asarray(amax / 448.0, jnp.float32)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    x, w, scale = make_inputs(np.random.default_rng(seed), case)
    out = fm.fp8_matmul(x, w, scale, act_quant=case.act_quant, config=case.config, interpret=True)
    assert_matches(out, reference.fp8_matmul(x, w, scale, act_quant=case.act_quant), seed)


def test_the_two_modes_are_the_two_semantics():
    """W8A8 rounds each row of x to fp8 (its own scale), weight-only to float16: a row of
    very different magnitudes keeps its small entries only weight-only."""
    x = jnp.asarray([[1000.0, 0.001] + [0.0] * 62], jnp.float32)
    w = jnp.zeros((64, 64), jnp.float8_e4m3fn).at[0, 1].set(1.0)  # channel 0 reads x[:, 1]
    scale = jnp.ones(64, jnp.float32)
    # 0.001 / (1000 / 448) is under half of e4m3's smallest subnormal (2^-9): 0 in fp8
    for act_quant, want in ((False, 0.001), (True, 0.0)):
        out = fm.fp8_matmul(x, w, scale, act_quant=act_quant, interpret=True)
        np.testing.assert_allclose(float(out[0, 0]), want, atol=1e-6)
        assert float(reference.fp8_matmul(x, w, scale, act_quant=act_quant)[0, 0]) == float(
            out[0, 0]
        )
    big = jnp.full((1, 64), 1e6, jnp.float32)  # past float16: saturated, not inf
    assert bool(jnp.isfinite(fm.fp8_matmul(big, w, scale, act_quant=False, interpret=True)).all())


# The real shapes, lowered through Mosaic GPU for an H200 (no GPU needed): qkv, o, gate/up and
# down of Llama-3-8B, at 1, 16 and 64 rows, both modes.
LLAMA_3_8B = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}


@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "weight_only"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_lowers_for_cuda_at_the_llama_3_8b_shapes(m: int, act_quant: bool):
    for k, n in LLAMA_3_8B.values():
        args = (
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        )
        call = functools.partial(fm.fp8_matmul, act_quant=act_quant)
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_plan_splits_k_only_while_the_grid_is_short():
    def splits(m: int, k: int, n: int, **config) -> int:
        planned = fm.plan(m, k, n, fm.Fp8MatmulConfig(**config), sms=132)
        assert planned.num_splits is not None
        return planned.num_splits

    assert splits(1, 4096, 28672) == 1  # gate/up: 448 programs already
    assert splits(1, 4096, 6144) == 4  # qkv: 96 channel blocks -> 384 (192 < 2 x 132)
    assert splits(1, 14336, 4096) == 8  # down: 64 -> 512 (K has 112 tiles)
    assert splits(1, 512, 4096) == 1  # 4 tiles of K: no room for 4 stages per share
    assert splits(16, 4096, 4096, num_splits=3) == 3  # a config's split is kept
    assert fm.plan(1, 2880, 2880, fm.Fp8MatmulConfig(), 132).block_k == 64  # gpt-oss: K / 64


def test_bad_calls_name_the_field_and_the_limit():
    w = jnp.zeros((64, 128), jnp.float8_e4m3fn)
    s = jnp.ones(64, jnp.float32)
    cases = [
        ((jnp.zeros((129, 128)), w, s), r"m=129 rows: the kernel takes 1 to 128"),
        ((jnp.zeros((1, 64)), w, s), "disagree on K"),
        ((jnp.zeros((1, 128)), w.astype(jnp.bfloat16), s), "takes float8_e4m3fn"),
        ((jnp.zeros((1, 96)), jnp.zeros((32, 96), jnp.float8_e4m3fn), s[:32]), "multiple of 64"),
        ((jnp.zeros((1, 128)), w, s[:32]), r"must be float32\[64\]"),
    ]
    for (x, w_, s_), message in cases:
        with pytest.raises(ValueError, match=message):
            fm.fp8_matmul(x, w_, s_, act_quant=True, interpret=True)
    with pytest.raises(ValueError, match="block_n=96 must be 64 or 128"):
        fm.Fp8MatmulConfig(block_n=96)
    with pytest.raises(ValueError, match="shared memory; the limit is"):
        fm.fp8_matmul(
            jnp.zeros((128, 1024)),
            jnp.zeros((128, 1024), jnp.float8_e4m3fn),
            jnp.ones(128, jnp.float32),
            act_quant=False,
            config=fm.Fp8MatmulConfig(block_n=128, block_k=256, num_stages=8),
            interpret=True,
        )


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(dispatch.FP8_MATMUL_ENV, raising=False)
    assert dispatch.takes(1) is None  # off by default
    assert dispatch.describe() == "fp8 matmul: XLA's GEMMs (JAXSERVE_FP8_MATMUL=off)"
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "auto")
    assert dispatch.takes(1) is None  # a Mosaic GPU kernel: not on the CPU
    assert "this is the cpu backend" in dispatch.describe()
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "on")
    assert dispatch.takes(64) == "interpret" and dispatch.takes(65) is None
    monkeypatch.setenv(dispatch.MAX_TOKENS_ENV, "16")
    assert dispatch.takes(16) == "interpret" and dispatch.takes(17) is None
    assert "for steps of up to 16 tokens" in dispatch.describe()
    monkeypatch.setenv(dispatch.MAX_TOKENS_ENV, "129")
    with pytest.raises(ValueError, match=r"JAXSERVE_FP8_MATMUL_MAX_TOKENS=129 must be in"):
        dispatch.max_tokens()
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "yes")
    with pytest.raises(ValueError, match=r"JAXSERVE_FP8_MATMUL='yes' must be one of"):
        dispatch.takes(1)


# -- the model on the kernel ---------------------------------------------------------------------


@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "weight_only"])
def test_linear_on_the_kernel_matches_its_reference(monkeypatch, act_quant: bool):
    """``quant.linear`` over an fp8 QArray with two leading axes of x: the kernel's result
    for the flattened rows, shaped back, and XLA's path where the step is too large."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 192)) / 11, jnp.float32)
    qw = quant.quantize(quant.to_out_in(w, 1), "fp8", (128,), (192,), act_quant=act_quant)
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "on")
    calls = []
    kernel = fm.fp8_matmul
    monkeypatch.setattr(fm, "fp8_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    out = quant.linear(x, qw, "BTH,HI->BTI")
    want = reference.fp8_matmul(x.reshape(6, 128), qw.q, qw.scale, act_quant=act_quant)
    assert calls and out.shape == (2, 3, 192) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32).reshape(6, 192), np.asarray(want, np.float32), atol=2e-2
    )
    monkeypatch.setenv(dispatch.MAX_TOKENS_ENV, "4")  # 6 rows: XLA's GEMM
    calls.clear()
    quant.linear(x, qw, "BTH,HI->BTI")
    assert not calls


def _generate() -> tuple[list[int], list[float]]:
    golden = np.load(fixture_dir("llama") / "golden.npz")
    llm = jaxserve.LLM(
        str(fixture_dir("llama")),
        quantization="fp8",
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


def test_fp8_model_on_the_kernel_gives_the_plain_tokens(monkeypatch, caplog):
    """``--quantization fp8`` with JAXSERVE_FP8_MATMUL=on: every step (prefill chunks of up to
    32 tokens and decodes) reads the fp8 projections whose N and K the kernel takes (q and o
    of the fixture's hidden 64) through it, in interpret mode; the same tokens as XLA's."""
    monkeypatch.delenv(dispatch.FP8_MATMUL_ENV, raising=False)
    plain_ids, plain_logprobs = _generate()
    shapes = []
    kernel = fm.fp8_matmul

    def counted(x, w, *args, **kwargs):
        shapes.append(tuple(w.shape))
        return kernel(x, w, *args, **kwargs)

    monkeypatch.setattr(fm, "fp8_matmul", counted)
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "on")
    caplog.set_level(logging.INFO, logger="jaxserve")
    ids, logprobs = _generate()
    assert dispatch.describe() in caplog.messages  # the start-up log says which path runs
    assert (64, 64) in shapes  # [out, in]: q and o
    assert ids == plain_ids
    np.testing.assert_allclose(logprobs, plain_logprobs, rtol=2e-2, atol=2e-2)


# -- natively, on a GPU ------------------------------------------------------------------------


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def shipped_projections() -> set[tuple[int, int]]:
    """(K, N) of every projection of the shipped configs the kernel takes (fused qkv and
    gate/up as the model holds them per-channel-quantized: q, k, v, o, gate, up, down)."""
    shapes = set()
    for path in sorted((ROOT / "jaxserve/assets/configs").glob("*/config.json")):
        config = json.loads(path.read_text())
        config = config.get("text_config", config)
        hidden = config.get("hidden_size")
        inter = config.get("intermediate_size")
        heads = config.get("num_attention_heads")
        if not (hidden and inter and heads):
            continue
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads", heads)
        for k, n in (
            (hidden, heads * head_dim),
            (hidden, kv * head_dim),
            (heads * head_dim, hidden),
            (hidden, inter),
            (inter, hidden),
        ):
            if n % 64 == 0 and k % 64 == 0:
                shapes.add((k, n))
    return shapes


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "weight_only"])
@pytest.mark.parametrize("m", [1, 12, 64])
def test_native_matches_reference_at_every_shipped_projection(m: int, act_quant: bool):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    for k, n in sorted(shipped_projections()):
        x, w, scale = make_inputs(rng, Case("shipped", m, k, n, act_quant))
        out = fm.fp8_matmul(x, w, scale, act_quant=act_quant)
        want = jax.jit(functools.partial(reference.fp8_matmul, act_quant=act_quant))(x, w, scale)
        assert_matches(out, want, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_native_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))
    x, w, scale = make_inputs(np.random.default_rng(seed), case)
    out = fm.fp8_matmul(x, w, scale, act_quant=case.act_quant, config=case.config)
    assert_matches(out, reference.fp8_matmul(x, w, scale, act_quant=case.act_quant), seed)


def test_one_device_kernels_follow_the_models_devices_not_the_processs(monkeypatch):
    """A process of four data-parallel replicas of one device each: the runner says one device
    a model, and the one-device kernels apply; under tensor parallelism (4) they do not."""
    from pallas_kernels import env_choice

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    monkeypatch.setattr(env_choice, "_devices_per_model", None)
    monkeypatch.setenv(dispatch.FP8_MATMUL_ENV, "auto")

    class Hopper:
        compute_capability = "9.0"

    monkeypatch.setattr(jax, "devices", lambda *a: [Hopper()])
    ladder = functools.partial(
        env_choice.one_device_triton_path, "X", "auto", forced="on", off="off", fallback="xla"
    )
    assert ladder() == ("xla", "4 devices a model: the kernel is not partitioned yet")
    assert dispatch.choose()[0] == "xla"
    env_choice.set_devices_per_model(1)  # what a replica's runner says
    assert ladder() == ("triton", "X=auto") and dispatch.choose()[0] == "mosaic_gpu"
    env_choice.set_devices_per_model(4)  # tensor parallel over the four
    assert ladder()[0] == "xla" and dispatch.choose()[0] == "xla"
    with pytest.raises(ValueError, match="devices per model 0 must be >= 1"):
        env_choice.set_devices_per_model(0)
