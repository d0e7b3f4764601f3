"""``examples/rl_loop.py``: the policy-gradient loop on the demo model improves its reward, and
the engine's logprobs of the sampled tokens agree with the trainer's (both float32)."""

from __future__ import annotations

import re

from tests.test_weight_layouts import example_module

ITERATIONS = 6


def test_the_loop_improves_its_reward_and_prints_the_logprob_agreement(capsys) -> None:
    history = example_module().main(iterations=ITERATIONS)
    printed = capsys.readouterr().out
    lines = re.findall(
        r"iteration (\d+): mean reward ([\d.]+)  max \|engine - trainer\| logprob ([\d.e+-]+)",
        printed,
    )
    assert [int(i) for i, _, _ in lines] == list(range(ITERATIONS))
    rewards = [entry["reward"] for entry in history]
    assert [float(r) for _, r, _ in lines] == [round(r, 3) for r in rewards]
    assert sum(rewards[-2:]) > sum(rewards[:2]), rewards  # deterministic: fixed seeds
    assert all(0 < entry["agreement"] < 1e-4 for entry in history), history
    assert f"{ITERATIONS} iterations in" in printed
