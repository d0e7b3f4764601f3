"""Scheduler and step loop with a fake runner whose tokens are hand-computable.

The fake model always answers `last token + 1` (mod vocab), so every expected output can be
written down.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.core import EngineCore
from jaxserve.engine.request_checks import RequestError
from jaxserve.engine_config import EngineConfig
from jaxserve.runner.capacity import plan_capacity
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from tests.conftest import fixture_dir

VOCAB = 320  # the fixture tokenizer's vocabulary


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, model_config) -> None:
        self.num_blocks = num_blocks
        self.multihost = False
        self.steps: list[SchedulerOutput] = []
        self.capacity = plan_capacity(
            model_config,
            max_model_len=block_size,
            device_memory_bytes=0,
            memory_utilization=1.0,
            block_size=block_size,
            num_blocks_override=num_blocks,
        )

    ready_tokens = 1 << 30
    compile_seconds = 0.0
    is_sleeping = False  # no sleep mode

    def warmup(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        step = self.dispatch(output)
        self.sample(step, None)
        return self.collect(step)

    def dispatch(self, output: SchedulerOutput, previous=None) -> SchedulerOutput:
        self.steps.append(output)
        return output

    def sample(self, output: SchedulerOutput, token_mask) -> None:
        assert token_mask is None or output.is_constrained

    def collect(self, output: SchedulerOutput) -> RunnerOutput:
        tokens = []
        for item in output.scheduled:
            # The model reads all tokens up to the end of this chunk; the last one decides.
            last = item.seq.token_ids(
                item.start + item.num_new_tokens - 1, item.start + item.num_new_tokens
            )[0]
            tokens.append((last + 1) % VOCAB)
        return RunnerOutput(token_ids=np.asarray(tokens, np.int32))


def make_core(num_blocks: int = 64, **overrides) -> tuple[EngineCore, FakeRunner]:
    settings = dict(
        model=str(fixture_dir("llama")),
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        warmup=False,
        async_scheduling=False,  # one step at a time: the tests read each step's schedule
    )
    settings.update(overrides)
    config = EngineConfig(**settings)
    from jaxserve.models.families.registry import load_model_config

    runner = FakeRunner(num_blocks, config.block_size, load_model_config(config.model_dir))
    return EngineCore(config, runner=runner), runner


def run_all(core: EngineCore, results: dict | None = None) -> dict:
    results = {} if results is None else results
    for _ in range(1000):
        if not core.has_work():
            break
        run_steps(core, results, 1)
    assert not core.has_work()
    return results


def run_steps(core: EngineCore, results: dict, num_steps: int) -> None:
    for _ in range(num_steps):
        for out in core.step():
            if out.request_id in results:
                results[out.request_id].merge(out)
            else:
                results[out.request_id] = out


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_decode_tokens_follow_the_fake_model() -> None:
    core, _ = make_core()
    core.add_request("a", [10, 11, 12], GREEDY)
    out = run_all(core)["a"]
    assert out.outputs[0].token_ids == [13, 14, 15, 16, 17]
    assert out.outputs[0].finish_reason == "length"
    assert core.kv.pool.num_free == core.kv.num_blocks


def test_token_budget_and_chunked_prefill() -> None:
    core, runner = make_core()
    core.add_request("long", list(range(40)), GREEDY)  # 40 > budget 16: three chunks
    core.add_request("short", [5, 6], GREEDY)
    out = run_all(core)
    assert out["long"].outputs[0].token_ids == [40, 41, 42, 43, 44]
    assert out["short"].outputs[0].token_ids == [7, 8, 9, 10, 11]
    assert all(step.num_batched_tokens <= 16 for step in runner.steps)
    first = runner.steps[0]
    assert [i.num_new_tokens for i in first.scheduled] == [16]
    # Decodes of "short" run in the same steps as later chunks of "long" (no stall).
    mixed = [s for s in runner.steps if {i.seq.seq_id for i in s.scheduled} == {"long", "short"}]
    assert mixed


def test_max_num_seqs_caps_running() -> None:
    core, runner = make_core(max_num_seqs=2)
    for i in range(5):
        core.add_request(str(i), [i + 1], GREEDY)
    out = run_all(core)
    assert len(out) == 5
    assert max(len(s.scheduled) for s in runner.steps) == 2


def test_preemption_recomputes_and_output_is_unchanged() -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference, _ = make_core(num_blocks=64)
    pressured, _ = make_core(num_blocks=12)  # 48 slots for three requests of 26 tokens
    for core in (reference, pressured):
        for i in range(3):
            core.add_request(str(i), [100 * i + j for j in range(6)], params)
    want, got = run_all(reference), run_all(pressured)
    assert pressured.scheduler.num_preemptions > 0
    assert reference.scheduler.num_preemptions == 0
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert pressured.kv.pool.num_free == 12


def test_abort_frees_blocks_in_the_same_step() -> None:
    core, _ = make_core()
    core.add_request("a", list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    assert core.kv.pool.num_free < core.kv.num_blocks
    core.abort_request("a")
    outs = core.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert core.kv.pool.num_free == core.kv.num_blocks
    assert core.stats.num_aborted == 1


def test_finish_reasons() -> None:
    core, _ = make_core()
    core.output_processor.eos_token_ids = (20,)
    core.add_request("eos", [17], SamplingParams(temperature=0, max_tokens=10))
    core.add_request("ignore", [17], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.add_request(
        "stop_id", [30], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[33])
    )
    core.add_request("min", [17], SamplingParams(temperature=0, max_tokens=6, min_tokens=5))
    out = run_all(core)
    assert out["eos"].outputs[0].token_ids == [18, 19, 20]
    assert (out["eos"].outputs[0].finish_reason, out["eos"].outputs[0].stop_reason) == (
        "stop",
        None,
    )
    assert out["ignore"].outputs[0].token_ids == [18, 19, 20, 21]
    assert out["stop_id"].outputs[0].stop_reason == 33
    assert out["stop_id"].outputs[0].token_ids == [31, 32, 33]
    # min_tokens: the fake model ignores bias, so EOS at position 3 is simply not a stop.
    assert out["min"].outputs[0].finish_reason == "length"


def test_max_model_len_finishes_with_length() -> None:
    core, _ = make_core(max_model_len=12)
    core.add_request(
        "a", list(range(8)), SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    )
    out = run_all(core)["a"]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_request_validation_names_the_field() -> None:
    core, _ = make_core(max_model_len=12)
    with pytest.raises(RequestError) as err:
        core.add_request("a", list(range(12)), GREEDY)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as err:
        core.add_request("b", list(range(8)), SamplingParams(max_tokens=5))
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestError):
        core.add_request("c", [VOCAB], GREEDY)
    with pytest.raises(RequestError):
        core.add_request("d", [], GREEDY)
    core.add_request("e", [1], GREEDY)
    with pytest.raises(RequestError):
        core.add_request("e", [1], GREEDY)


def test_n_samples_share_prompt_blocks() -> None:
    core, runner = make_core()
    core.add_request(
        "n", list(range(10)), SamplingParams(n=3, temperature=0, max_tokens=3, ignore_eos=True)
    )
    results: dict = {}
    run_steps(core, results, 1)  # sample 0 prefills alone
    assert [i.seq.index for i in runner.steps[0].scheduled] == [0]
    run_steps(core, results, 1)
    second = runner.steps[1].scheduled
    # siblings recompute only the partial last block: 10 tokens, 8 shared.
    assert sorted((i.seq.index, i.num_new_tokens) for i in second) == [(0, 1), (1, 2), (2, 2)]
    parent = core.requests["n"].seqs[0]
    assert all(core.kv.pool.ref_counts[b] == 3 for b in parent.block_ids[:2])
    out = run_all(core, results)["n"]
    assert sorted(o.index for o in out.outputs) == [0, 1, 2]
    assert all(o.token_ids == [10, 11, 12] for o in out.outputs)
    assert core.kv.pool.num_free == core.kv.num_blocks


def test_prefix_cache_hit_counts_cached_tokens() -> None:
    core, runner = make_core()
    core.add_request("a", list(range(13)), GREEDY)
    run_all(core)
    core.add_request("b", list(range(13)), GREEDY)
    out = run_all(core)["b"]
    assert out.num_cached_tokens == 12
    assert out.outputs[0].token_ids == [13, 14, 15, 16, 17]
    assert core.stats.prefix_cache_hits == 12


def test_priority_policy_admits_lower_value_first() -> None:
    core, runner = make_core(max_num_seqs=1, scheduling_policy="priority")
    core.add_request("late", [1], GREEDY, priority=5)
    core.add_request("urgent", [2], GREEDY, priority=0)
    run_all(core)
    assert runner.steps[0].scheduled[0].seq.seq_id == "urgent"


def test_stop_strings_cut_the_text() -> None:
    core, _ = make_core()
    tok = core.tokenizer
    # Find a prompt whose continuation under the fake model decodes to a known text.
    prompt = tok.encode("hello", add_special_tokens=False)
    probe = make_core()[0]
    probe.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    full = run_all(probe)["p"].outputs[0].text
    assert len(full) >= 3
    stop = full[1:3]
    core.add_request(
        "s", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop])
    )
    core.add_request(
        "k",
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=6,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    out = run_all(core)
    assert out["s"].outputs[0].text == full[: full.find(stop)]
    assert out["s"].outputs[0].stop_reason == stop and out["s"].outputs[0].finish_reason == "stop"
    assert out["k"].outputs[0].text == full[: full.find(stop) + len(stop)]


# -- fairness: one request with many samples must not hold back a later one ------------------


def test_round_robin_admits_a_later_request_before_a_many_sample_one_is_done() -> None:
    core, runner = make_core(max_num_seqs=4, max_num_batched_tokens=64)
    big = SamplingParams(temperature=1.0, seed=1, n=8, max_tokens=20, ignore_eos=True)
    core.add_request("big", [1, 2, 3], big)
    run_steps(core, {}, 1)  # sample 0 prefills; its 7 siblings join the waiting queue
    core.add_request("small", [5, 6], GREEDY)
    run_steps(core, {}, 1)
    admitted = [item.seq.seq_id for item in runner.steps[-1].scheduled if item.is_new]
    assert "small" in admitted, admitted  # first come, first served would admit big#1..#3
    # big holds 2 of the 3 open slots; the 4th is kept for a request with nothing running
    assert len(core.scheduler.running) == 3
    core.add_request("late", [9], GREEDY)
    run_steps(core, {}, 1)
    admitted = [item.seq.seq_id for item in runner.steps[-1].scheduled if item.is_new]
    assert admitted == ["late"]  # at once, though big still has samples waiting
    run_all(core)


def test_prompts_of_one_call_share_one_admission_turn() -> None:
    """The prompts of one API call (one group) take one slot per round together: a call with
    many prompts is one turn, like a call with many samples."""
    core, runner = make_core(max_num_seqs=4, max_num_batched_tokens=64)  # 3 open, 1 kept
    for i in range(6):
        core.add_request(f"many-{i}", [1, 2, i], GREEDY, group_id="many")
    core.add_request("other", [7, 8], GREEDY)
    run_steps(core, {}, 1)
    admitted = [item.seq.seq_id for item in runner.steps[-1].scheduled if item.is_new]
    assert admitted == ["many-0", "other", "many-1"]
    run_all(core)


# -- the step's lifecycle: the runner creates and frees its state from it alone --------------


class RowKeepingRunner(FakeRunner):
    """Keeps a row per sequence exactly as ModelRunner does: created when the scheduler names
    a sequence new, dropped when it names it preempted or finished."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: set[str] = set()

    def dispatch(self, output: SchedulerOutput, previous=None) -> SchedulerOutput:
        self.rows -= {*output.preempted_seq_ids, *output.finished_seq_ids}
        for item in output.scheduled:
            if item.is_new:
                assert item.seq.seq_id not in self.rows, f"{item.seq.seq_id} is new twice"
                self.rows.add(item.seq.seq_id)
            else:
                assert item.seq.seq_id in self.rows, f"{item.seq.seq_id} has no row"
        return super().dispatch(output, previous)


def make_row_core(num_blocks: int, **overrides) -> tuple[EngineCore, RowKeepingRunner]:
    from jaxserve.models.families.registry import load_model_config

    core, fake = make_core(num_blocks, **overrides)
    runner = RowKeepingRunner(num_blocks, 4, load_model_config(fixture_dir("llama")))
    core.runner = runner
    return core, runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_runner_state_follows_the_lifecycle_through_preemption_and_abort(
    async_scheduling,
) -> None:
    core, runner = make_row_core(8, async_scheduling=async_scheduling)  # 8 blocks: preemption
    for i in range(4):
        core.add_request(str(i), list(range(10 + i, 16 + i)), GREEDY.replace(max_tokens=12))
    core.add_request("n", [3, 4, 5], SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=4))
    run_steps(core, {}, 3)
    core.abort_request("1")
    results = run_all(core)
    assert core.scheduler.num_preemptions > 0
    assert results["1"].outputs[0].finish_reason == "abort"
    # Finished sequences are named with the next step that runs: one more request flushes them.
    core.add_request("last", [9], GREEDY.replace(max_tokens=1))
    run_all(core)
    assert runner.rows <= {"last"}


# -- one request's failure inside the step is that request's alone --------------------------


class PoisonRunner(FakeRunner):
    """Fails to build a step that holds a request seeded 666 (as a bad parameter would)."""

    def dispatch(self, output: SchedulerOutput, previous=None) -> SchedulerOutput:
        if any(item.seq.params.seed == 666 for item in output.scheduled):
            raise OverflowError("Python integer out of bounds for int32")
        return super().dispatch(output, previous)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_breaks_its_step_fails_alone(async_scheduling) -> None:
    from jaxserve.models.families.registry import load_model_config

    core, _ = make_core(async_scheduling=async_scheduling)
    core.runner = PoisonRunner(64, 4, load_model_config(fixture_dir("llama")))
    core.add_request("ok", [1, 2, 3], GREEDY)
    results: dict = {}
    run_steps(core, results, 2)  # "ok" is running when the poisoned request arrives
    core.add_request("poison", [4, 5], SamplingParams(temperature=1.0, seed=666, max_tokens=3))
    run_steps(core, results, 1)  # NOTE: every request new in the failing step fails with it
    core.add_request("after", [6, 7], GREEDY)
    results = run_all(core, results)
    assert results["poison"].finished and results["poison"].outputs[0].finish_reason == "error"
    assert "OverflowError" in results["poison"].error
    for name in ("ok", "after"):
        assert results[name].outputs[0].finish_reason == "length", name
        assert len(results[name].outputs[0].token_ids) == GREEDY.max_tokens
    assert core.kv.pool.num_free == core.kv.num_blocks


def test_a_step_failure_with_no_new_request_still_stops_the_engine() -> None:
    from jaxserve.models.families.registry import load_model_config

    core, _ = make_core()
    core.runner = PoisonRunner(64, 4, load_model_config(fixture_dir("llama")))
    core.add_request("ok", [1, 2, 3], GREEDY)
    run_steps(core, {}, 1)
    core.requests["ok"].params.__dict__["seed"] = 666  # its step now breaks, nobody new to blame
    with pytest.raises(OverflowError):
        run_steps(core, {}, 1)
