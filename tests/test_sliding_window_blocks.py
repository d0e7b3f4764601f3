"""Sliding windows that free memory: on a model whose every layer slides (the Phi-3 fixture,
window 16) a running sequence's KV blocks behind the window go back to the pool; a hybrid
model (the Gemma 2 fixture, global layers too) keeps every block. Tokens stay those of
transformers and of a run that keeps every block."""

from __future__ import annotations

import argparse
import json

import numpy as np

import jaxserve
from jaxserve import SamplingParams
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.engine.kv_cache import NULL_BLOCK, KVCacheManager
from jaxserve.engine.request import Request, Sequence
from jaxserve.models.families.registry import load_model_config
from tests.conftest import fixture_dir

WINDOW = 16  # the phi3 and gemma2 fixtures' sliding_window
BLOCK = 4


def make_seq(tokens: list[int], seq_id: str) -> Sequence:
    request = Request(seq_id, None, tokens, SamplingParams(), 0.0)
    seq = Sequence(seq_id, request, 0, seed=0)
    request.seqs.append(seq)
    return seq


def make_llm(family: str, **kwargs) -> jaxserve.LLM:
    options = dict(
        max_model_len=256,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        block_size=BLOCK,
        num_gpu_blocks_override=64,
        dtype="float32",
        warmup=False,
    )
    return jaxserve.LLM(str(fixture_dir(family)), **(options | kwargs))


def generate_counting_blocks(
    llm: jaxserve.LLM, prompt: list[int], max_tokens: int
) -> tuple[list[int], int, int]:
    """Greedy tokens of one request, and the most blocks the pool had in use after a step:
    over the whole run, and from the first output token on (decode steps only)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    most_held = most_held_decoding = 0
    finished = False
    while not finished:
        for delta in engine.step():
            tokens += delta.outputs[0].token_ids
            finished = finished or delta.finished
        held = engine.kv.num_blocks - engine.kv.pool.num_free
        most_held = max(most_held, held)
        if tokens:
            most_held_decoding = max(most_held_decoding, held)
    return tokens, most_held, most_held_decoding


def test_all_layers_window_only_when_every_layer_slides() -> None:
    assert load_model_config(fixture_dir("phi3")).all_layers_window == WINDOW
    assert load_model_config(fixture_dir("gemma2")).all_layers_window is None
    assert load_model_config(fixture_dir("llama")).all_layers_window is None


def test_blocks_behind_the_window_go_back_to_the_pool_and_stay_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True,
                        sliding_window=WINDOW)  # fmt: skip
    seq = make_seq(list(range(40)), "a")
    assert kv.allocate(seq, 40)  # one 40-token prefill: every block is written
    first_blocks = list(seq.block_ids)
    assert kv.num_held_blocks(seq) == 10 and kv.pool.num_free == 6
    seq.num_computed_tokens = 40
    seq.append_token(7)
    # The next row is position 40: it reads positions 25..40, blocks 6.. (24..27 onwards).
    assert kv.allocate(seq, 1)
    assert seq.block_ids[:6] == [NULL_BLOCK] * 6 and len(seq.block_ids) == 11
    assert kv.num_held_blocks(seq) == 5 and kv.pool.num_free == 11
    # Released blocks keep their hash: a new sequence with the same prefix still hits them.
    assert kv.find_cached_prefix(make_seq(list(range(40)), "b"))[:6] == first_blocks[:6]
    kv.free(seq)
    assert kv.pool.num_free == 16 and all(c == 0 for c in kv.pool.ref_counts)


def test_a_hit_behind_the_window_is_released_at_once() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True,
                        sliding_window=WINDOW)  # fmt: skip
    first = make_seq(list(range(40)), "a")
    assert kv.allocate(first, 40)
    kv.free(first)
    second = make_seq(list(range(40)), "b")
    cached = kv.find_cached_prefix(second)
    assert len(cached) == 9  # 36 tokens; the last 4 are computed
    assert kv.allocate(second, 4, cached)
    # Rows from position 36 read from 21 on: blocks 0..4 are released again.
    assert second.block_ids[:5] == [NULL_BLOCK] * 5 and second.block_ids[5:9] == cached[5:]
    assert kv.num_held_blocks(second) == 5
    kv.free(second)
    assert all(c == 0 for c in kv.pool.ref_counts)


def test_long_generation_holds_blocks_within_the_window_and_matches_keeping_them() -> None:
    prompt = np.load(fixture_dir("phi3") / "golden.npz")["prompt2_ids"].tolist()  # 56 tokens
    released = make_llm("phi3")
    tokens, most_held, most_held_decoding = generate_counting_blocks(released, prompt, 200)
    # A prefill chunk of 32 holds more (it reads the window behind its first row); a decode
    # step the window's blocks and the one being written.
    assert most_held <= -(-(WINDOW - 1 + 32) // BLOCK) + 1
    assert most_held_decoding <= -(-WINDOW // BLOCK) + 1
    engine = released.engine
    assert engine.kv.num_blocks - engine.kv.pool.num_free == 0  # all back after the finish

    kept = make_llm("phi3")
    kept.engine.kv = kept.engine.scheduler.kv = KVCacheManager(64, BLOCK, True)  # no window
    kept_tokens, kept_most_held, _ = generate_counting_blocks(kept, prompt, 200)
    assert len(tokens) == 200 and tokens == kept_tokens
    assert kept_most_held == 64  # 256 tokens: every block


def test_long_greedy_generation_past_the_window_matches_hf_while_releasing() -> None:
    golden = np.load(fixture_dir("phi3") / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    llm = make_llm("phi3")
    tokens, most_held, _ = generate_counting_blocks(
        llm, golden["prompt2_ids"].tolist(), len(expected)
    )
    assert tokens == expected
    assert most_held < -(-(len(golden["prompt2_ids"]) + len(expected)) // BLOCK)
    # Again: the prompt's first 13 blocks hit the prefix cache, the 9 behind the window of its
    # last 4 tokens are released at once (their page-table entries are NULL_BLOCK).
    hits = llm.engine.kv.prefix_hits
    again = llm.generate(golden["prompt2_ids"].tolist(), SamplingParams(
        temperature=0, max_tokens=len(expected), ignore_eos=True))  # fmt: skip
    assert llm.engine.kv.prefix_hits - hits == 13 * BLOCK
    assert again[0].outputs[0].token_ids == expected


def test_hybrid_model_releases_nothing_and_matches_hf() -> None:
    golden = np.load(fixture_dir("gemma2") / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    prompt = golden["prompt2_ids"].tolist()
    llm = make_llm("gemma2")
    assert llm.engine.kv.sliding_window is None
    tokens, most_held, _ = generate_counting_blocks(llm, prompt, len(expected))
    assert tokens == expected
    assert most_held == -(-(len(prompt) + len(expected)) // BLOCK)  # every block held


def test_preempted_sliding_window_sequences_resume_with_the_same_tokens() -> None:
    golden = np.load(fixture_dir("phi3") / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    prompt = golden["prompt2_ids"].tolist()
    # 20 blocks (one request of 80 tokens): four running sequences of 5 to 10 blocks each
    # do not fit, even releasing.
    tight = dict(max_model_len=80, max_num_seqs=4, num_gpu_blocks_override=20)
    llm = make_llm("phi3", enable_prefix_caching=False, **tight)
    params = SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True)
    outs = llm.generate([prompt] * 4, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [out.outputs[0].token_ids for out in outs] == [expected] * 4


def capacity_json(family: str, memory: int) -> list[str]:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    argv = [str(fixture_dir(family)), "--max-model-len", "256", "--device-memory", str(memory)]
    argv += ["--dtype", "float32", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    argv += ["--block-size", str(BLOCK), "--json"]
    assert run_capacity(parser.parse_args(argv)) == 0
    return argv


def test_capacity_counts_window_plus_block_per_request_for_all_sliding(capsys) -> None:
    memory = 96 * 1024**2
    capacity_json("phi3", memory)
    out = json.loads(capsys.readouterr().out)
    assert out["max_concurrency"] == out["kv_cache_tokens"] / (WINDOW + BLOCK)
    llm = make_llm("phi3", num_gpu_blocks_override=None, device_memory_bytes=memory)
    line = (
        f"Maximum concurrency for 256 tokens per request: {out['max_concurrency']:.2f}x "
        f"(sliding window: {WINDOW + BLOCK} tokens held per request)"
    )
    assert line in llm.engine.capacity_lines()
    # A hybrid model counts every token of the request.
    capacity_json("gemma2", memory)
    hybrid = json.loads(capsys.readouterr().out)
    assert hybrid["max_concurrency"] == hybrid["kv_cache_tokens"] / 256
