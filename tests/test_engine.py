"""End to end through jaxserve.LLM with a real (tiny) model: batching, caching, preemption,
chunking and every sampling parameter."""

from __future__ import annotations

import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from tests.conftest import fixture_dir

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_llm(**overrides) -> jaxserve.LLM:
    settings = dict(
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        num_gpu_blocks_override=128,
        dtype="float32",
    )
    settings.update(overrides)
    return jaxserve.LLM(str(fixture_dir("llama")), **settings)


@pytest.fixture(scope="module")
def llm() -> jaxserve.LLM:
    return make_llm()


@pytest.fixture(scope="module")
def golden() -> dict:
    return dict(np.load(fixture_dir("llama") / "golden.npz"))


def ids(prompt) -> dict:
    return {"prompt_token_ids": [int(t) for t in prompt]}


PROMPTS = [[0, 5, 9, 11], [0, 17, 3], [0, 40, 41, 42, 43, 44, 45, 46, 47, 48], [0, 99]]


def test_greedy_matches_hf(llm, golden) -> None:
    out = llm.generate(ids(golden["prompt_ids"]), GREEDY)[0]
    assert out.outputs[0].token_ids == golden["greedy_ids"].tolist()


def test_batch_equals_each_prompt_alone(llm) -> None:
    batched = llm.generate([ids(p) for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate(ids(prompt), GREEDY)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_chunked_prefill_prompt_logprobs_match_hf(llm, golden) -> None:
    """A 56-token prompt runs in two chunks (budget 32); its prompt logprobs equal HF's."""
    prompt = golden["prompt2_ids"].tolist()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(ids(prompt), params)[0]
    logits = golden["prefill2_logits"]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    ref -= logits.max(-1, keepdims=True)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i][prompt[i]].logprob
        assert abs(got - ref[i - 1, prompt[i]]) < 1e-4
    assert out.outputs[0].token_ids == [int(logits[-1].argmax())]


def test_chunked_and_unchunked_prefill_agree(golden) -> None:
    prompt = golden["prompt2_ids"].tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    small = make_llm(max_num_batched_tokens=16).generate(ids(prompt), params)[0].outputs[0]
    big = make_llm(max_num_batched_tokens=64).generate(ids(prompt), params)[0].outputs[0]
    assert small.token_ids == big.token_ids
    np.testing.assert_allclose(
        [lp[t].logprob for lp, t in zip(small.logprobs, small.token_ids, strict=True)],
        [lp[t].logprob for lp, t in zip(big.logprobs, big.token_ids, strict=True)],
        atol=1e-4,
    )


def test_prefix_cache_hit_gives_identical_logprobs(llm) -> None:
    prompt = list(range(1, 30))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    miss = llm.generate(ids(prompt), params)[0]
    hit = llm.generate(ids(prompt), params)[0]
    assert miss.num_cached_tokens == 0 or miss.num_cached_tokens < hit.num_cached_tokens
    assert hit.num_cached_tokens == 28  # 7 full blocks of 4; the last token is recomputed
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    for a, b in zip(hit.outputs[0].logprobs, miss.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-5


def test_forced_preemption_keeps_greedy_output(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [ids([0] + [i + 7] * 9) for i in range(6)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = make_llm(num_gpu_blocks_override=32, enable_prefix_caching=False)  # 128 slots for 6x34
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    assert tight.engine.kv.pool.num_free == 32


def test_seed_is_independent_of_batchmates(llm) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate(ids(PROMPTS[0]), seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.5, top_k=5, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=12, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, presence_penalty=1.0, ignore_eos=True),
    ]
    batch = llm.generate(
        [ids(PROMPTS[1]), ids(PROMPTS[0]), ids(PROMPTS[2]), ids(PROMPTS[3])],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(ids(PROMPTS[0]), seeded)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate(ids(PROMPTS[0]), seeded.replace(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def sample_tokens(llm, params: SamplingParams, prompt=PROMPTS[0]) -> list[int]:
    return llm.generate(ids(prompt), params)[0].outputs[0].token_ids


def test_top_k_1_top_p_tiny_and_min_p_1_equal_greedy(llm) -> None:
    greedy = sample_tokens(llm, GREEDY)
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=3, **extra)
        assert sample_tokens(llm, params) == greedy, extra


def test_logit_bias_forces_a_token(llm) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, logit_bias={77: 100})
    assert sample_tokens(llm, params) == [77] * 5
    banned = sample_tokens(llm, GREEDY)[0]
    params = GREEDY.replace(logit_bias=((banned, -100.0),))
    assert sample_tokens(llm, params)[0] != banned


def test_penalties_change_greedy_choices(llm) -> None:
    base = sample_tokens(llm, GREEDY.replace(max_tokens=12))
    penalised = sample_tokens(llm, GREEDY.replace(max_tokens=12, frequency_penalty=2.0))
    assert len(set(penalised)) >= len(set(base))
    rep = sample_tokens(llm, GREEDY.replace(max_tokens=12, repetition_penalty=10.0))
    assert not set(rep) & set(PROMPTS[0]) or rep != base
    presence = sample_tokens(llm, GREEDY.replace(max_tokens=12, presence_penalty=2.0))
    assert presence != base or len(set(base)) == len(base)


def test_min_tokens_masks_eos(llm) -> None:
    eos = llm.engine.eos_token_ids[0]
    # Bias EOS up so it would win at once; min_tokens must hold it back for 4 tokens.
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 50})
    out = llm.generate(ids(PROMPTS[0]), params)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:4]


def test_logprobs_are_raw_log_softmax(llm, golden) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
    out = llm.generate(ids(golden["prompt_ids"]), params)[0].outputs[0]
    logits = golden["decode_logits"][0]
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = out.logprobs[0]
    assert len(first) == 5  # the chosen token is one of the top 5 here
    top5 = np.argsort(-ref)[:5]
    assert set(first) == set(int(t) for t in top5)
    for t, lp in first.items():
        assert abs(lp.logprob - ref[t]) < 1e-4
        assert lp.rank == int(np.sum(ref > ref[t])) + 1
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)), abs=1e-4
    )


def test_n_and_best_of(llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    out = llm.generate(ids(PROMPTS[2]), params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    best = SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    out = llm.generate(ids(PROMPTS[2]), best)[0]
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 6


def test_stop_string_cuts_text_and_chat_works(llm) -> None:
    full = llm.generate("Hello", GREEDY)[0].outputs[0].text
    assert full
    stop = full[2:4] if len(full) >= 4 else full[-1]
    cut = llm.generate("Hello", GREEDY.replace(stop=[stop]))[0].outputs[0]
    assert cut.text == full[: full.find(stop)] and cut.stop_reason == stop
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert chat.prompt_token_ids[0] == 0 and chat.prompt_token_ids.count(0) == 1  # one BOS
    assert len(chat.outputs[0].token_ids) == 8


def test_step_lowers_attention_once_for_all_layers(monkeypatch) -> None:
    """The model step traces the attention op once per bucket, not once per layer: a Mosaic GPU
    kernel costs about a second to lower, and an 8B model has 32 layers and 8 buckets."""
    import jax

    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner.runner import ModelRunner
    from pallas_kernels.ragged_paged_attention import dispatch, reference
    from tests.conftest import tiny_engine_config

    traces = []

    def counting_attention(*args, **kwargs):
        traces.append(args[0].shape)
        return reference.ragged_paged_attention(*args, **kwargs)

    monkeypatch.setattr(dispatch, "ragged_paged_attention", counting_attention)
    config = tiny_engine_config(
        "t", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, warmup=False
    )
    model_config = load_model_config(config.model)
    assert model_config.num_layers > 1
    runner = ModelRunner(model_config, config)
    for bucket in runner.buckets.token_buckets:
        runner.programs.lower_step(bucket)
    jax.clear_caches()
    assert len(traces) == len(runner.buckets.token_buckets)


def test_float32_steps_use_full_precision_matmuls() -> None:
    """XLA multiplies float32 in TF32 on GPUs unless asked: the float32 engine asks."""
    f32 = make_llm(warmup=True, max_num_seqs=4).engine.runner
    bf16 = make_llm(warmup=True, max_num_seqs=4, dtype="bfloat16").engine.runner
    assert "operand_precision={highest" in f32.programs.compiled_steps[16].as_text()
    assert "highest" not in bf16.programs.compiled_steps[16].as_text()


def test_compact_samplers_give_the_tokens_and_logprobs_of_the_specialized_ones() -> None:
    """--sampler-variants compact runs the variant that does everything where "all" runs one
    made for the request (each request alone, so "all" takes its own variant): same tokens,
    same logprobs."""
    requests = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.7),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, min_p=0.05),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12),
    ]
    prompt = {"prompt_token_ids": [5, 17, 40, 41]}
    results = {}
    for variants in ("all", "compact"):
        llm = make_llm(sampler_variants=variants)
        assert llm.engine.runner.inputs.compact_samplers == (variants == "compact")
        outs = [llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in requests]
        results[variants] = [(o.token_ids, o.logprobs) for o in outs]
        llm.engine.shutdown()
    for (all_ids, all_lps), (compact_ids, compact_lps) in zip(
        results["all"], results["compact"], strict=True
    ):
        assert all_ids == compact_ids
        assert all_lps == compact_lps


def test_generate_takes_one_whole_output_per_request(llm) -> None:
    """``LLM.generate`` asks the engine for final outputs only (no delta per step): the one
    output equals the deltas of the same request merged, text, tokens, logprobs, prompt
    logprobs and stop reason alike, for n = 2 and a stop string."""
    from jaxserve.engine.outputs import RequestOutput

    params = SamplingParams(
        temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=["e"]
    )
    core = llm.engine
    outputs: dict[str, list[RequestOutput]] = {"deltas": [], "final": []}
    core.add_request("deltas", PROMPTS[2], params)
    core.add_request("final", PROMPTS[2], params, final_only=True)
    while core.num_unfinished():
        for out in core.step():
            outputs[out.request_id].append(out)
    (final,) = outputs["final"]
    assert final.finished and len(outputs["deltas"]) > 1
    merged = outputs["deltas"][0]
    for delta in outputs["deltas"][1:]:
        merged.merge(delta)
    assert final.prompt_logprobs == merged.prompt_logprobs is not None
    for whole, parts in zip(final.outputs, merged.outputs, strict=True):
        assert (whole.text, whole.token_ids, whole.logprobs) == (
            parts.text,
            parts.token_ids,
            parts.logprobs,
        )
        assert (whole.finish_reason, whole.stop_reason) == (parts.finish_reason, parts.stop_reason)


def test_a_request_id_in_use_is_refused_queued_or_running(llm) -> None:
    """An id that is queued (not yet stepped) or running is refused with ``param="request_id"``;
    once the request ends its id is free again. Many queued requests are checked by a lookup,
    not a scan of the queue: 30,000 ids queue in about a second (the scan took half a minute)."""
    import time

    from jaxserve.engine.request_checks import RequestError

    core = llm.engine
    params = SamplingParams(max_tokens=2)
    core.add_request("same", PROMPTS[0], params)
    with pytest.raises(RequestError) as queued:
        core.add_request("same", PROMPTS[1], params)
    assert queued.value.param == "request_id"
    core.step()  # now running
    with pytest.raises(RequestError, match="'same' is in use"):
        core.add_request("same", PROMPTS[1], params)
    while core.num_unfinished():
        core.step()
    core.add_request("same", PROMPTS[1], params)  # ended: free again
    started = time.perf_counter()
    for i in range(30_000):
        core.add_request(f"many-{i}", PROMPTS[0], params)
    queued_s = time.perf_counter() - started
    for i in range(30_000):
        core.abort_request(f"many-{i}")
    while core.num_unfinished():
        core.step()
    assert queued_s < 5, f"30,000 requests took {queued_s:.1f} s to queue"


def test_the_engine_freezes_its_start_up_heap_and_shutdown_thaws_it(monkeypatch) -> None:
    """After start-up every live object leaves the collector's reach (``gc.freeze``, as vLLM);
    shutdown gives them back; ``JAXSERVE_GC_FREEZE=0`` (the test suite's setting) leaves the
    collector alone."""
    import gc

    from jaxserve.engine.core import freeze_startup_heap

    monkeypatch.setenv("JAXSERVE_GC_FREEZE", "1")
    gc.unfreeze()
    engine = make_llm(warmup=False)
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv("JAXSERVE_GC_FREEZE", "0")
    assert not freeze_startup_heap()
    assert gc.get_freeze_count() == 0


def test_shutdown_gives_the_device_memory_back_and_refuses_more_requests() -> None:
    """``LLM.shutdown`` frees the KV cache and lets go of the weights, so a second engine can
    start in the same process (a benchmark of two configurations on one GPU ran out of
    memory while the first engine's 70 GiB cache was still held); arrays a trainer handed to
    ``update_weights`` stay its own; a request after it is a clear error."""
    import gc
    import weakref

    import jax

    llm = make_llm()
    runner = llm.engine.runner
    cache = jax.tree.leaves(runner.kv_cache)
    loaded = [weakref.ref(a) for a in jax.tree.leaves(llm.weights)]  # the engine's own
    trainer = jax.tree.map(lambda a: a + 0, llm.weights)
    llm.update_weights(trainer)
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    llm.shutdown()
    assert cache and all(a.is_deleted() for a in cache)
    gc.collect()
    # nothing holds the weights the engine loaded (its loader held them: a second engine in
    # the process ran out of memory beside a shut-down engine's 15 GiB)
    assert loaded and all(ref() is None for ref in loaded)
    assert runner.kv_cache is None
    assert not any(isinstance(a, jax.Array) for a in jax.tree.leaves(runner.weights))
    assert not any(a.is_deleted() for a in jax.tree.leaves(trainer))
    with pytest.raises(RuntimeError, match=r"shut down .* make a new LLM"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))
    llm.shutdown()  # twice: nothing more to do


def test_a_batch_of_requests_is_made_with_the_collector_paused_and_it_runs_again_after(
    monkeypatch,
) -> None:
    """``LLM.generate`` makes its requests, and the engine queues them, with the cyclic
    collector off (each collection walked every request made so far); it is on again after,
    also when making a request fails, and stays off where it was off."""
    import gc

    from jaxserve.engine.core import gc_paused
    from jaxserve.engine.request_checks import RequestError

    seen = []
    llm = make_llm()
    real_add = llm.engine.add_request

    def add_request(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    assert seen == [False] * len(PROMPTS) and gc.isenabled()
    with pytest.raises((RequestError, ValueError)):
        llm.generate([[]], SamplingParams(max_tokens=2))  # an empty prompt is refused
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    llm.shutdown()
