"""The model drafters served (docs/speculative_decoding.md): ``draft_model`` with the fixture
draft ``tests/fixtures/spec/draft`` and ``eagle3`` with the fixture head
``tests/fixtures/spec/eagle3`` on the demo model (``METHODS``: each served model method):
greedy tokens the same with and without it (a mixed batch, chunked prefill, preemption), the
acceptance measured through the engine, the counters, and the start-up errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.config import ConfigError
from jaxserve.engine_config import default_model_dir
from jaxserve.runner.step import PENDING_TOKEN

SPEC = Path(__file__).parent / "fixtures" / "spec"
LLAMA = Path(__file__).parent / "fixtures" / "models" / "llama"
EVAL = json.loads((SPEC / "eval.json").read_text())
PROMPT_LEN = EVAL["prompt_len"]
PROMPTS = [s[:PROMPT_LEN] for s in EVAL["sequences"]]
K = EVAL["num_speculative_tokens"]
METHODS = {
    "draft_model": {"method": "draft_model", "model": str(SPEC / "draft")},
    "eagle3": {"method": "eagle3", "model": str(SPEC / "eagle3")},
}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_llm(spec: dict | None = None, **overrides) -> jaxserve.LLM:
    settings = dict(
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=16,
        num_gpu_blocks_override=64,
        dtype="float32",
        warmup=False,
    )
    settings.update(overrides)
    config = None if spec is None else {**spec, "num_speculative_tokens": K}
    return jaxserve.LLM(str(default_model_dir()), speculative_config=config, **settings)


def token_ids(llm: jaxserve.LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    """The demo's greedy tokens without speculation: the eval prompts, then two short ones."""
    return token_ids(make_llm(), [*PROMPTS, PROMPTS[0][:3], PROMPTS[1][:9]])


@pytest.fixture(scope="module", params=list(METHODS))
def method(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def drafting(method) -> jaxserve.LLM:
    return make_llm(METHODS[method])


def test_greedy_tokens_are_the_same_in_a_mixed_batch_with_chunked_prefill(plain, drafting) -> None:
    """Ten prompts of 3 to 24 tokens under a budget of 32 tokens a step: prompts prefill in
    chunks in the steps where others verify their drafts, and every token is the same."""
    engine = drafting.engine
    schedule, mixed = engine.scheduler.schedule, []

    def recording_schedule(drafts=None):
        sched = schedule(drafts)
        prefill = any(not i.completes_sequence for i in sched.scheduled)
        mixed.append(prefill and sched.has_drafts)
        return sched

    engine.scheduler.schedule = recording_schedule
    try:
        assert token_ids(drafting, [*PROMPTS, PROMPTS[0][:3], PROMPTS[1][:9]]) == plain
    finally:
        del engine.scheduler.schedule
    assert any(mixed), "no step verified drafts beside a chunked prefill"
    if method_reads_target_states(drafting):
        # Prompts in chunks: their first drafts ran the target again over the earlier chunks.
        assert engine.proposer.recomputed_tokens > 0


def method_reads_target_states(llm: jaxserve.LLM) -> bool:
    return hasattr(llm.engine.proposer, "recomputed_tokens")


def test_acceptance_is_measured_as_the_fixtures_report_and_the_counters_add_up(
    method, drafting
) -> None:
    """The eval prompts one at a time (batch 1, the demo's greedy continuation): the mean
    acceptance length is deterministic and near what docs/eagle3.md reports offline
    (1 + drafts accepted per chain: 3.06 draft model, 2.93 EAGLE-3; served, a chain starts
    after each verify rather than at every position, so the bound has a margin)."""
    before, steps = drafting.engine.spec_stats.copy(), drafting.engine.num_steps
    params = SamplingParams(temperature=0, max_tokens=64 - PROMPT_LEN, ignore_eos=True)
    for prompt in PROMPTS:
        token_ids(drafting, [prompt], params)
    stats = drafting.engine.spec_stats
    drafts = stats.num_drafts - before.num_drafts
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    earlier = before.accepted_per_pos + [0] * K
    per_pos = [a - earlier[i] for i, a in enumerate(stats.accepted_per_pos)]
    assert sum(per_pos) == accepted <= drafted <= K * drafts
    # A run is accepted in order.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    # One sequence a step, each step gives it one token of the target's and its accepted drafts.
    steps = drafting.engine.num_steps - steps
    assert len(PROMPTS) * (64 - PROMPT_LEN) == steps + accepted
    assert drafts <= steps - len(PROMPTS)  # the prefill steps verify nothing
    length = 1 + accepted / drafts
    assert length >= {"draft_model": 2.2, "eagle3": 2.2}[method], length


def test_eagle3_reads_the_targets_states_from_its_steps(plain) -> None:
    """One prompt at a time, each computed in one step (no prefix cache to skip its start),
    then a verify step every step: every draft reads the aux states the target's last step
    returned, and the target never runs again for the head."""
    llm = make_llm(METHODS["eagle3"], enable_prefix_caching=False)
    assert PROMPT_LEN <= 32  # the step budget: each prompt in one step
    assert [token_ids(llm, [p])[0] for p in PROMPTS[:3]] == plain[:3]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.proposer.recomputed_tokens == 0
    layer = llm.engine.proposer.draft_weights.layer  # one device: joined as the target's
    assert layer.fused is not None and layer.wq is None and layer.w_gate is None


def test_a_steps_forward_pass_runs_with_the_last_steps_states_let_go(plain) -> None:
    """The drafter reads the last step's states before the next step: the runner lets them go
    before that step's forward pass (so that its states can take their memory and XLA's
    command buffers see the same addresses), keeps the new step's after it, and the tokens
    and the head's reads of them (no target run again) are as before."""
    llm = make_llm(METHODS["eagle3"], enable_prefix_caching=False)
    runner = llm.engine.runner
    forward, held = runner.forward, []

    def watched(*args, **kwargs):
        held.append(runner.last_states)
        return forward(*args, **kwargs)

    runner.forward = watched
    assert [token_ids(llm, [p])[0] for p in PROMPTS[:2]] == plain[:2]  # each in one step
    assert len(held) > 2 and all(states is None for states in held)
    assert runner.last_states is not None  # the last step's, for the next call
    assert llm.engine.proposer.recomputed_tokens == 0


def test_a_warmed_up_eagle3_drafter_runs_nothing_new_while_serving(plain) -> None:
    """With warm-up on (after the runner's, its cache allocated): the head's programs, the
    target run again over the runner's cache and the gathers from each step bucket's states
    all compile at start, and a prompt the prefix cache partly serves (the target runs again
    over that prefix) gives the same tokens."""
    llm = make_llm(METHODS["eagle3"], warmup=True)
    proposer = llm.engine.proposer
    assert proposer.recomputed_tokens == 0  # warm-up's padding runs are not counted
    take_cache, again_cache = proposer._take._cache_size(), proposer._recompute._cache_size()
    chain_cache = proposer._chain._cache_size()  # its warm-up states committed as a step's
    assert again_cache == len(proposer.buckets.token_buckets)
    assert llm.engine.runner.programs._draft_feed._cache_size() == len(proposer.drafts_shapes())
    assert token_ids(llm, PROMPTS[:2]) == plain[:2]
    assert token_ids(llm, PROMPTS[:2]) == plain[:2]  # their first blocks from the prefix cache
    assert proposer.recomputed_tokens > 0
    assert proposer._take._cache_size() == take_cache
    assert proposer._recompute._cache_size() == again_cache
    assert proposer._chain._cache_size() == chain_cache
    feed = llm.engine.runner.programs._draft_feed  # the verify steps' read of the drafts
    assert feed._cache_size() == len(proposer.drafts_shapes())


def test_a_drafters_programs_compile_ahead_and_its_warm_up_calls_compile_nothing_more(
    plain, method, monkeypatch
) -> None:
    """Warm-up compiles a drafter's programs together on threads (``compile_ahead``: every
    bucket's chain; EAGLE-3's target run again and gathers too), then calls each once: those
    calls reuse what compiled, neither compiling nor reading the persistent cache (one after
    another, a draft model's programs took 101 s on the H200); the tokens are unchanged."""
    from jax import monitoring

    from jaxserve.runner import drafting
    from jaxserve.runner.runner import ModelRunner

    phase, events, ahead = ["runner"], [], []
    real, real_feed = drafting.compile_ahead, ModelRunner.warm_draft_feed

    def warm_draft_feed(self, shapes):  # the runner's read of drafts on the device
        phase[0] = "feed"
        return real_feed(self, shapes)

    def compile_ahead(lowerings, compiled_out=None):
        phase[0] = "ahead"
        ahead.append((len(lowerings), real(lowerings, compiled_out)))
        phase[0] = "calls"
        return ahead[-1][1]

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(phase[0])

    def on_event(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            events.append(phase[0])

    monkeypatch.setattr(drafting, "compile_ahead", compile_ahead)
    monkeypatch.setattr(ModelRunner, "warm_draft_feed", warm_draft_feed)
    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        llm = make_llm(METHODS[method], warmup=True)
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
        monitoring.unregister_event_listener(on_event)
    buckets = len(llm.engine.proposer.buckets.token_buckets)
    ((lowered, compiled),) = ahead
    assert compiled == lowered >= buckets
    assert "calls" not in events
    assert "feed" in events  # the runner's programs for them, apart from the drafter's calls
    assert token_ids(llm, PROMPTS[:2]) == plain[:2]


def test_every_layer_and_step_of_a_drafters_programs_shares_one_attention_lowering(
    method, monkeypatch
) -> None:
    """A drafter's programs call the attention op as the model step does, under one jit
    (``programs.step_attention``): traced once per shape, not once per layer and chained step.
    Lowering a Mosaic GPU kernel takes about a second: bare, EAGLE-3's target run again at
    the Llama-3-8B shape lowered 32 layers x 10 buckets, minutes of warm-up on the H100."""
    from pallas_kernels.ragged_paged_attention import dispatch

    traced = []
    real = dispatch.ragged_paged_attention

    def counted(*args, **kwargs):
        traced.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "ragged_paged_attention", counted)
    proposer = make_llm(METHODS[method]).engine.proposer
    layers = 1 if method == "draft_model" else 4  # the draft's, the demo target's
    programs = 0
    for lower in proposer._lowerings():
        before = len(traced)
        text = lower().as_text()
        programs += "ragged_paged_attention" in text or "counted" in text
        assert len(traced) - before <= 2  # the first step's rows, then the chained steps'
    assert programs >= len(proposer.buckets.token_buckets) * (1 if method == "draft_model" else 2)
    assert K * layers > 2  # bare, each program would have traced more than twice


def test_a_drafting_call_sends_its_inputs_to_the_device_in_one_copy(
    plain, method, drafting, monkeypatch
) -> None:
    """A call's batch, next ids and state rows go as one packed buffer (``put_packed``): one
    host-to-device copy a call, where each array on its own cost a copy (a batch of 8 arrays
    and 2 more: 10). EAGLE-3's gather of the last step's states reads its rows from the same
    buffer; the tokens are unchanged."""
    from jaxserve.runner import drafting as drafting_module

    puts: list[int] = []
    real = drafting_module.put_on

    def counted(tp, tree):
        puts.append(len(jax.tree.leaves(tree)))
        return real(tp, tree)

    calls: list[int] = []
    proposer = drafting.engine.proposer
    propose = proposer.propose

    def counted_propose(seqs, k, on_device=False):
        before = len(puts)
        out = propose(seqs, k, on_device)
        if out:
            calls.append(len(puts) - before)
        return out

    monkeypatch.setattr(drafting_module, "put_on", counted)
    monkeypatch.setattr(proposer, "propose", counted_propose)
    assert token_ids(drafting, PROMPTS[:1]) == plain[:1]
    assert calls and all(n == 1 for n in calls), calls  # one put a call ...
    assert set(puts) == {1}  # ... of one array


def record_steps(llm: jaxserve.LLM, monkeypatch) -> list[tuple[str, object]]:
    """Events in order: ("schedule", its output) for each step scheduled, ("dispatch", ...)
    as the runner takes it, and ("on_host", drafts) when drafts left on the device are read."""
    from jaxserve.runner.step import DeviceDrafts

    events: list[tuple[str, object]] = []
    engine, runner = llm.engine, llm.engine.runner
    schedule, dispatch, on_host = engine.scheduler.schedule, runner.dispatch, DeviceDrafts.on_host

    def recorded_schedule(drafts=None):
        events.append(("schedule", sched := schedule(drafts)))
        return sched

    def recorded_dispatch(output, previous=None):
        events.append(("dispatch", output.device_drafts))
        return dispatch(output, previous)

    def recorded_on_host(self):
        events.append(("on_host", self))
        return on_host(self)

    monkeypatch.setattr(engine.scheduler, "schedule", recorded_schedule)
    monkeypatch.setattr(runner, "dispatch", recorded_dispatch)
    monkeypatch.setattr(DeviceDrafts, "on_host", recorded_on_host)
    return events


def test_a_model_drafters_drafts_stay_on_the_device_until_the_verify_step_is_read(
    plain, drafting, monkeypatch
) -> None:
    """The verify step takes the drafts on the device (``DeviceDrafts``): the host schedules
    and dispatches it with their places held, and reads their values once, after the step,
    before it compares them with the sampled tokens. The tokens are unchanged."""
    events = record_steps(drafting, monkeypatch)
    accepted = drafting.engine.spec_stats.num_accepted_tokens
    assert token_ids(drafting, PROMPTS[:3]) == plain[:3]
    assert drafting.engine.spec_stats.num_accepted_tokens > accepted
    on_device = [e for name, e in events if name == "dispatch" and e is not None]
    assert on_device, "no verify step read its drafts on the device"
    for drafts in on_device:  # dispatched first, then read on the host exactly once
        at = events.index(("dispatch", drafts))
        assert [e for name, e in events[:at] if name == "on_host" and e is drafts] == []
        assert [e for name, e in events[at:] if name == "on_host" and e is drafts] == [drafts]
    scheduled = [sched for name, sched in events if name == "schedule"]
    assert all(  # the drafts' values are the host's once the step is processed
        t >= 0 for sched in scheduled for item in sched.scheduled for t in item.draft_token_ids
    )


@pytest.mark.parametrize("needs", ["penalties", "grammar", "switched off"])
def test_drafts_come_to_the_host_first_where_penalties_or_a_grammar_read_them(
    method, needs, monkeypatch
) -> None:
    """Penalties count the drafts before each sampled position and a grammar cuts them
    before the step: there the host reads them before it schedules (no ``DeviceDrafts``), as
    it does everywhere with ``JAXSERVE_DEVICE_DRAFTS=0``."""
    from jaxserve.engine.core import DEVICE_DRAFTS_ENV

    if needs == "switched off":
        monkeypatch.setenv(DEVICE_DRAFTS_ENV, "0")
    llm = make_llm(METHODS[method])
    events = record_steps(llm, monkeypatch)
    extra = {
        "penalties": {"repetition_penalty": 1.2},
        "grammar": {"structured_outputs": {"regex": "[a-z ]{40,80}"}},
        "switched off": {},
    }[needs]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **extra)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    assert any(sched.has_drafts for name, sched in events if name == "schedule")
    assert all(e is None for name, e in events if name == "dispatch")


def test_drafts_that_do_not_fit_the_steps_feed_come_to_the_host_at_dispatch(
    plain, drafting, monkeypatch
) -> None:
    """Drafts more than the ids a step reads its pending tokens from (S x k over the sequence
    bucket): the runner reads them on the host and builds the step with their values."""
    monkeypatch.setattr(drafting.engine.runner.programs, "feeds_drafts", lambda drafts: False)
    events = record_steps(drafting, monkeypatch)
    assert token_ids(drafting, PROMPTS[:2]) == plain[:2]
    device = [e for name, e in events if name == "dispatch" and e is not None]
    assert device and all(("on_host", e) in events for e in device)
    assert all(sched.device_drafts is None for name, sched in events if name == "schedule")


def test_a_model_drafters_memory_comes_out_of_the_kv_cache(plain, method) -> None:
    """A model drafter's own weights, its pages and (EAGLE-3) the states the runner keeps for
    it are measured once it loads and taken from the KV cache's budget before the cache is
    made (warm-up off: made again, smaller); the start-up lines say so, and a head's shared
    embedding is not counted. Unplanned, they came out of the activation headroom: EAGLE-3's
    warm-up ran out of memory on an H100 at the Llama-3-8B shape."""
    memory = dict(num_gpu_blocks_override=None, device_memory_bytes=1 << 30)
    alone = make_llm(**memory).engine.runner.capacity
    llm = make_llm(METHODS[method], **memory)
    runner, proposer = llm.engine.runner, llm.engine.proposer
    capacity = runner.capacity
    assert capacity.drafter_bytes == proposer.device_bytes(runner.weights) > 0
    # and the sampler's rows for the drafts (8 sequences, 3 drafts each: 32 rows, not 8)
    sampler_rows = capacity.activation_bytes - alone.activation_bytes
    assert sampler_rows > 0
    assert capacity.kv_budget_bytes == alone.kv_budget_bytes - capacity.drafter_bytes - sampler_rows
    block = capacity.kv_bytes_per_token * capacity.block_size
    assert llm.engine.kv.num_blocks == capacity.num_blocks == capacity.kv_budget_bytes // block
    assert capacity.num_blocks < alone.num_blocks
    assert runner.kv_cache[0][0].shape[0] == capacity.num_blocks  # made again at its new size
    assert runner.num_slots == runner.inputs.num_slots == capacity.num_tokens
    lines = llm.engine.capacity_lines()
    assert any("The speculative drafter takes" in line and method in line for line in lines)
    if method == "eagle3":  # the head reads the target's embedding: not its own bytes
        embed = runner.weights.embed
        assert any(leaf is embed for leaf in jax.tree.leaves(proposer.draft_weights))
        states = 2 * runner.buckets.token_buckets[-1] * proposer.state_dim * 4  # float32
        assert proposer.kept_bytes() == states
        own = [x for x in jax.tree.leaves(proposer.arrays()) if x is not embed]
        assert capacity.drafter_bytes == sum(x.nbytes for x in own) + states
    assert token_ids(llm, PROMPTS[:2]) == plain[:2]


def capacity_json(capsys, *argv: str) -> dict:
    import argparse

    from jaxserve.bench.capacity import add_capacity_arguments, run_capacity

    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_capacity_plans_the_drafter_the_engine_measures(method, dtype, capsys) -> None:
    """``jaxserve capacity --speculative-config`` plans, from the configs and the checkpoint's
    tensor names alone, the bytes the engine measures once the drafter has loaded, and so the
    same KV blocks: the two agree where the engine's memory is given."""
    memory = 1 << 30
    llm = make_llm(
        METHODS[method], num_gpu_blocks_override=None, device_memory_bytes=memory, dtype=dtype
    )
    engine = llm.engine
    spec = json.dumps({**METHODS[method], "num_speculative_tokens": K})
    flags = ("--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32")
    out = capacity_json(
        capsys, *flags, "--block-size", "16", "--dtype", dtype, "--device-memory", str(memory),
        "--speculative-config", spec,
    )  # fmt: skip
    measured = engine.proposer.device_bytes(engine.runner.weights)
    assert out["drafter_bytes"] == measured == engine.runner.capacity.drafter_bytes > 0
    assert out["num_blocks"] == engine.kv.num_blocks
    plain = capacity_json(capsys, *flags, "--dtype", dtype, "--device-memory", str(memory))
    assert plain["drafter_bytes"] == 0
    assert out["activation_bytes"] > plain["activation_bytes"]  # the drafts' sampler rows
    sampler_rows = out["activation_bytes"] - plain["activation_bytes"]
    assert out["kv_budget_bytes"] == plain["kv_budget_bytes"] - measured - sampler_rows


def test_capacity_plans_a_head_without_weights_with_an_embedding_of_its_own(
    tmp_path, capsys
) -> None:
    """A head directory with config.json alone: whether it stores ``embed_tokens`` cannot be
    read, so the plan counts one (the larger); the fixture head reads the target's."""
    head = tmp_path / "head"
    head.mkdir()
    shutil.copy(SPEC / "eagle3" / "config.json", head / "config.json")
    plans = {}
    for name, path in (("stored", SPEC / "eagle3"), ("unknown", head)):
        spec = json.dumps({"method": "eagle3", "model": str(path)})
        plans[name] = capacity_json(capsys, "--dtype", "float32", "--speculative-config", spec)
    config = json.loads((SPEC / "eagle3" / "config.json").read_text())
    embed = config["vocab_size"] * config["hidden_size"] * 4
    assert plans["unknown"]["drafter_bytes"] == plans["stored"]["drafter_bytes"] + embed


def test_capacity_names_a_bad_speculative_config(capsys) -> None:
    import argparse

    from jaxserve.bench.capacity import add_capacity_arguments, run_capacity

    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    for spec, words in (
        ('{"method": "eagle"}', "--speculative-config method='eagle' must be one of"),
        ('{"method": "eagle3", "model": "/no/such/head"}', "/no/such/head/config.json"),
    ):
        assert run_capacity(parser.parse_args(["--speculative-config", spec])) == 2
        assert words in capsys.readouterr().err


def test_eagle3_serves_in_bfloat16_on_the_cpu() -> None:
    """The head's logits (bf16 summed into f32) inside the chain's fusions: XLA's CPU runtime
    has no such dot there, so the CPU takes f32 operands (``quant._cpu_upcasts``); the tokens
    are the plain bf16 engine's."""
    prompts = PROMPTS[:2]
    plain_bf16 = token_ids(make_llm(dtype="bfloat16"), prompts)
    llm = make_llm(METHODS["eagle3"], dtype="bfloat16")
    assert token_ids(llm, prompts) == plain_bf16
    assert llm.engine.spec_stats.num_drafts > 0


def test_shutdown_gives_the_drafters_memory_back(method) -> None:
    """``LLM.shutdown`` frees a model drafter's pages and lets go of its weights, as the
    runner's: a second engine in the process needs the memory."""
    import gc
    import weakref

    import jax

    llm = make_llm(METHODS[method])
    proposer = llm.engine.proposer
    own = "weights" if method == "draft_model" else "draft_weights"
    cache = jax.tree.leaves(proposer.kv if method == "draft_model" else proposer.draft_kv)
    weights = [weakref.ref(a) for a in jax.tree.leaves(getattr(proposer, own))]
    llm.shutdown()
    gc.collect()
    assert cache and all(a.is_deleted() for a in cache)
    assert weights and all(ref() is None for ref in weights)


def test_a_drafter_warns_where_its_programs_plan_more_than_the_headroom(
    method, monkeypatch, caplog
) -> None:
    """A drafter's programs run between the model steps, out of the same activation headroom:
    warm-up compares what XLA planned for the largest with it (on an accelerator; the CPU's
    temporaries are the host's, so the check is forced on here) and warns above it, naming
    the settings that give room back; at or below it, nothing is said."""
    from jaxserve.runner import warmup

    monkeypatch.setattr(warmup, "checks_step_memory", lambda: True)
    proposer = make_llm(METHODS[method]).engine.proposer
    with caplog.at_level("WARNING", logger="jaxserve.runner.warmup"):
        proposer.warmup(headroom_bytes=1)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("The drafter's largest program needs")
    assert warning.endswith(warmup.HEADROOM_ADVICE)
    for setting in ("--max-num-batched-tokens", "--num-gpu-blocks-override", "MEM_FRACTION"):
        assert setting in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxserve.runner.warmup"):
        proposer.warmup(headroom_bytes=1 << 40)
    assert caplog.records == []


def test_compile_ahead_leaves_a_program_that_fails_to_its_call() -> None:
    """A program that cannot compile ahead (out of device memory beside the KV cache) is not
    an error there: it compiles, and raises if it must, at its call."""
    import jax
    import jax.numpy as jnp

    from jaxserve.runner.drafting import compile_ahead

    class Failing:
        def compile(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while autotuning")

    double = jax.jit(lambda x: 2 * x)
    x = jnp.ones(3)
    assert compile_ahead([lambda: Failing(), lambda: double.lower(x)]) == 1
    assert compile_ahead([]) == 0
    assert double(x).tolist() == [2.0, 2.0, 2.0]


def test_greedy_under_preemption(plain, method) -> None:
    """A cache of 24 blocks of 4 tokens for 4 sequences of 64: sequences are preempted and
    resumed, the drafter's cache carries on, and the tokens are the same."""
    small = make_llm(
        METHODS[method], num_gpu_blocks_override=24, block_size=4, max_model_len=64, max_num_seqs=4
    )
    assert token_ids(small, PROMPTS[:4]) == plain[:4]
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.spec_stats.num_accepted_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused_at_start_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"draft model 'llama' has vocab_size=320, the target"):
        make_llm({"method": "draft_model", "model": str(LLAMA)})


def test_an_eagle3_head_of_another_hidden_size_is_refused_at_start(tmp_path) -> None:
    head = tmp_path / "head"
    shutil.copytree(SPEC / "eagle3", head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "target_hidden_size": 128}))
    with pytest.raises(ConfigError, match=r"target_hidden_size=128 but the target model's hidden"):
        make_llm({"method": "eagle3", "model": str(head)})


# speculative_config quantization: each model drafter with one of the on-load formats.
QUANTIZED = {"draft_model": "int8", "eagle3": "fp8"}


def test_a_quantized_drafter_keeps_the_greedy_tokens_and_plans_what_it_holds(
    plain, method, capsys
) -> None:
    """``quantization`` in the speculative config (vLLM's field) quantizes the drafter's Linear
    weights per output channel as it loads (a draft model's projections; an EAGLE-3 head's, its
    fc and lm_head): verification keeps the target's greedy tokens, the drafts are still
    accepted, the weights are 8-bit values and scales, and ``jaxserve capacity`` plans the
    bytes the engine measures, fewer than the unquantized drafter's."""
    from jaxserve.models.quant import QArray

    memory = 1 << 30
    spec = {**METHODS[method], "quantization": QUANTIZED[method]}
    llm = make_llm(spec, num_gpu_blocks_override=None, device_memory_bytes=memory)
    assert token_ids(llm, PROMPTS[:4]) == plain[:4]
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    proposer = llm.engine.proposer
    if method == "draft_model":
        layer, linear = proposer.weights.layers[0], []
    else:
        layer, linear = (
            proposer.draft_weights.layer,
            [
                proposer.draft_weights.fc,
                proposer.draft_weights.lm_head,
            ],
        )
    assert layer.fused is not None  # joined on one device, as the unquantized ones are
    linear += [layer.fused.wqkv, layer.fused.w_gate_up, layer.wo, layer.w_down]
    dtype = {"int8": "int8", "fp8": "float8_e4m3fn"}[QUANTIZED[method]]
    assert all(isinstance(w, QArray) and w.q.dtype.name == dtype for w in linear)
    measured = proposer.device_bytes(llm.engine.runner.weights)
    flags = ("--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32")
    flags += ("--dtype", "float32", "--device-memory", str(memory))
    planned = {
        name: capacity_json(capsys, *flags, "--speculative-config", json.dumps(config))
        for name, config in (("quantized", {**spec, "num_speculative_tokens": K}),
                             ("plain", {**METHODS[method], "num_speculative_tokens": K}))
    }  # fmt: skip
    assert planned["quantized"]["drafter_bytes"] == measured
    assert measured < planned["plain"]["drafter_bytes"]


def test_a_drafter_quantization_is_checked_where_it_is_named(tmp_path) -> None:
    """The speculative config refuses ``quantization`` for a drafter with no weights of its
    own, an unknown method and a checkpoint method for an EAGLE-3 head; a bf16 draft named
    with a checkpoint method is refused at start, as ``--quantization`` is for a target."""
    from jaxserve.engine_config import SpeculativeConfig
    from jaxserve.models.quant_scheme import QuantizationError

    cases = (
        ({"method": "ngram", "quantization": "fp8"}, "applies to a drafter's own weights"),
        ({"method": "mtp", "quantization": "fp8"}, "method='mtp' has none"),
        ({**METHODS["draft_model"], "quantization": "nf4"}, "must be one of fp8, int8"),
        ({**METHODS["eagle3"], "quantization": "awq"}, "for an EAGLE-3 head must be one of"),
        ({**METHODS["eagle3"], "quantization": 8}, "quantization=8 has the wrong type"),
    )
    for config, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            SpeculativeConfig.of(config)
    assert "(fp8)" in SpeculativeConfig.of({**METHODS["eagle3"], "quantization": "fp8"}).describe()
    with pytest.raises(QuantizationError, match="needs a checkpoint quantized so"):
        make_llm({**METHODS["draft_model"], "quantization": "awq", "num_speculative_tokens": K})


def test_an_eagle3_head_is_quantized_on_one_device_only(capsys) -> None:
    """Under tensor parallelism a quantized head is refused before anything loads, naming the
    field and the split (the head's shardings are for its unquantized arrays), and ``jaxserve
    capacity`` refuses the same config."""
    import argparse
    from types import SimpleNamespace

    from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
    from jaxserve.models.quant_scheme import QuantScheme
    from jaxserve.runner.eagle3_proposer import load_head

    words = r"quantization='fp8': an EAGLE-3 head is quantized on one device only, .* over 2"
    runner = SimpleNamespace(tp=SimpleNamespace(tensor_parallel_size=2))
    scheme = QuantScheme(method="fp8", weight_format="fp8")
    with pytest.raises(ValueError, match=words):
        load_head(SPEC / "eagle3", None, runner, jax.numpy.float32, scheme)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    spec = json.dumps({**METHODS["eagle3"], "quantization": "fp8"})
    args = ["--speculative-config", spec, "--tensor-parallel-size", "2"]
    assert run_capacity(parser.parse_args(args)) == 2
    assert re.search(words, capsys.readouterr().err)


def test_a_draft_checkpoint_stored_quantized_is_read_as_stored(plain, tmp_path) -> None:
    """A draft model published quantized (compressed-tensors, fp8 per channel) loads as a
    target stored so does, with ``quantization`` left out or naming its method; another
    method is refused at start, naming both."""
    from jaxserve.models.quant import QArray
    from jaxserve.models.quant_scheme import QuantizationError
    from tests.test_quantized_checkpoints import make_quantized

    draft = make_quantized(SPEC / "draft", tmp_path / "draft", "compressed-tensors")
    for quantization in (None, "compressed-tensors"):
        spec = {"method": "draft_model", "model": str(draft), "quantization": quantization}
        llm = make_llm(spec)
        assert token_ids(llm, PROMPTS[:2]) == plain[:2]
        assert llm.engine.spec_stats.num_accepted_tokens > 0
        assert isinstance(llm.engine.proposer.weights.layers[0].w_down, QArray)
    with pytest.raises(QuantizationError, match="does not match the checkpoint's"):
        make_llm({"method": "draft_model", "model": str(draft), "quantization": "awq"})


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_a_step_has_rows_for_every_draft_however_few_sequences_are_served(
    plain, method, max_num_seqs
) -> None:
    """With ``max_num_seqs`` 1 or 2 a sequence's drafts still each get a sampler row: the
    steps' rows are sized for the drafts (``EngineConfig.max_sample_rows``). Sized by the
    sequences alone, one sequence verified no draft at all and two verified one each."""
    llm = make_llm(METHODS[method], max_num_seqs=max_num_seqs)
    engine = llm.engine
    assert engine.config.max_sample_rows == max_num_seqs * (1 + K)
    assert engine.scheduler.max_sample_rows >= max_num_seqs * (1 + K)
    assert token_ids(llm, PROMPTS[:1]) == plain[:1]
    stats = engine.spec_stats
    # every draft of k tokens verified (but where max_tokens cuts one short)
    assert stats.num_drafts > 0 and stats.num_draft_tokens > (K - 1) * stats.num_drafts
    assert engine.num_steps < GREEDY.max_tokens  # fewer steps than tokens: drafts accepted


def test_a_call_drafted_ahead_of_the_host_gives_the_drafts_the_host_would_run(
    plain, method, monkeypatch
) -> None:
    """``JAXSERVE_DRAFT_AHEAD=1``: behind each verify step whose drafts stayed on the device,
    the drafter (a draft model, an EAGLE-3 head) queues the next step's call on the device
    before the host reads the step back (the catch-up over the verified rows, each row's
    token the sampled one, the chain from the last accepted row). The next step takes those
    drafts, and they are the ones the host's own call would make once it knew the accepted
    tokens; a step that also prefills (a sequence without drafts) drafts nothing ahead. The
    tokens are the same."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV, PagedDrafter
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.setenv(DRAFT_AHEAD_ENV, "1")
    monkeypatch.setenv(ASYNC_VERIFY_ENV, "0")  # every verify step read back before the next
    llm = make_llm(METHODS[method], enable_prefix_caching=False)
    proposer = llm.engine.proposer
    pairs = []
    take_ahead, propose = proposer.take_ahead, proposer.propose

    def checked_take_ahead(ahead, seqs, k):
        taken = take_ahead(ahead, seqs, k)
        if taken is not None:  # the host's own call, for the same sequences, after
            pairs.append((taken.on_host(), propose(seqs, k, on_device=False)))
        return taken

    monkeypatch.setattr(proposer, "take_ahead", checked_take_ahead)
    params = SamplingParams(temperature=0, max_tokens=64 - PROMPT_LEN, ignore_eos=True)
    assert token_ids(llm, PROMPTS[:2], params) == [
        token_ids(make_llm(), [p], params)[0] for p in PROMPTS[:2]
    ]
    assert isinstance(proposer, PagedDrafter)
    assert proposer.ahead_taken > 0 and len(pairs) == proposer.ahead_taken
    for ahead, own in pairs:
        assert ahead == own
    # A mixed batch with chunked prefill: the same tokens, drafts ahead only where every
    # sequence of the step verified drafts, taken also where some of them finished since.
    calls, taken = proposer.ahead_calls, proposer.ahead_taken
    assert token_ids(llm, [*PROMPTS, PROMPTS[0][:3], PROMPTS[1][:9]]) == plain
    assert proposer.ahead_calls > calls and proposer.ahead_taken > taken
    for ahead, own in pairs:
        assert ahead == own


def test_drafting_ahead_keeps_the_acceptance_of_drafting_after(method, monkeypatch) -> None:
    """One prompt at a time: the same steps, drafts and accepted tokens with the calls drafted
    ahead as without, and every call but a sequence's last (its step ends it) taken."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.setenv(ASYNC_VERIFY_ENV, "0")  # every verify step read back before the next
    params = SamplingParams(temperature=0, max_tokens=64 - PROMPT_LEN, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(DRAFT_AHEAD_ENV, flag)
        llm = make_llm(METHODS[method], enable_prefix_caching=False)
        tokens = [token_ids(llm, [p], params)[0] for p in PROMPTS[:3]]
        stats = llm.engine.spec_stats
        runs[flag] = (tokens, llm.engine.num_steps, stats.num_drafts, stats.num_accepted_tokens)
        proposer = llm.engine.proposer
        if flag == "1":
            assert proposer.ahead_calls - proposer.ahead_taken <= len(PROMPTS[:3])
            assert proposer.ahead_taken > 0
        else:
            assert proposer.ahead_calls == 0
        llm.shutdown()
    assert runs["0"] == runs["1"]


def test_a_warmed_up_drafter_drafting_ahead_compiles_nothing_new_while_serving(
    plain, method, monkeypatch
) -> None:
    """Warm-up compiles the call drafted ahead for each of the drafter's token buckets (its
    sampled ids and drafts' feed have the step's fixed shape): serving compiles no more."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV

    monkeypatch.setenv(DRAFT_AHEAD_ENV, "1")
    llm = make_llm(METHODS[method], warmup=True, enable_prefix_caching=False)
    proposer = llm.engine.proposer
    ahead_cache = proposer._ahead._cache_size()
    assert ahead_cache == len(proposer.buckets.token_buckets)
    assert token_ids(llm, PROMPTS[:1]) == plain[:1]
    assert proposer.ahead_taken > 0
    assert proposer._ahead._cache_size() == ahead_cache


def test_the_start_up_log_says_when_drafts_are_made_ahead(method, monkeypatch, caplog) -> None:
    """The speculative decoding line names drafts made ahead when they are on, not else."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV

    for flag in ("0", "1"):
        monkeypatch.setenv(DRAFT_AHEAD_ENV, flag)
        caplog.clear()
        with caplog.at_level("INFO", logger="jaxserve.engine.core"):
            make_llm(METHODS[method]).shutdown()
        line = next(
            r.getMessage() for r in caplog.records if "Speculative decoding:" in r.getMessage()
        )
        said = "the next step's drafts made behind it on the device (JAXSERVE_DRAFT_AHEAD)"
        assert (said in line) == (flag == "1"), line


def test_the_call_drafted_ahead_is_queued_before_the_host_reads_its_verify_step(
    plain, monkeypatch
) -> None:
    """The order on the host: each verify step is dispatched, then the next step's call is
    drafted ahead behind it, then the host waits for the verify step's tokens; the next step
    then verifies those drafts without calling ``propose``."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.setenv(DRAFT_AHEAD_ENV, "1")
    monkeypatch.setenv(ASYNC_VERIFY_ENV, "0")  # every verify step read back before the next
    llm = make_llm(METHODS["eagle3"], enable_prefix_caching=False)
    engine, proposer, events = llm.engine, llm.engine.proposer, []
    dispatch, collect = engine.runner.dispatch, engine.runner.collect
    draft_ahead, propose = proposer.draft_ahead, proposer.propose

    def recorded(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            events.append((name, out))
            return out

        return call

    monkeypatch.setattr(engine.runner, "dispatch", recorded("dispatch", dispatch))
    monkeypatch.setattr(engine.runner, "collect", recorded("collect", collect))
    monkeypatch.setattr(proposer, "draft_ahead", recorded("ahead", draft_ahead))
    monkeypatch.setattr(proposer, "propose", recorded("propose", propose))
    params = SamplingParams(temperature=0, max_tokens=64 - PROMPT_LEN, ignore_eos=True)
    assert token_ids(llm, PROMPTS[:1], params) == [token_ids(make_llm(), PROMPTS[:1], params)[0]]
    names = [name for name, _ in events]
    made = [i for i, (name, out) in enumerate(events) if name == "ahead" and out is not None]
    assert made
    for i in made:  # dispatch, drafted ahead, then the read back; next, no propose call
        assert names[i - 1] == "dispatch" and names[i + 1] == "collect", names[i - 1 : i + 2]
        assert names[i + 2 : i + 3] in ([], ["dispatch"]), names[i : i + 3]
    assert names.count("propose") < len(made)


# -- verify steps scheduled before the last one is read back (JAXSERVE_ASYNC_VERIFY) ----------


def verifying_ahead(monkeypatch, spec: dict, on: bool = True, **overrides) -> jaxserve.LLM:
    """An engine whose next verify step is scheduled before the last one is read back, its
    drafts made behind the last on the device (``runner/verify_ahead.py``: the default); not
    ``on``: every verify step read back first (``JAXSERVE_ASYNC_VERIFY=0``)."""
    from jaxserve.runner.drafting import DRAFT_AHEAD_ENV
    from jaxserve.runner.verify_ahead import ASYNC_VERIFY_ENV

    monkeypatch.delenv(DRAFT_AHEAD_ENV, raising=False)
    if on:
        monkeypatch.delenv(ASYNC_VERIFY_ENV, raising=False)
    else:
        monkeypatch.setenv(ASYNC_VERIFY_ENV, "0")
    return make_llm(spec, **{"enable_prefix_caching": False, **overrides})


def test_verify_steps_scheduled_ahead_give_the_same_tokens_and_acceptance(
    plain, method, monkeypatch
) -> None:
    """The default (``JAXSERVE_ASYNC_VERIFY=0`` turns it off): while every sequence decodes,
    the next verify step is dispatched before the last one is read back, counted as if all
    its drafts were accepted and moved on the device by the rejected ones. A mixed batch with
    chunked prefill gives the plain tokens; one prompt at a time gives the tokens of reading
    each verify step back first with most steps verified ahead, and about its acceptance: the
    same drafts but near ``max_tokens``, where the host, counting the drafts in flight as
    accepted, leaves fewer positions to draft (a step more, at most, a sequence)."""
    llm = verifying_ahead(monkeypatch, METHODS[method])
    assert token_ids(llm, [*PROMPTS, PROMPTS[0][:3], PROMPTS[1][:9]]) == plain
    assert llm.engine.num_verified_ahead > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    params = SamplingParams(temperature=0, max_tokens=64 - PROMPT_LEN, ignore_eos=True)
    prompts = PROMPTS[:3]
    runs = {}
    for on in (False, True):
        llm = verifying_ahead(monkeypatch, METHODS[method], on)
        tokens = [token_ids(llm, [p], params)[0] for p in prompts]
        engine, stats = llm.engine, llm.engine.spec_stats
        runs[on] = (tokens, engine.num_steps, stats.num_drafts, stats.num_accepted_tokens)
        if on:
            assert engine.num_verified_ahead > engine.num_steps // 2
        else:
            assert engine.num_verified_ahead == 0
        # every generated token: an accepted draft or the target's own, one a step a sequence
        decode_steps = engine.num_steps - len(prompts)  # (each prompt prefills in one step)
        assert sum(map(len, tokens)) == stats.num_accepted_tokens + decode_steps + len(prompts)
        llm.shutdown()
    (tokens, steps, drafts, accepted), ahead = runs[False], runs[True]
    assert ahead[0] == tokens
    assert steps <= ahead[1] <= steps + len(prompts)
    assert drafts - len(prompts) <= ahead[2] <= drafts + len(prompts)
    assert accepted - 2 * len(prompts) <= ahead[3] <= accepted


def test_seeded_sampling_is_the_same_with_verify_steps_scheduled_ahead(method, monkeypatch) -> None:
    """Seeded sampled requests (temperature, top-p): each token's random draw is keyed by its
    true position, which the device moves with the step, so the tokens are those of reading
    each verify step back first."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i + 1, max_tokens=30, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    runs = {}
    for on in (False, True):
        llm = verifying_ahead(monkeypatch, METHODS[method], on)
        runs[on] = token_ids(llm, PROMPTS, params)
        assert bool(llm.engine.num_verified_ahead) == on
        llm.shutdown()
    assert runs[False] == runs[True]


def test_stops_cut_runs_verified_ahead_where_they_would_without_speculation(
    method, monkeypatch
) -> None:
    """A stop string, the end-of-sequence token and ``max_tokens`` end a sequence inside a
    verified run exactly where they would without speculation, while its next verify step is
    already in flight (its tokens are dropped); a request with ``min_tokens`` (whose
    end-of-sequence hold needs every token on the host) takes the steps read back first."""
    llm = verifying_ahead(monkeypatch, METHODS[method], max_model_len=256)
    text = (
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0].outputs[0].text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string met mid-way
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20),
    ]
    want, without = [], make_llm(None, max_model_len=256)
    for params in cases:
        out = without.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        want.append(
            (
                list(out[0].outputs[0].token_ids),
                out[0].outputs[0].text,
                out[0].outputs[0].finish_reason,
            )
        )
    got = []
    for params in cases:
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0].outputs[0]
        got.append((list(out.token_ids), out.text, out.finish_reason))
    assert got == want
    assert want[0][2] == "stop" and want[1][2] == "length"
    assert llm.engine.num_verified_ahead > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_the_next_verify_step_is_dispatched_before_the_last_is_read(plain, monkeypatch) -> None:
    """The order on the host: a verify step is dispatched, then the next one, and only then
    is the first read back (the host's work for a step overlaps the device's)."""
    llm = verifying_ahead(monkeypatch, METHODS["eagle3"])
    engine, events = llm.engine, []
    dispatch, collect = engine.runner.dispatch, engine.runner.collect

    def recorded(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            events.append((name, out if name == "dispatch" else args[0]))
            return out

        return call

    monkeypatch.setattr(engine.runner, "dispatch", recorded("dispatch", dispatch))
    monkeypatch.setattr(engine.runner, "collect", recorded("collect", collect))
    assert token_ids(llm, PROMPTS[:1]) == plain[:1]
    late = 0  # steps read back after the next one was dispatched
    last_dispatched = None
    for name, step in events:
        if name == "dispatch":
            last_dispatched = step
        elif step is not last_dispatched:
            late += 1
    assert late >= engine.num_verified_ahead > 0


def test_requests_arriving_and_aborted_while_verify_steps_run_ahead(plain, monkeypatch) -> None:
    """A request that arrives while verify steps run ahead (the next step reads the last back
    first, then prefills it) and one aborted with a step in flight: the others' tokens are the
    plain ones, the aborted one holds no token in flight, every block comes back."""
    llm = verifying_ahead(monkeypatch, METHODS["eagle3"])
    engine = llm.engine
    final: dict = {}

    def run_until(predicate) -> None:
        while engine.has_work() and not predicate():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0]

    engine.add_request("a", PROMPTS[0], GREEDY, final_only=True)
    engine.add_request("b", PROMPTS[2], GREEDY, final_only=True)
    run_until(lambda: engine.num_verified_ahead > 2)
    assert engine._in_flight is not None
    engine.add_request("c", PROMPTS[1], GREEDY, final_only=True)
    before = engine.num_verified_ahead
    run_until(lambda: engine.num_verified_ahead > before + 2)
    assert engine._in_flight is not None
    engine.abort_request("b")
    run_until(lambda: False)
    assert list(final["a"].token_ids) == plain[0]
    assert list(final["c"].token_ids) == plain[1]
    assert final["b"].finish_reason == "abort"
    assert PENDING_TOKEN not in final["b"].token_ids
    assert list(final["b"].token_ids) == plain[2][: len(final["b"].token_ids)]
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_verified_ahead_the_prefix_cache_holds_only_accepted_tokens(plain, monkeypatch) -> None:
    """With prefix caching on: a prompt made of another's prompt and output hits the blocks
    its steps filled, verified ahead, and gives the same tokens as without the cache."""
    llm = verifying_ahead(monkeypatch, METHODS["eagle3"], enable_prefix_caching=True)
    first = token_ids(llm, PROMPTS[:1])[0]
    assert first == plain[0] and llm.engine.num_verified_ahead > 0
    follow = PROMPTS[0] + first[:20]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = token_ids(make_llm(None, enable_prefix_caching=False), [follow], params)
    outs = llm.generate([{"prompt_token_ids": follow}], params, use_tqdm=False)
    assert [list(outs[0].outputs[0].token_ids)] == want
    assert outs[0].num_cached_tokens >= 16


def test_the_start_up_log_says_when_verify_steps_are_scheduled_ahead(monkeypatch, caplog) -> None:
    said = (
        "the next verify step is scheduled before the last is read back, its drafts made "
        "behind the last on the device (JAXSERVE_ASYNC_VERIFY)"
    )
    for on in (False, True):
        caplog.clear()
        with caplog.at_level("INFO", logger="jaxserve.engine.core"):
            verifying_ahead(monkeypatch, METHODS["eagle3"], on).shutdown()
        line = next(
            r.getMessage() for r in caplog.records if "Speculative decoding:" in r.getMessage()
        )
        assert (said in line) == on, line


def test_a_warmed_up_engine_verifying_ahead_compiles_nothing_new_while_serving(
    plain, monkeypatch
) -> None:
    """Warm-up compiles the corrections of a verify step scheduled ahead (the model inputs of
    each drafting step's token bucket, the sampler rows of each of its variants): serving
    verifies ahead and compiles none of them again."""
    from jaxserve.runner import step_programs

    llm = verifying_ahead(monkeypatch, METHODS["eagle3"], warmup=True)
    programs = (step_programs._advance, step_programs._shift_rows)
    before = [p._cache_size() for p in programs]
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
    ]
    assert token_ids(llm, PROMPTS[:1]) == plain[:1]
    for p in params:
        token_ids(llm, PROMPTS[1:3], p)
    assert llm.engine.num_verified_ahead > 0
    assert [p._cache_size() for p in programs] == before
