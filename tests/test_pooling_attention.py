"""A decoder's pooling runner over whole prompts (``JAXSERVE_POOLING_ATTENTION=whole``): each
prompt attends to itself from its step's own keys and values, with no cache written or read.
The causal windows equal a dense reference on random inputs (grouped-query heads, sequences
across tile edges); the engine's embeddings equal sentence-transformers' goldens with every
prompt whole in one step; where the path cannot apply, ``whole`` is an error that says why and
``auto`` keeps the paged cache, each named in the start-up log; cuDNN's packed form (GPU) equals
the reference."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.encoder.forward import segment_ids
from jaxserve.runner.pooling_attention import POOLING_ATTENTION_ENV
from jaxserve.runner.segment_attention import windowed_segment_attention
from tests.test_embeddings import EMBEDDINGS, TOLERANCE, golden

# Whole prompts: the longest golden prompt (154 tokens) in one step, no prefix cache.
WHOLE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    block_size=4,
    num_gpu_blocks_override=512,
    enable_prefix_caching=False,
    warmup=False,
)


def causal_reference(q, k, v, segments, sm_scale):
    """Dense causal attention within segments, key heads repeated for the query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("TND,SND->NTS", q, k, preferred_element_type=jnp.float32) * sm_scale
    rows = jnp.arange(q.shape[0])
    mask = (segments[:, None] == segments[None, :]) & (rows[None, :] <= rows[:, None])
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("NTS,SND->TND", probs, v)


def ragged(seed: int, num_tokens: int, max_len: int, num_seqs: int):
    """Random lengths from 1 to ``max_len`` (padding tokens after them, and a padding sequence
    of length 0 when there are two or more): (cu_seq_lens, segments, tokens in sequences)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while len(lengths) < num_seqs - (num_seqs > 1):
        n = int(rng.integers(1, max_len + 1))
        if sum(lengths) + n > num_tokens - 8:
            break
        lengths.append(n)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu = np.concatenate([cu, [cu[-1]] * (num_seqs + 1 - len(cu))]).astype(np.int32)
    cu_seq_lens = jnp.asarray(cu)
    return cu_seq_lens, segment_ids(cu_seq_lens, num_tokens), sum(lengths)


def qkv(seed: int, num_tokens: int, heads: int, kv_heads: int, dtype=jnp.float32, dim=16):
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, kv_heads, dim)), dtype) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize(("num_tokens", "kv_heads"), [(48, 4), (256, 2), (256, 1)])
def test_causal_windows_equal_the_dense_reference(num_tokens: int, kv_heads: int) -> None:
    """One window (48 tokens) and many (256 tokens in tiles of 32), 4 query heads over 4, 2 or
    1 key heads: every sequence's rows equal the dense causal reference's."""
    seed = int(np.random.default_rng().integers(2**31))
    _, segments, real = ragged(seed, num_tokens, 32, 64)
    q, k, v = qkv(seed, num_tokens, 4, kv_heads)
    want = causal_reference(q, k, v, segments, 0.25)
    got = windowed_segment_attention(q, k, v, segments, 0.25, tile=32, causal=True)
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-5, atol=1e-5, err_msg=f"{seed=}")
    bidirectional = windowed_segment_attention(q, k, v, segments, 0.25, tile=32)
    assert not np.allclose(bidirectional[:real], want[:real], atol=1e-3)  # the mask matters


def make_llm(name: str, monkeypatch, choice: str, **overrides):
    import jaxserve

    monkeypatch.setenv(POOLING_ATTENTION_ENV, choice)
    return jaxserve.LLM(str(EMBEDDINGS / name), runner="pooling", **{**WHOLE, **overrides})


@pytest.mark.parametrize("name", ["qwen3_last", "mistral_mean", "llama_cls"])
def test_whole_prompts_embed_as_sentence_transformers(name: str, monkeypatch, caplog) -> None:
    """Every prompt whole in one step (no chunk), nothing written to the cache (it stays as
    allocated: zeros), the vectors sentence-transformers' within the goldens' tolerance."""
    g = golden(name)
    texts = [str(t) for t in g["texts"]]
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.runner"):
        llm = make_llm(name, monkeypatch, "whole")
    assert "Pooling attention: whole prompts, no cache (XLA, windows;" in caplog.text
    assert not llm.engine.scheduler.enable_chunked_prefill
    steps = llm.engine.num_steps
    outputs = llm.embed(texts, use_tqdm=False)
    assert llm.engine.num_steps - steps == 1  # all of them whole, in one step
    got = np.array([o.outputs.embedding for o in outputs])
    np.testing.assert_allclose(got, g["embeddings"], atol=TOLERANCE)
    assert not any(np.asarray(a).any() for a in jax.tree.leaves(llm.engine.runner.kv_cache))
    llm.shutdown()


def test_auto_keeps_the_paged_cache_and_whole_says_why_it_cannot_apply(monkeypatch, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.runner"):
        llm = make_llm("qwen3_last", monkeypatch, "auto")
    assert (
        "Pooling attention: the paged KV cache (ask for whole prompts with "
        "JAXSERVE_POOLING_ATTENTION=whole)" in caplog.text
    )
    assert llm.engine.runner.whole_prompts is None and llm.engine.scheduler.enable_chunked_prefill
    llm.shutdown()
    with pytest.raises(ValueError, match="=whole: prefix caching is on"):
        make_llm("qwen3_last", monkeypatch, "whole", enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=128 is less than max_model_len"):
        make_llm("qwen3_last", monkeypatch, "whole", max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="=whole: batch-invariant mode"):
        make_llm("qwen3_last", monkeypatch, "whole", batch_invariant=True)


def test_a_generating_runner_never_takes_whole_prompts(monkeypatch) -> None:
    import jaxserve
    from jaxserve.runner.pooling_attention import why_not_whole
    from tests.conftest import fixture_dir

    monkeypatch.setenv(POOLING_ATTENTION_ENV, "whole")
    llm = jaxserve.LLM(str(fixture_dir("llama")), **{**WHOLE, "max_model_len": 128})
    assert llm.engine.runner.whole_prompts is None
    config = llm.engine.config
    assert "only a pooling runner" in str(why_not_whole(llm.engine.model_config, config, 128, None))
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
@pytest.mark.parametrize(
    ("num_tokens", "num_seqs", "max_len", "kv_heads"),
    [(64, 1, 64, 8), (256, 8, 64, 2), (1024, 64, 64, 8), (16384, 256, 512, 8)],
)
@pytest.mark.parametrize("zero_padding", [True, False])
def test_cudnn_packed_causal_attention_equals_the_reference(
    num_tokens, num_seqs, max_len, kv_heads, zero_padding
) -> None:
    """cuDNN over packed sequences with the causal mask, Qwen3-0.6B's heads (16 over 8, and
    over 2): each sequence's rows equal the dense causal reference's; padding rows are zeros
    unless the caller leaves them (the pooling runner's ``causal_prompt_attention``)."""
    from jaxserve.runner.segment_attention import packed_segment_attention

    seed = int(np.random.default_rng().integers(2**31))
    cu_seq_lens, segments, real = ragged(seed, num_tokens, max_len, num_seqs)
    q, k, v = qkv(seed, num_tokens, 16, kv_heads, jnp.bfloat16, dim=128)
    want = per_sequence_reference(q, k, v, np.asarray(cu_seq_lens), max_len, 0.125)
    attend = functools.partial(
        packed_segment_attention, cu_seq_lens=cu_seq_lens, causal=True, zero_padding=zero_padding
    )
    got = np.asarray(jax.jit(attend, static_argnums=4)(q, k, v, segments, 0.125), np.float32)
    cu = np.asarray(cu_seq_lens)
    wrong = [  # (sequence, start, length, largest error) of each sequence off the reference
        (i, int(a), int(b - a), float(np.abs(got[a:b] - want[a:b]).max()))
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True))
        if b > a and not np.allclose(got[a:b], want[a:b], atol=2e-2)
    ]
    assert not wrong, f"{seed=}: {len(wrong)} of {num_seqs} sequences differ: {wrong[:8]}"
    if zero_padding:
        assert not got[real:].any(), "padding rows are zeros"


def per_sequence_reference(q, k, v, cu: np.ndarray, max_len: int, sm_scale: float) -> np.ndarray:
    """``causal_reference`` of each sequence alone, all at once: each gathered into a row of
    ``max_len`` (a dense [T, T] reference over 16,384 tokens takes 16 GiB), f32 [T, N, D]."""
    starts, lens = cu[:-1], np.diff(cu)
    pos = np.arange(max_len)
    rows = np.minimum(starts[:, None] + pos[None], q.shape[0] - 1)  # [S, L]
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = (x[rows].astype(jnp.float32) for x in (q, k, v))  # [S, L, N|K, D]
    ks, vs = jnp.repeat(ks, group, axis=2), jnp.repeat(vs, group, axis=2)
    scores = jnp.einsum("SLND,SMND->SNLM", qs, ks) * sm_scale
    mask = (pos[None, :] <= pos[:, None])[None] & (pos < lens[:, None])[:, None, :]  # [S, L, M]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    out = np.asarray(jnp.einsum("SNLM,SMND->SLND", probs, vs))
    want = np.zeros(q.shape, np.float32)
    for i, (start, n) in enumerate(zip(starts, lens, strict=True)):
        want[start : start + n] = out[i, :n]
    return want


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
def test_cudnn_whole_prompts_embed_as_the_paged_path(monkeypatch) -> None:
    """bf16 through the runner, warm-up on: whole prompts on cuDNN's packed form against the
    paged kernel, prompts of mixed lengths in one step."""
    texts = [[5 + (i * 7 + j) % 100 for j in range(1 + (i * 13) % 150)] for i in range(24)]
    embeddings = {}
    for choice in ("whole", "paged"):
        llm = make_llm("qwen3_last", monkeypatch, choice, dtype="bfloat16", warmup=True)
        embeddings[choice] = np.array([o.outputs.embedding for o in llm.embed(texts)])
        llm.shutdown()
    np.testing.assert_allclose(embeddings["whole"], embeddings["paged"], atol=3e-2)
