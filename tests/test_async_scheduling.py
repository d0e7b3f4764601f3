"""Asynchronous scheduling: step n + 1 is dispatched before step n is read back.

The outputs must be exactly those of the synchronous loop (every step read back before the
next is scheduled) for every finish condition, with preemption, aborts and n > 1, and the
overlap must really happen: the runner sees dispatch(n + 1) before collect(n).
"""

from __future__ import annotations

import jax
import pytest

from jaxserve import SamplingParams
from jaxserve.engine.request import PENDING_TOKEN
from tests.test_engine import PROMPTS, ids, make_llm


@pytest.fixture(scope="module")
def pair():
    return make_llm(async_scheduling=False), make_llm(async_scheduling=True)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


def record_calls(llm, monkeypatch) -> list[str]:
    """The order of the runner's dispatch / collect / execute calls."""
    runner, calls = llm.engine.runner, []
    for name in ("dispatch", "collect", "execute"):
        original = getattr(runner, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(runner, name, wrapped)
    return calls


def test_same_outputs_as_synchronous_for_every_finish_condition(pair) -> None:
    sync, overlap = pair
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),  # length
        SamplingParams(temperature=0.8, seed=3, max_tokens=20),  # EOS or length
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[PROMPTS[0][1]]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=3),  # parked siblings
        SamplingParams(temperature=0, max_tokens=40, stop=["a", "e"]),  # stop strings
        SamplingParams(temperature=0, max_tokens=6, logprobs=2, min_tokens=4),
    ]
    prompts = [ids(PROMPTS[i % len(PROMPTS)]) for i in range(len(params))]
    assert run(overlap, prompts, params) == run(sync, prompts, params)


def test_steps_overlap_and_no_pending_token_escapes(pair, monkeypatch) -> None:
    _, overlap = pair
    calls = record_calls(overlap, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = overlap.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert all(PENDING_TOKEN not in o.outputs[0].token_ids for o in outs)
    assert "execute" not in calls
    # Steady state: dispatch, then collect the step before it.
    assert calls[:3] == ["dispatch", "dispatch", "collect"]
    assert calls.count("dispatch") == calls.count("collect")
    assert not overlap.engine.has_work() and overlap.engine.kv.pool.num_free == 128


def test_penalties_read_every_step_back(pair, monkeypatch) -> None:
    sync, overlap = pair
    calls = record_calls(overlap, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.5, ignore_eos=True)
    assert run(overlap, [ids(PROMPTS[2])], params) == run(sync, [ids(PROMPTS[2])], params)
    # Each step read back before the next is dispatched: nothing is dispatched ahead.
    assert calls == ["dispatch", "collect"] * (len(calls) // 2) and calls
    assert overlap.engine._num_sync_requests == 0


def test_preemption_with_a_token_in_flight() -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [ids([0] + [i + 7] * 9) for i in range(6)]
    tight = dict(num_gpu_blocks_override=32, enable_prefix_caching=False)
    want = run(make_llm(async_scheduling=False, **tight), prompts, params)
    overlap = make_llm(async_scheduling=True, **tight)
    assert run(overlap, prompts, params) == want
    assert overlap.engine.scheduler.num_preemptions > 0
    assert overlap.engine.kv.pool.num_free == 32


def test_abort_with_a_token_in_flight(pair) -> None:
    _, overlap = pair
    engine = overlap.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("a")
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    aborted = [o for o in outputs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort"
    assert PENDING_TOKEN not in aborted[0].outputs[0].token_ids
    b_tokens = [t for o in outputs if o.request_id == "b" for t in o.outputs[0].token_ids]
    assert PENDING_TOKEN not in b_tokens
    assert engine.kv.pool.num_free == 128


def test_prefix_cache_hashes_only_known_tokens(pair) -> None:
    """Blocks filled by generated tokens are cached under their real tokens: a follow-up
    prompt made of prompt + output hits them in both modes alike."""
    hits = []
    for llm in pair:
        params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
        out = llm.generate(ids(PROMPTS[2]), params, use_tqdm=False)[0]
        follow_up = list(PROMPTS[2]) + list(out.outputs[0].token_ids)
        again = llm.generate(ids(follow_up), params.replace(max_tokens=1), use_tqdm=False)[0]
        hits.append(again.num_cached_tokens)
    assert hits[0] == hits[1] > len(PROMPTS[2])


def test_launch_flag() -> None:
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import engine_config_from_args

    for argv, want in ((["launch"], True), (["launch", "--no-async-scheduling"], False)):
        assert engine_config_from_args(build_parser(argv).parse_args(argv)).async_scheduling is want


def test_no_program_compiles_after_warm_up() -> None:
    """No compile on the serving path: every step (the pending-token feed included, which
    runs inside the model step) and every sampler call finds a program warm-up compiled."""
    jax.clear_caches()  # jit caches are per function: start from none
    llm = make_llm(warmup=True, max_num_seqs=4)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for count in (1, 3, 6):  # 6 > max_num_seqs: batches of several sizes, prefill + decode
        llm.generate([ids(p) for p in (PROMPTS * 2)[:count]], params, use_tqdm=False)
    # A call without a compiled program would have traced and compiled through the jit.
    assert runner.programs.step_fn._cache_size() == 0
    assert runner.programs.sample_fn._cache_size() == 0


def test_shutdown_waits_for_the_step_in_flight() -> None:
    llm = make_llm(async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.shutdown()
    assert engine._in_flight is None
