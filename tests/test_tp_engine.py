"""jaxserve.LLM with tensor_parallel_size 1, 2, 4 on 4 CPU devices: the same greedy tokens as
Hugging Face (run in a subprocess: the device count is fixed when JAX starts)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.conftest import run_with_devices

ROOT = Path(__file__).parents[1]

SCRIPT = textwrap.dedent("""
    import numpy as np
    import jaxserve
    from jaxserve import SamplingParams
    golden = np.load("tests/fixtures/models/qwen3/golden.npz")
    prompt = {"prompt_token_ids": golden["prompt_ids"].tolist()}
    for tp in (1, 2, 4):
        llm = jaxserve.LLM("tests/fixtures/models/qwen3", tensor_parallel_size=tp,
                           max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                           block_size=4, num_gpu_blocks_override=64, dtype="float32")
        # wo [N, D, H]: query heads split like wq's (which one device holds fused with wk, wv)
        shard = llm.engine.runner.weights.layers[0].wo.addressable_shards[0].data.shape
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print(tp, shard[0], out[0].outputs[0].token_ids == golden["greedy_ids"].tolist())
    fp8 = {}
    for tp in (1, 2):  # an fp8 KV cache, split over KV heads like a bf16 one
        llm = jaxserve.LLM("tests/fixtures/models/qwen3", tensor_parallel_size=tp,
                           kv_cache_dtype="fp8", max_model_len=128, max_num_seqs=4,
                           max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=64,
                           dtype="float32", warmup=False)
        k_pages = llm.engine.runner.kv_cache[0][0]  # donated by the first step: read it now
        local = (str(k_pages.dtype), k_pages.addressable_shards[0].data.shape[2])
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        fp8[tp] = (*local, out[0].outputs[0].token_ids)
    print("fp8", fp8[1][0], fp8[1][1], fp8[2][1], fp8[1][2] == fp8[2][2])
""")


def test_tensor_parallel_engine_matches_hf() -> None:
    stdout = run_with_devices(SCRIPT, 4, timeout=300)
    lines = [line.split() for line in stdout.strip().splitlines()]
    # query heads per shard: 4, 2, 1; greedy tokens equal the golden ones at every size
    assert lines[:3] == [["1", "4", "True"], ["2", "2", "True"], ["4", "1", "True"]]
    # fp8 KV: 2 KV heads on one device, 1 on each of two; the same greedy tokens
    assert lines[3] == ["fp8", "float8_e4m3fn", "2", "1", "True"]
