"""Speculative decoding (docs/speculative_decoding.md): the configuration, the n-gram drafter,
verification in the ragged step, lossless sampling, structured outputs, stops, preemption, the
prefix cache after rejections and the counters, on the tiny llama fixture."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.engine.spec_decode import NgramProposer, SpecDecodeStats, accepted_run
from jaxserve.engine_config import EngineConfig, SpeculativeConfig
from jaxserve.runner import sampling
from jaxserve.sampling_params import StructuredOutputsParams
from tests.conftest import fixture_dir

# (drafting never pauses here: the tiny random model accepts few drafts, and these tests
# check the verify steps themselves; ``test_drafting_that_does_not_pay_pauses`` checks pauses)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "pause_when_unpaid": False,
}
# Prompts that repeat themselves, so the drafter finds n-grams; the tiny random model's greedy
# output also falls into loops, which it drafts from.
PROMPTS = [
    [0, 5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9],
    [0, 17, 3, 17, 3, 17, 3],
    [0, 40, 41, 42, 43, 40, 41, 42, 43],
    [0, 99],
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def make_llm(spec: dict | None = None, **overrides) -> jaxserve.LLM:
    settings = dict(
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        num_gpu_blocks_override=128,
        dtype="float32",
        warmup=False,
    )
    settings.update(overrides)
    return jaxserve.LLM(str(fixture_dir("llama")), speculative_config=spec, **settings)


@pytest.fixture(scope="module")
def plain() -> jaxserve.LLM:
    return make_llm()


@pytest.fixture(scope="module")
def spec() -> jaxserve.LLM:
    return make_llm(NGRAM)


def generate(llm: jaxserve.LLM, prompts, params: SamplingParams) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def token_ids(llm: jaxserve.LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in generate(llm, prompts, params)]


# -- configuration -----------------------------------------------------------------------


def test_the_config_is_vllms_and_its_errors_name_the_field() -> None:
    config = SpeculativeConfig.of(json.dumps(NGRAM))
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min) == (
        "ngram",
        3,
        1,
    )
    assert EngineConfig(speculative_config=NGRAM).speculative_config == config
    assert config.max_batch_size == 32  # disable_by_batch_size's default
    for bad, words in (
        ({"method": "medusa"}, "method='medusa' must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be in [1, 15]"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max=2 must be >="),
        ({"speculative_tokens": 3}, "has no field 'speculative_tokens'"),
        ({"num_speculative_tokens": "3"}, "num_speculative_tokens='3' has the wrong type"),
        ({"method": "eagle3"}, "method='eagle3' needs model"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size=0 must be >= 1"),
    ):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
            SpeculativeConfig.of(bad)


def test_mtp_on_a_model_without_mtp_layers_is_refused_at_start_naming_the_field() -> None:
    from jaxserve.config import ConfigError

    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0 or absent"):
        make_llm({"method": "mtp"})


def test_launch_reads_the_flag() -> None:
    import argparse

    from jaxserve.server.launch.flags import add_launch_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig(**NGRAM)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram", "k": 3}'])


# -- the drafter -------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_suffix_match() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], np.int32)
    # suffix [1, 2, 3] occurred at 0..2 (then 4, 9); [2, 3] also later at 5..6 (then 5, 7),
    # but the longest match wins
    assert proposer.propose_tokens(tokens, 2) == [4, 9]
    # the most recent occurrence of the longest match
    tokens = np.array([7, 8, 1, 7, 8, 2, 7, 8], np.int32)
    assert proposer.propose_tokens(tokens, 3) == [2, 7, 8]
    # nothing as long as min_n: no draft; the draft stops at the end of the tokens
    assert proposer.propose_tokens(np.array([1, 2, 3, 4, 3], np.int32), 3) == []
    assert proposer.propose_tokens(np.array([5, 6, 5, 6], np.int32), 4) == [5, 6]
    assert NgramProposer(1, 1).propose_tokens(np.array([4, 1, 4], np.int32), 2) == [1, 4]


def test_accepted_run_is_the_matching_prefix_then_the_targets_token() -> None:
    sampled = np.array([0, 5, 6, 9, 8, 0], np.int32)
    assert accepted_run([5, 6, 7], sampled, 1) == [5, 6, 9]
    assert accepted_run([5, 6, 9], sampled, 1) == [5, 6, 9, 8]
    assert accepted_run([4], sampled, 1) == [5]


# -- lossless ----------------------------------------------------------------------------


def test_greedy_tokens_are_the_same_with_ngram_in_a_mixed_batch(plain, spec) -> None:
    before = spec.engine.spec_stats.copy()
    assert token_ids(spec, PROMPTS) == token_ids(plain, PROMPTS)
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > before.num_accepted_tokens  # drafts were accepted


def test_greedy_with_chunked_prefill_beside_verify_steps(plain, spec) -> None:
    """A 60-token prompt arrives while two sequences decode: it prefills in chunks (a budget
    of 32) in the steps where they verify their drafts, and every token is unchanged."""
    long_prompt = [0] + [(7 * i) % 300 + 1 for i in range(59)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = spec.engine
    schedule, mixed = engine.scheduler.schedule, []

    def recording_schedule(drafts=None):
        sched = schedule(drafts)
        prefill = any(not i.completes_sequence for i in sched.scheduled)
        mixed.append(prefill and sched.has_drafts)
        return sched

    engine.scheduler.schedule = recording_schedule
    try:
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(f"chunked{i}", prompt, params)
        outputs: dict[str, list[int]] = {}
        added = False
        for _ in range(200):
            if not added and engine._propose()[0]:  # the coming step drafts: the prompt joins
                engine.add_request("chunked2", long_prompt, params)
                added = True
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if added and not engine.has_work():
                break
    finally:
        del engine.scheduler.schedule
    assert any(mixed), "no step verified drafts beside a chunked prefill"
    alone = token_ids(plain, [*PROMPTS[:2], long_prompt], params)
    assert [outputs[f"chunked{i}"] for i in range(3)] == alone


def test_greedy_under_preemption(plain) -> None:
    """A KV cache of 20 blocks of 4 tokens: sequences are preempted and resumed (their drafts
    dropped), and the tokens are unchanged."""
    small = make_llm(NGRAM, num_gpu_blocks_override=20, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert token_ids(small, PROMPTS, params) == token_ids(plain, PROMPTS, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.spec_stats.num_accepted_tokens > 0


def test_seeded_sampling_is_the_same_with_and_without_speculation(plain, spec) -> None:
    """Each position's token is drawn with the request's noise for that position, whether it
    is verified or decoded: a seeded request gives the same tokens (penalties, top-k/p too)."""
    for params in (
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            top_p=0.9,
            seed=3,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            max_tokens=24,
            ignore_eos=True,
            logprobs=2,
        ),
    ):
        a, b = generate(plain, PROMPTS, params), generate(spec, PROMPTS, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        if params.logprobs:  # the target's logprobs at each emitted position
            for x, y in zip(a, b, strict=True):
                for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)


def test_verification_keeps_the_target_distribution() -> None:
    """The sampler draws each position's token from the target p; the verify rule accepts
    draft d when the draw is d and emits the draw otherwise, which is the rejection sampler of
    a one-hot draft (accept with p(d), else sample p without d). Over 40,000 seeds the first
    emitted token follows p, and the bonus token after an accepted draft follows p at the next
    position: chi-square at p-value 1e-4, fixed seeds."""
    vocab, num = 8, 40_000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, vocab)) * 1.5, jnp.float32)
    draft = int(np.argsort(np.asarray(logits[0]))[-2])  # a likely draft, not the likeliest
    rows = jnp.repeat(logits, num, axis=0)  # rows [0, num): position 0; [num, 2 num): position 1
    inputs = sampling.SamplingInputs.padding(2 * num, vocab)
    seeds = np.tile(np.arange(num, dtype=np.uint32), 2)
    inputs.temperature = np.ones(2 * num, np.float32)
    inputs.seeds = seeds
    inputs.positions = np.repeat(np.array([10, 11], np.int32), num)
    inputs = jax.tree.map(jnp.asarray, inputs)
    out = np.asarray(sampling.sample(rows, inputs, sampling.SamplerFlags()).token_ids)
    runs = [accepted_run([draft], np.array([out[i], out[num + i]]), 0) for i in range(num)]
    p = np.asarray(jax.nn.softmax(logits, axis=-1))
    first = np.bincount([r[0] for r in runs], minlength=vocab)
    bonus = np.bincount([r[1] for r in runs if len(r) == 2], minlength=vocab)
    assert abs(first[draft] / num - p[0, draft]) < 0.02  # acceptance rate = p(d)
    for counts, probs in ((first, p[0]), (bonus, p[1])):
        expected = counts.sum() * probs
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 31.4, (chi2, counts, expected)  # chi-square(7) at p = 1e-4: 29.9


# -- structured outputs, stops -----------------------------------------------------------


def test_greedy_under_a_json_schema(plain, spec) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
    )
    prompts = [[0, 5, 9, 11, 5, 9, 11], [0, 17, 3, 17, 3]]
    expected = generate(plain, prompts, params)
    before = spec.engine.spec_stats.copy()
    got = generate(spec, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert spec.engine.spec_stats.num_drafts > before.num_drafts  # drafts were verified


def test_max_tokens_and_stop_strings_cut_inside_drafted_runs(plain, spec) -> None:
    """Every max_tokens from 1 to 24, and a stop string at each place of the output: the same
    tokens, text and finish as without speculation (some end inside an accepted run)."""
    prompt = [PROMPTS[1]]
    full = generate(plain, prompt, GREEDY)[0]
    for n in range(1, 25):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        got, want = generate(spec, prompt, params)[0], generate(plain, prompt, params)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    text = full.text
    for end in range(3, min(len(text), 60), 5):
        stop = text[end - 3 : end]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop])
        got, want = generate(spec, prompt, params)[0], generate(plain, prompt, params)[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )


# -- the KV and prefix cache, counters ---------------------------------------------------


def test_the_prefix_cache_after_rejections_holds_only_accepted_tokens(plain) -> None:
    """A request that verified (and rejected) drafts leaves its blocks in the prefix cache; a
    later request whose prompt is its prompt and output hits them and gets the tokens an
    engine without speculation gives."""
    llm = make_llm(NGRAM)
    first = token_ids(llm, [PROMPTS[0]])[0]
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some were rejected
    follow = PROMPTS[0] + first + [7]
    hits = llm.engine.kv.prefix_hits
    got = token_ids(llm, [follow])
    assert llm.engine.kv.prefix_hits - hits >= 8 * llm.engine.config.block_size
    assert got == token_ids(plain, [follow])


def test_draft_payoff_pauses_after_a_window_that_did_not_pay_and_doubles_each_pause() -> None:
    from jaxserve.engine import spec_decode as sd

    payoff, step = sd.DraftPayoff(), 0
    for _ in range(sd.PAYOFF_WINDOW - 1):  # 8 sequences, none accepted a draft
        step += 1
        assert not payoff.record(step, 8, 0) and payoff.may_draft(step)
    step += 1
    assert payoff.record(step, 8, 0)  # the window is full and gained nothing
    assert not payoff.may_draft(step + sd.PAYOFF_PAUSE_STEPS - 1)
    assert payoff.may_draft(step + sd.PAYOFF_PAUSE_STEPS)
    assert "pauses for 256 steps" in payoff.describe_pause(step) and "gained 0.000" in (
        payoff.describe_pause(step)
    )
    step += sd.PAYOFF_PAUSE_STEPS
    paused = [payoff.record(step + i, 8, 0) for i in range(sd.PAYOFF_WINDOW)]
    assert paused == [False] * (sd.PAYOFF_WINDOW - 1) + [True]
    assert payoff.pause_until - (step + sd.PAYOFF_WINDOW - 1) == 2 * sd.PAYOFF_PAUSE_STEPS
    # A window that pays (1 of 8 sequences accepts 1 draft a step: 0.125 >= 0.1) does not pause
    # and the next pause is short again.
    step = payoff.pause_until
    assert not any(payoff.record(step + i, 8, 1) for i in range(2 * sd.PAYOFF_WINDOW))
    assert not any(payoff.record(step + i, 0, 0) for i in range(100))  # no sequence asked
    # The window rolls: the 7th step in a row that gains nothing takes the mean under 0.1.
    step += 2 * sd.PAYOFF_WINDOW
    at = next(i for i in range(sd.PAYOFF_WINDOW) if payoff.record(step + i, 8, 0))
    assert at == 6  # 25 x 0.125 / 32 = 0.098
    assert payoff.pause_until - (step + at) == sd.PAYOFF_PAUSE_STEPS
    assert payoff.num_pauses == 3


def test_drafting_that_does_not_pay_pauses(plain, caplog) -> None:
    """The tiny random model accepts few prompt-lookup drafts: after a window of steps that
    could draft and did not pay, drafting pauses (logged once, steps run asynchronously
    meanwhile); the tokens are the same as without speculation. With
    ``pause_when_unpaid: false`` it drafts at every step that may."""
    import logging

    from jaxserve.engine import spec_decode as sd

    prompts = [[0, *[(37 * i + 11 * j) % 300 + 1 for i in range(12)]] for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    pausing = make_llm({**NGRAM, "pause_when_unpaid": True})
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.core"):
        got = token_ids(pausing, prompts, params)
    assert got == token_ids(plain, prompts, params)
    payoff = pausing.engine.draft_payoff
    assert payoff.num_pauses >= 1 and payoff.last_gain < sd.PAYOFF_MIN_GAIN
    assert caplog.text.count("Speculative decoding pauses for 256 steps") == 1
    drafted = pausing.engine.spec_stats.num_drafts
    always = make_llm(NGRAM)
    assert token_ids(always, prompts, params) == got
    assert always.engine.draft_payoff.num_pauses == 0
    assert always.engine.spec_stats.num_drafts > drafted  # it kept drafting


def test_counters_add_up_and_reach_the_stats(spec) -> None:
    stats = spec.engine.spec_stats.copy()
    engine_stats = spec.engine.stats
    assert engine_stats.spec_decode
    assert engine_stats.spec_num_drafts == stats.num_drafts > 0
    assert engine_stats.spec_num_accepted_tokens == sum(stats.accepted_per_pos)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= 3 * stats.num_drafts
    # acceptance per position can only fall: a draft's later token needs the earlier ones
    assert all(
        a >= b for a, b in zip(stats.accepted_per_pos[:-1], stats.accepted_per_pos[1:], strict=True)
    )
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    s = SpecDecodeStats()
    s.add(3, 2)
    s.add(2, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.accepted_per_pos == [1, 1, 0] and s.mean_acceptance_length == 2.0


def test_metrics_export_vllms_spec_decode_counters(spec) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxserve.server.metrics import EngineStatsCollector, StatsLogger

    class Client:
        config = spec.engine.config

        def stats(self):
            return spec.engine.stats

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(Client(), "m", ("vllm", "jaxserve")))
    text = generate_latest(registry).decode()
    stats = spec.engine.stats
    for prefix in ("vllm", "jaxserve"):
        assert f"{prefix}:spec_decode_num_drafts_total" in text
        assert f"{prefix}:spec_decode_num_draft_tokens_total" in text
        assert f"{prefix}:spec_decode_num_accepted_tokens_total" in text
    line = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {float(stats.spec_accepted_per_pos[0])}'  # noqa: E501
    assert line in text
    logger = StatsLogger(Client())
    token_ids(spec, PROMPTS[:1])
    assert "Mean acceptance length" in (logger.log() or "")


def test_adapters_verify_their_drafts_with_their_own_weights() -> None:
    """With LoRA, each drafted token runs under its sequence's adapter: the same greedy
    tokens, and peft's golden ones, with n-gram drafting on."""
    from tests.test_lora import NAMES, golden, lora

    llm = make_llm(NGRAM, enable_lora=True, max_loras=4, max_cpu_loras=8)
    g = golden(None)
    params = SamplingParams(temperature=0, max_tokens=len(g["greedy_ids"]), ignore_eos=True)
    loras = [lora(n) for n in NAMES[:2]] + [None]
    prompt = g["prompt_ids"].tolist()
    outs = llm.generate([prompt] * 3, params, lora_request=loras, use_tqdm=False)
    for out, name in zip(outs, [*NAMES[:2], None], strict=True):
        assert list(out.outputs[0].token_ids) == golden(name)["greedy_ids"].tolist(), name
    assert llm.engine.spec_stats.num_drafts > 0  # a step verified drafts under adapters
