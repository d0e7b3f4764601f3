"""A multi-host replica on loopback: two processes of one CPU device each, tensor parallel 2.
Process 0 runs jaxserve.LLM (scheduler, KV blocks) and broadcasts every step; process 1 runs
the follower. The tokens must equal Hugging Face's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import free_port, wait_for_all

ROOT = Path(__file__).parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jaxserve.runner.parallel.distributed import initialize_distributed
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    from jaxserve.engine_config import EngineConfig
    settings = dict(model="tests/fixtures/models/llama", tensor_parallel_size=2,
                    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                    num_gpu_blocks_override=64, dtype="float32")
    if pid == 0:
        import jaxserve
        golden = np.load("tests/fixtures/models/llama/golden.npz")
        prompts = [{"prompt_token_ids": golden["prompt_ids"].tolist()},
                   {"prompt_token_ids": golden["prompt2_ids"].tolist()}]
        params = jaxserve.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with jaxserve.LLM(**settings) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        print(json.dumps({"tokens": outs[0].outputs[0].token_ids,
                          "golden": golden["greedy_ids"].tolist(),
                          "second": len(outs[1].outputs[0].token_ids)}))
    else:
        from jaxserve.engine.follower import run_follower
        run_follower(EngineConfig(**settings))
        print(json.dumps({"follower": "done"}))
""")


def test_two_process_replica_serves_golden_tokens() -> None:
    port = free_port()
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        TRANSFORMERS_VERBOSITY="error",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(port), str(pid)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    wait_for_all(procs, 240)
    outputs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-4000:]
    leader = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert leader["tokens"] == leader["golden"] and leader["second"] == 8
    assert json.loads(outputs[1][0].strip().splitlines()[-1]) == {"follower": "done"}
