"""Prompt logprobs of a long step: computed in chunks, so their peak memory stays inside the
headroom the capacity plan reserves (one pass over 2,048 positions of a 128k vocabulary took
2.9 GiB on the H200 and the engine died of it), and equal to one pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.layers import Weights
from jaxserve.runner import capacity, programs, sampling
from jaxserve.runner.programs import prompt_logprobs_step


@pytest.mark.parametrize("num_tokens", [8, 20, 32])
def test_chunked_prompt_logprobs_equal_one_pass(monkeypatch, num_tokens) -> None:
    monkeypatch.setattr(programs, "PROMPT_LOGPROBS_CHUNK", 8)  # 20 positions: a padded chunk
    keys = jax.random.split(jax.random.key(num_tokens), 3)
    head = jax.random.normal(keys[0], (97, 16), jnp.float32)  # tied: [V, D]
    hidden = jax.random.normal(keys[1], (num_tokens, 16), jnp.float32)
    next_ids = jax.random.randint(keys[2], (num_tokens,), 0, 97)
    chunked = prompt_logprobs_step(head, hidden, next_ids, tied=True)
    weights = Weights(embed=head, layers=[], final_norm=None, lm_head=None)  # type: ignore[arg-type]
    whole = sampling.prompt_logprobs(
        decoder.compute_logits(weights, hidden), next_ids, sampling.NUM_TOP_LOGPROBS
    )
    for got, want in zip(chunked, whole, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def lowered(num_tokens: int, vocab: int):
    # A new function each time: jit's trace cache would not see a patched chunk size.
    fn = jax.jit(lambda *args, **kw: prompt_logprobs_step(*args, **kw), static_argnames="tied")
    return fn.lower(
        jax.ShapeDtypeStruct((vocab, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
        tied=True,
    )


def test_no_logits_larger_than_one_chunk_are_made(monkeypatch) -> None:
    vocab = 128_256  # Llama-3's vocabulary
    text = lowered(2048, vocab).as_text()
    assert f"tensor<{programs.PROMPT_LOGPROBS_CHUNK}x{vocab}xf32>" in text
    assert f"tensor<2048x{vocab}xf32>" not in text
    monkeypatch.setattr(programs, "PROMPT_LOGPROBS_CHUNK", 2048)  # one pass: the whole step
    assert f"tensor<2048x{vocab}xf32>" in lowered(2048, vocab).as_text()


def temp_bytes(num_tokens: int, vocab: int) -> int:
    return lowered(num_tokens, vocab).compile().memory_analysis().temp_size_in_bytes


def test_prompt_logprobs_memory_is_that_of_one_chunk_however_long_the_step(monkeypatch) -> None:
    vocab = 128_256
    one_chunk = temp_bytes(programs.PROMPT_LOGPROBS_CHUNK, vocab)
    assert one_chunk <= programs.PROMPT_LOGPROBS_CHUNK * vocab * 4 * 8  # what capacity reserves
    assert temp_bytes(2048, vocab) <= 1.5 * one_chunk
    monkeypatch.setattr(programs, "PROMPT_LOGPROBS_CHUNK", 2048)  # one pass: 8x on CPU
    assert temp_bytes(2048, vocab) > 4 * one_chunk


def test_the_activation_reserve_covers_a_chunk_of_prompt_logprobs() -> None:
    config = ModelConfig(
        model_type="llama",
        vocab_size=128_256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_q_heads=4,
        num_kv_heads=4,
        head_dim=16,
    )
    reserve = capacity.activation_bytes(config, 2048, 8, 2, 141 * 10**9)
    fewer_rows = capacity.activation_bytes(config, 2048, 1, 2, 141 * 10**9)
    assert reserve == fewer_rows  # the chunk's rows, not the 8 sequences, set the size
    assert reserve >= programs.PROMPT_LOGPROBS_CHUNK * 128_256 * 4 * 8
