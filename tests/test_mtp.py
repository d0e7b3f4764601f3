"""DeepSeek-V3's MTP layers (``models/mtp.py``, ``loading/mtp_checkpoint.py``) and the ``mtp``
speculative method (``runner/mtp_proposer.py``) on ``tests/fixtures/spec/deepseek_v3_mtp`` (the
DeepSeek-V3 fixture with one random MTP layer, ``scripts/make_mtp_fixture.py``): the layer's
tensors read on request and left by default, ``mtp_step``'s shapes, greedy tokens the same with
and without ``mtp`` in a mixed batch with chunked prefill, and counters that add up."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.config import read_config_json
from jaxserve.models.batch import Batch
from jaxserve.models.families.registry import model_config_from_dict
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.mtp_checkpoint import load_mtp, num_mtp_layers
from jaxserve.models.mtp import make_mtp_kv_cache, mtp_step

MTP_DIR = Path(__file__).parent / "fixtures" / "spec" / "deepseek_v3_mtp"
PROMPTS = [
    [0, 5, 17, 33, 99, 120, 7, 8, 9, 44, 45, 46, 47, 48, 200, 201, 11],
    [0, 30, 31, 32],
    [0, 250, 3, 250, 3, 250, 3, 250, 3, 61, 62],
    [0, 12],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    config = model_config_from_dict(read_config_json(MTP_DIR / "config.json"))
    weights = load_weights(MTP_DIR, config, jnp.float32)
    return config, weights


def test_the_target_loader_leaves_the_mtp_tensors_with_an_info_line(caplog) -> None:
    config = model_config_from_dict(read_config_json(MTP_DIR / "config.json"))
    with caplog.at_level(logging.INFO):
        weights = load_weights(MTP_DIR, config, jnp.float32)
    assert len(weights.layers) == config.num_layers == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("tensor(s) of MTP layers (model.layers.3" in r.getMessage() for r in caplog.records)


def test_mtp_layers_load_on_request_with_their_names_and_shapes(loaded) -> None:
    config, weights = loaded
    assert num_mtp_layers(MTP_DIR) == 1
    (layer,) = load_mtp(MTP_DIR, config, weights, jnp.float32)
    h, v = config.hidden_size, config.vocab_size
    assert layer.eh_proj.shape == (2 * h, h)
    assert layer.enorm.shape == layer.hnorm.shape == layer.head_norm.shape == (h,)
    assert layer.lm_head.shape == (h, v)
    assert layer.embed is not None and layer.embed.shape == weights.embed.shape
    # The decoder layer has the target's experts layer's fields and shapes.
    target_last = weights.layers[-1]
    assert layer.layer.router is not None and layer.layer.wkv_a is not None
    for name in ("wq_a", "wq_b", "wkv_a", "wk_pe", "w_kv_b", "wo", "router", "experts_gate"):
        assert getattr(layer.layer, name).shape == getattr(target_last, name).shape, name
    # shared_head.head is the checkpoint's (random), not the target's lm_head.
    assert not np.allclose(layer.lm_head, weights.lm_head)


def test_mtp_step_gives_logits_and_hidden_rows(loaded) -> None:
    config, weights = loaded
    (layer,) = load_mtp(MTP_DIR, config, weights, jnp.float32)
    pages = make_mtp_kv_cache(config, 1, 4, 4, jnp.float32)[0]
    t = 5
    batch = Batch(
        input_ids=jnp.asarray([5, 6, 7, 8, 0], jnp.int32),
        positions=jnp.asarray([0, 1, 2, 3, 0], jnp.int32),
        slot_mapping=jnp.asarray([0, 1, 2, 3, 16], jnp.int32),
        kv_lens=jnp.asarray([4, 0], jnp.int32),
        page_indices=jnp.zeros((2, 4), jnp.int32),
        cu_q_lens=jnp.asarray([0, 4, 4], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([3, 3], jnp.int32),
    )
    hidden = jnp.ones((t, config.hidden_size), jnp.float32)
    new_pages, logits, out = mtp_step(layer, pages, batch, hidden, config)
    assert logits.shape == (2, config.vocab_size) and logits.dtype == jnp.float32
    assert out.shape == (t, config.hidden_size)
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert not np.allclose(new_pages[0][0, :4], 0)  # the latent written at slots 0..3


def make_llm(spec: dict | None = None, **overrides) -> jaxserve.LLM:
    settings = dict(
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=8,
        num_gpu_blocks_override=40,
        dtype="float32",
        warmup=False,
    )
    return jaxserve.LLM(str(MTP_DIR), speculative_config=spec, **{**settings, **overrides})


def token_ids(llm: jaxserve.LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return token_ids(make_llm())


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_are_the_same_with_mtp_and_the_counters_add_up(plain, k) -> None:
    """Four prompts under a budget of 16 tokens a step (chunked prefill beside verify steps);
    k = 3 chains the one MTP layer three times."""
    llm = make_llm({"method": "mtp", "num_speculative_tokens": k, "pause_when_unpaid": False})
    assert token_ids(llm) == plain
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_draft_tokens <= k * stats.num_drafts
    per_pos = stats.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


def test_a_prefix_the_cache_served_is_run_again_for_the_mtp_layers(plain) -> None:
    """The prompts a second time: the prefix cache serves their first blocks, which the
    target's steps then never compute, so the drafter runs the target again over them (on the
    runner's latent cache, writing nothing) and the tokens are still the same. (A budget
    that holds every sequence's step: at 16 tokens four sequences verifying two drafts each
    leave one out of a step now and then, whose next drafts also need the target again.)"""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "pause_when_unpaid": False}
    llm = make_llm(spec, max_num_batched_tokens=32)
    assert token_ids(llm) == plain
    assert llm.engine.proposer.recomputed_tokens == 0  # every state from the target's steps
    assert token_ids(llm) == plain
    assert llm.engine.proposer.recomputed_tokens > 0


def test_the_mtp_drafters_memory_leaves_out_the_targets_arrays_it_reads() -> None:
    """An MTP layer reads the target's embedding (and its lm_head where the layer has no
    head): what the drafter takes out of the KV cache's budget counts its own arrays, its
    pages and the states kept for it, not the target's arrays a second time."""
    llm = make_llm({"method": "mtp", "num_speculative_tokens": 1})
    runner, proposer = llm.engine.runner, llm.engine.proposer
    target = {id(x) for x in jax.tree.leaves(runner.weights)}
    leaves = jax.tree.leaves(proposer.arrays())
    assert any(id(x) in target for x in leaves)  # the embedding at least
    own = sum(x.nbytes for x in leaves if id(x) not in target)
    assert proposer.device_bytes(runner.weights) == own + proposer.kept_bytes()
    assert proposer.kept_bytes() == 2 * runner.buckets.token_buckets[-1] * proposer.state_dim * 4


def test_capacity_plans_the_mtp_drafter_the_engine_measures(capsys) -> None:
    """``jaxserve capacity --speculative-config '{"method": "mtp"}'`` plans the MTP layers'
    own weights (not the target's embedding and lm_head they read), their latent pages and the
    states kept for them as the engine measures them once loaded; the KV blocks agree."""
    import argparse
    import json

    from jaxserve.bench.capacity import add_capacity_arguments, run_capacity

    memory = 256 * 1024**2
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    engine = jaxserve.LLM(
        str(MTP_DIR), speculative_config=spec, max_model_len=64, max_num_seqs=4,
        max_num_batched_tokens=16, block_size=8, dtype="bfloat16", warmup=False,
        device_memory_bytes=memory,
    ).engine  # fmt: skip
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    argv = [
        str(MTP_DIR), "--max-model-len", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "16", "--block-size", "8", "--dtype", "bfloat16",
        "--device-memory", str(memory), "--speculative-config", json.dumps(spec), "--json",
    ]  # fmt: skip
    assert run_capacity(parser.parse_args(argv)) == 0
    out = json.loads(capsys.readouterr().out)
    measured = engine.proposer.device_bytes(engine.runner.weights)
    assert out["drafter_bytes"] == measured == engine.runner.capacity.drafter_bytes > 0
    assert out["num_blocks"] == engine.kv.num_blocks


def test_mtp_drafts_ahead_of_the_host_with_the_same_tokens_and_acceptance(
    plain, monkeypatch
) -> None:
    """``JAXSERVE_DRAFT_AHEAD=1`` (``TargetStatesDrafter.draft_ahead``): the MTP layers' next
    call queued behind each verify step; the tokens, drafts and accepted tokens are those of
    drafting after the host reads the step, and steps take the calls drafted ahead."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.setenv(ASYNC_VERIFY_ENV, "0")  # every verify step read back before the next
    spec = {"method": "mtp", "num_speculative_tokens": 3, "pause_when_unpaid": False}
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(DRAFT_AHEAD_ENV, flag)
        llm = make_llm(spec, max_num_seqs=1)  # one sequence a step: every step can draft ahead
        stats = llm.engine.spec_stats
        runs[flag] = (token_ids(llm), stats.num_drafts, stats.num_accepted_tokens)
        taken = llm.engine.proposer.ahead_taken
        assert taken > 0 if flag == "1" else taken == 0
    assert runs["0"] == runs["1"]
    assert runs["1"][0] == plain


def test_mtp_verify_steps_scheduled_ahead_give_the_same_tokens(plain, monkeypatch) -> None:
    """The default (``JAXSERVE_ASYNC_VERIFY``): the next verify step is dispatched before the
    last one is read back, the MTP layers' call made behind the last (moved on the device with
    it), and the tokens are the plain ones."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.delenv(DRAFT_AHEAD_ENV, raising=False)
    monkeypatch.delenv(ASYNC_VERIFY_ENV, raising=False)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "pause_when_unpaid": False}
    llm = make_llm(spec, max_num_seqs=1)
    assert token_ids(llm) == plain
    assert llm.engine.num_verified_ahead > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
