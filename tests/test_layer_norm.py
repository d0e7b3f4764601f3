"""The residual add and LayerNorm kernel (``pallas_kernels/layer_norm``): the kernel against its
reference and the encoder's ``layer_norm(x + residual)`` on fresh random inputs (Pallas
interpret mode on the CPU, natively under ``pytest -m gpu``), its refusals, the switch (off by
default), and the BERT fixture's embeddings on it equal to XLA's path's."""

from __future__ import annotations

import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve.models.encoder.forward import layer_norm
from pallas_kernels.layer_norm import dispatch, reference, triton

CASES = [(16, 32, "bfloat16"), (64, 1024, "bfloat16"), (32, 256, "float32"), (16, 8192, "float16")]


def inputs(t: int, h: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(2 * rng.standard_normal((t, h)) + 0.5, dtype)
    residual = jnp.asarray(rng.standard_normal((t, h)), dtype)
    scale = jnp.asarray(1 + 0.3 * rng.standard_normal(h), dtype)
    bias = jnp.asarray(0.2 * rng.standard_normal(h), dtype)
    return x, residual, scale, bias


def assert_close(got: jax.Array, want: jax.Array, message: str) -> None:
    """Within two ulps of the output's dtype at each value's size: the kernel and XLA sum the
    rows' float32 values in other orders."""
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = float(jnp.finfo(got.dtype).eps)
    bound = 2 * eps * np.maximum(np.abs(want32), 1.0) + (1e-5 if got.dtype == jnp.float32 else 0)
    assert np.all(np.abs(got32 - want32) <= bound), message


@pytest.mark.parametrize("case", CASES, ids=str)
def test_interpret_matches_the_reference_and_the_encoders_path(case) -> None:
    t, h, dtype = case
    seed = int(np.random.default_rng().integers(2**31))
    x, residual, scale, bias = inputs(t, h, dtype, seed)
    got = triton.add_layer_norm(x, residual, scale, bias, eps=1e-12, interpret=True)
    want = reference.add_layer_norm(x, residual, scale, bias, eps=1e-12)
    norm = types.SimpleNamespace(scale=scale, bias=bias)
    encoder = layer_norm(x + residual, norm, 1e-12)  # type: ignore[arg-type]
    assert got.shape == (t, h) and got.dtype == x.dtype
    assert_close(got, want, f"{seed=}")
    assert_close(want, encoder, f"{seed=}: the reference is the encoder's")


def test_rows_a_program_and_the_refusals() -> None:
    assert [triton.rows_per_program(h) for h in (32, 1024, 4096, 8192)] == [16, 8, 2, 1]
    bf16 = jnp.bfloat16
    x = jax.ShapeDtypeStruct((64, 1024), bf16)
    assert triton.unsupported_reason(x, x) is None
    for shape, why in [((64, 768), "power of two"), ((12, 1024), "multiple of 8"),
                       ((64, 16384), "power of two in [32, 8192]")]:  # fmt: skip
        odd = jax.ShapeDtypeStruct(shape, bf16)
        assert why in (triton.unsupported_reason(odd, odd) or ""), shape
    assert "residual" in (
        triton.unsupported_reason(x, jax.ShapeDtypeStruct((64, 1024), "f4")) or ""
    )
    ints = jax.ShapeDtypeStruct((64, 1024), jnp.int32)
    assert "dtype int32" in (triton.unsupported_reason(ints, ints) or "")
    with pytest.raises(ValueError, match="hidden size 768"):
        y = jnp.zeros((16, 768), bf16)
        triton.add_layer_norm(y, y, y[0], y[0], eps=1e-5, interpret=True)


def test_the_switch_is_auto_by_default(monkeypatch) -> None:
    """``auto`` (the default): XLA's fusion on the CPU, the kernel on one GPU; ``off`` never;
    ``on`` wherever the shapes fit."""
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
    monkeypatch.delenv("JAXSERVE_LAYER_NORM", raising=False)
    assert dispatch.requested() == "auto" and dispatch.takes(x, x) is None  # the CPU
    monkeypatch.setenv("JAXSERVE_LAYER_NORM", "off")
    assert dispatch.takes(x, x) is None
    assert dispatch.describe() == (
        "Residual add and LayerNorm: XLA's fusions (JAXSERVE_LAYER_NORM=off)"
    )
    monkeypatch.setenv("JAXSERVE_LAYER_NORM", "on")
    odd = jax.ShapeDtypeStruct((2048, 768), jnp.bfloat16)
    assert dispatch.takes(x, x) == "interpret" and dispatch.takes(odd, odd) is None
    assert "Pallas Triton kernel in interpret mode" in dispatch.describe()
    monkeypatch.setenv("JAXSERVE_LAYER_NORM", "auto")
    assert dispatch.takes(x, x) is None  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.takes(x, x) == "triton"
    monkeypatch.setenv("JAXSERVE_LAYER_NORM", "fast")
    with pytest.raises(ValueError, match="JAXSERVE_LAYER_NORM"):
        dispatch.choose()


def test_the_bert_fixture_on_the_kernel_embeds_as_xlas_path(monkeypatch, caplog) -> None:
    """The BERT fixture (hidden 32) with the switch on: both norms of every layer on the kernel
    (interpret mode), the embeddings those of XLA's path, and the start-up log names it."""
    bert = str(Path(__file__).parent / "fixtures" / "encoders" / "bert_embed")
    settings = dict(runner="pooling", max_model_len=64, max_num_batched_tokens=64, warmup=False)
    texts = ["the kernel adds and norms", "in one pass", "over every row of the step"]
    llm = jaxserve.LLM(bert, **settings)
    want = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    llm.shutdown()
    monkeypatch.setenv("JAXSERVE_LAYER_NORM", "on")
    calls = []
    kernel = triton.add_layer_norm
    monkeypatch.setattr(
        triton, "add_layer_norm", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k)
    )
    caplog.set_level("INFO", logger="jaxserve.runner.encoder_runner")
    llm = jaxserve.LLM(bert, **settings)
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    llm.shutdown()
    assert len(calls) == 4  # two layers, two norms each (traced once)
    np.testing.assert_allclose(got, want, atol=2e-2)
    assert any(m.startswith("Residual add and LayerNorm: one pass") for m in caplog.messages)


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", [*CASES, (16384, 1024, "bfloat16")], ids=str)
def test_native_matches_the_reference(case) -> None:
    """Natively, also at BGE-large's 16,384-token step."""
    t, h, dtype = case
    seed = int(np.random.default_rng().integers(2**31))
    x, residual, scale, bias = inputs(t, h, dtype, seed)
    got = triton.add_layer_norm(x, residual, scale, bias, eps=1e-12)
    want = jax.jit(reference.add_layer_norm, static_argnames="eps")(
        x, residual, scale, bias, eps=1e-12
    )
    assert_close(got, want, f"{seed=}")
