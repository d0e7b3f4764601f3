"""The per-head norm and rotary kernel (``pallas_kernels/qk_norm_rope``): the kernel against its
reference and the decoder's ``normed_rotary`` on fresh random inputs (Pallas interpret mode on
the CPU, natively under ``pytest -m gpu``), its refusals, the switch (off by default), and a
Qwen3 model's steps on it giving XLA's path's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.models.decoder import normed_rotary
from jaxserve.runner.devices import startup_lines
from pallas_kernels.qk_norm_rope import dispatch, reference, triton
from tests.conftest import fixture_dir

CASES = [  # (tokens, q heads, kv heads, head size, dtype, Gemma's 1 + weight)
    (32, 4, 2, 32, "bfloat16", False),
    (48, 8, 4, 64, "bfloat16", True),
    (16, 2, 1, 128, "float32", False),
]


def inputs(t: int, n: int, kv: int, d: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(3 * rng.standard_normal((t, n + 2 * kv, d)), dtype)
    weights = [jnp.asarray(1 + 0.3 * rng.standard_normal(d), dtype) for _ in range(2)]
    angles = rng.uniform(0, 100, (t, d // 2))
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], -1)), dtype)
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], -1)), dtype)
    return qkv, weights, cos, sin


def assert_close(got: jax.Array, want: jax.Array, message: str) -> None:
    """Within a few ulps of the largest value: the kernel and XLA may round the float32
    products' intermediates at other points."""
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = float(jnp.finfo(got.dtype).eps)
    np.testing.assert_allclose(got32, want32, atol=4 * eps * np.abs(want32).max(), err_msg=message)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_interpret_matches_the_reference_and_the_decoders_path(case) -> None:
    t, n, kv, d, dtype, gemma = case
    seed = int(np.random.default_rng().integers(2**31))
    qkv, (wq, wk), cos, sin = inputs(t, n, kv, d, dtype, seed)
    for first, heads, w in ((0, n, wq), (n, kv, wk)):
        got = triton.normed_rope(
            qkv, w, cos, sin, first=first, heads=heads, eps=1e-6, unit_offset=gemma, interpret=True
        )
        want = reference.normed_rope(
            qkv, w, cos, sin, first=first, heads=heads, eps=1e-6, unit_offset=gemma
        )
        decoder = normed_rotary(
            qkv[:, first : first + heads], w, 1e-6, gemma, (cos[:, None], sin[:, None])
        )
        assert got.shape == (t, heads, d) and got.dtype == qkv.dtype
        assert_close(got, want, f"{seed=} {first=}")
        assert_close(want, decoder, f"{seed=} {first=}: the reference is the decoder's path")


def test_the_kernel_refuses_what_it_does_not_take() -> None:
    qkv = jax.ShapeDtypeStruct((32, 12, 64), jnp.bfloat16)
    assert triton.unsupported_reason(qkv, 0, 8) is None
    assert "powers of two" in triton.unsupported_reason(qkv, 0, 6)
    assert "multiple of 4" in triton.unsupported_reason(qkv, 6, 4)
    assert "multiple of 16" in triton.unsupported_reason(
        jax.ShapeDtypeStruct((40, 12, 64), jnp.bfloat16), 0, 8
    )
    table = (jnp.ones((32, 64)), jnp.zeros((32, 64)))
    with pytest.raises(ValueError, match="normed_rope: 6 heads of 64"):
        triton.normed_rope(
            jnp.zeros((32, 12, 64)), jnp.ones(64), *table, first=0, heads=6, eps=1e-6
        )


def test_the_switch_is_auto_by_default_and_names_its_path(monkeypatch) -> None:
    """``auto`` (the default): XLA's passes on the CPU, the kernel on one GPU for steps of at
    least 1,024 tokens; ``off`` never; ``on`` wherever the shapes fit."""
    qkv = jax.ShapeDtypeStruct((2048, 32, 128), jnp.bfloat16)
    monkeypatch.delenv("JAXSERVE_QK_NORM_ROPE", raising=False)
    assert dispatch.requested() == "auto" and dispatch.takes(qkv, 0, 16) is None  # the CPU
    assert dispatch.describe() == (
        "Per-head norm and rotary: XLA's reduction and pass (the kernel is Pallas Triton; "
        "this is the cpu backend)"
    )
    monkeypatch.setenv("JAXSERVE_QK_NORM_ROPE", "off")
    assert dispatch.takes(qkv, 0, 16) is None
    assert dispatch.describe() == (
        "Per-head norm and rotary: XLA's reduction and pass (JAXSERVE_QK_NORM_ROPE=off)"
    )
    monkeypatch.setenv("JAXSERVE_QK_NORM_ROPE", "on")
    assert dispatch.takes(qkv, 0, 16) == "interpret" and dispatch.takes(qkv, 0, 12) is None
    assert "Pallas Triton kernel in interpret mode, every step" in dispatch.describe()
    monkeypatch.setenv("JAXSERVE_QK_NORM_ROPE", "auto")
    assert dispatch.takes(qkv, 0, 16) is None  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.takes(qkv, 0, 16) == "triton"
    assert dispatch.takes(jax.ShapeDtypeStruct((512, 32, 128), jnp.bfloat16), 0, 16) is None
    monkeypatch.setenv("JAXSERVE_QK_NORM_ROPE", "fast")
    with pytest.raises(ValueError, match="JAXSERVE_QK_NORM_ROPE"):
        dispatch.choose()


def test_a_qwen3_model_on_the_kernel_generates_xlas_tokens(monkeypatch) -> None:
    """The bf16 Qwen3 fixture with the switch on: every step's q and k go through the kernel
    (interpret mode), and the greedy tokens are those of XLA's path."""
    prompt = {"prompt_token_ids": list(np.random.default_rng(0).integers(3, 200, 40))}
    params = jaxserve.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    settings = dict(dtype="bfloat16", max_model_len=128, max_num_batched_tokens=64, warmup=False)
    model = str(fixture_dir("qwen3"))
    want = jaxserve.LLM(model, **settings).generate(prompt, params, use_tqdm=False)
    monkeypatch.setenv("JAXSERVE_QK_NORM_ROPE", "on")
    calls = []
    kernel = triton.normed_rope
    monkeypatch.setattr(
        triton, "normed_rope", lambda *a, **k: calls.append(k["heads"]) or kernel(*a, **k)
    )
    llm = jaxserve.LLM(model, **settings)
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert set(calls) == {4, 2}  # q's 4 heads and k's 2, in every layer
    runner = llm.engine.runner
    lines = startup_lines(runner.model_config, llm.engine.config, jnp.bfloat16, 128)
    assert "Per-head norm and rotary: one pass on the Pallas Triton kernel in interpret mode" in (
        "\n".join(lines)
    )


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "case", [*CASES, (16384, 16, 8, 128, "bfloat16", False), (256, 16, 8, 256, "bfloat16", True)]
)
def test_native_matches_the_reference(case) -> None:
    """Natively, also at Qwen3-0.6B's 16,384-token step and Gemma 3's heads of 256."""
    t, n, kv, d, dtype, gemma = case
    seed = int(np.random.default_rng().integers(2**31))
    qkv, (wq, wk), cos, sin = inputs(t, n, kv, d, dtype, seed)
    for first, heads, w in ((0, n, wq), (n, kv, wk)):
        kwargs = dict(first=first, heads=heads, eps=1e-6, unit_offset=gemma)
        got = triton.normed_rope(qkv, w, cos, sin, **kwargs)
        want = jax.jit(reference.normed_rope, static_argnames=tuple(kwargs))(
            qkv, w, cos, sin, **kwargs
        )
        assert_close(got, want, f"{seed=} {first=}")
