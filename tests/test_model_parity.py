"""The model against golden logits from Hugging Face transformers (PyTorch, fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import decoder
from jaxserve.models.batch import Batch, make_kv_cache_for
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.layers import fuse_projections
from jaxserve.models.loading.checkpoint_loader import load_weights
from tests.conftest import FAMILIES, fixture_dir

PAGE = 4


def one_sequence_batch(token_ids: list[int], start: int, pages: list[int], num_slots: int) -> Batch:
    """A batch of one sequence computing tokens[start:] with the first `start` cached."""
    n = len(token_ids) - start
    pos = np.arange(start, len(token_ids), dtype=np.int32)
    page_arr = np.asarray(pages, np.int32)
    return Batch(
        input_ids=jnp.asarray(token_ids[start:], jnp.int32),
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(page_arr[pos // PAGE] * PAGE + pos % PAGE),
        kv_lens=jnp.asarray([len(token_ids)], jnp.int32),
        page_indices=jnp.asarray(page_arr[None, :]),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([n - 1], jnp.int32),
    )


def run_chunks(
    family: str, token_ids: list[int], chunk: int | None, dtype=jnp.float32, fused=False
):
    """Logits for every token, computed in chunks over a shuffled page table; ``fused``: with
    the projections joined as the runner joins them on one device."""
    config = load_model_config(fixture_dir(family))
    weights = load_weights(fixture_dir(family), config, dtype)
    if fused:
        weights = fuse_projections(weights)
        if config.mla is None:  # (MLA has no q, k, v projections of one input to join)
            assert all(layer.fused is not None and layer.wq is None for layer in weights.layers)
    num_pages = 32
    cache = make_kv_cache_for(config, num_pages, PAGE, dtype)
    rng = np.random.default_rng(0)
    pages = rng.permutation(num_pages)[: -(-len(token_ids) // PAGE)].tolist()
    forward = jax.jit(decoder.forward, static_argnums=(3,))
    chunk = chunk or len(token_ids)
    logits = []
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        batch = one_sequence_batch(token_ids[:end], start, pages, num_pages * PAGE)
        cache, hidden = forward(weights, cache, batch, config)
        logits.append(
            np.asarray(decoder.compute_logits(weights, hidden, config.final_logit_softcap))
        )
    return np.concatenate(logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_hf(family: str) -> None:
    golden = np.load(fixture_dir(family) / "golden.npz")
    logits = run_chunks(family, golden["prompt2_ids"].tolist(), chunk=None)
    np.testing.assert_allclose(logits, golden["prefill2_logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_match_hf(family: str) -> None:
    """q/k/v as one GEMM and gate/up as another (the dense MLPs; experts stay as they are)
    compute what the separate projections do."""
    golden = np.load(fixture_dir(family) / "golden.npz")
    logits = run_chunks(family, golden["prompt2_ids"].tolist(), chunk=7, fused=True)
    np.testing.assert_allclose(logits, golden["prefill2_logits"], atol=1e-4, rtol=1e-4)


def test_the_runner_fuses_plain_and_per_channel_weights_on_one_device(tmp_path) -> None:
    """q/k/v and gate/up joined for bf16 and per-channel int8 weights; an AWQ checkpoint's
    packed 4-bit groups stay apart."""
    from jaxserve import LLM
    from tests.test_quantized_checkpoints import make_quantized_module

    awq = make_quantized_module.make_quantized(fixture_dir("llama"), tmp_path / "awq", "awq", 32)
    for model, quantization, fused in (
        (fixture_dir("llama"), None, True),
        (fixture_dir("llama"), "int8", True),
        (awq, None, False),
    ):
        llm = LLM(str(model), quantization=quantization, max_model_len=64)
        layers = llm.engine.runner.weights.layers
        assert all((layer.fused is not None) == fused for layer in layers)
        assert all((layer.wq is None) == (layer.w_gate is None) == fused for layer in layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_prefill(family: str) -> None:
    golden = np.load(fixture_dir(family) / "golden.npz")
    ids = golden["prompt2_ids"].tolist()
    chunked = run_chunks(family, ids, chunk=7)  # chunks straddle page boundaries
    np.testing.assert_allclose(chunked, golden["prefill2_logits"], atol=1e-4, rtol=1e-4)


# NOTE: not mixtral: in bf16 one prompt token's 2nd and 3rd experts (of 4) swap places, a
# routing near-tie any bf16 engine may break either way, and its logits move by 1.8.
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_bf16_stays_close(family: str) -> None:
    """bf16 weights and cache: within 0.15 of the fp32 logits (scale ~3); argmax mostly equal."""
    golden = np.load(fixture_dir(family) / "golden.npz")
    logits = run_chunks(family, golden["prompt_ids"].tolist(), chunk=None, dtype=jnp.bfloat16)
    ref = golden["prefill_logits"]
    assert np.max(np.abs(logits - ref)) < 0.15 * max(1.0, np.max(np.abs(ref)) / 3)
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() > 0.8  # random weights: near ties


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_matches_hf(family: str) -> None:
    """Decode one token at a time through the cache: same tokens and logits as HF."""
    golden = np.load(fixture_dir(family) / "golden.npz")
    ids = golden["prompt_ids"].tolist()
    n = len(golden["greedy_ids"])
    all_ids = ids + golden["greedy_ids"].tolist()
    # Prefill the prompt, then feed the golden tokens back one by one.
    logits = run_chunks(family, all_ids[: len(ids) + n - 1], chunk=None)[len(ids) - 1 :]
    np.testing.assert_array_equal(logits.argmax(-1), golden["greedy_ids"])
    np.testing.assert_allclose(logits, golden["decode_logits"], atol=1e-4, rtol=1e-4)
    stepwise = run_chunks(family, all_ids[: len(ids) + 3], chunk=1)[len(ids) - 1 :]
    np.testing.assert_allclose(stepwise, golden["decode_logits"][:4], atol=1e-4, rtol=1e-4)
