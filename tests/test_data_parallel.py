"""Data parallel on one host (``--data-parallel-size``): the balancer's rule, the engine client
that fans out to the replicas, and two replicas of the llama fixture on two virtual CPU devices
(a subprocess: JAX fixes its device count when it starts) that route a shared prefix to one
replica, spread different prefixes, and produce the single engine's greedy tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re

import jax
import pytest

from jaxserve.engine.balancer import MIN_LOAD_GAP, Balancer, prefix_block_hashes
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.interfaces import EngineStats
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine_config import EngineConfig
from jaxserve.runner.capacity import data_parallel_lines, plan_capacity
from jaxserve.runner.parallel.mesh import replica_devices
from jaxserve.sampling_params import SamplingParams
from tests.conftest import fixture_dir, run_with_devices

SYSTEM_A = list(range(10, 42))  # two blocks of 16
SYSTEM_B = list(range(100, 132))


def test_prefix_hashes_chain_over_whole_blocks():
    a = prefix_block_hashes([*SYSTEM_A, 7, 8], 16)
    assert len(a) == 2  # the partial block is not hashed
    assert prefix_block_hashes([*SYSTEM_A[:16], 99], 16) == a[:1]
    assert prefix_block_hashes(SYSTEM_A, 16, cache_salt="tenant")[0] != a[0]


def test_a_shared_prefix_goes_to_the_replica_that_took_it():
    balancer = Balancer(2, block_size=16)
    first = balancer.pick([*SYSTEM_A, 1])
    other = balancer.pick([*SYSTEM_B, 1])
    assert other != first  # a new prefix goes to the least loaded replica
    for suffix in range(2, 6):
        assert balancer.pick([*SYSTEM_A, suffix]) == first
        assert balancer.pick([*SYSTEM_B, suffix]) == other
    assert balancer.num_prefix_routed == [4, 4]


def test_the_longest_matching_prefix_wins():
    balancer = Balancer(2, block_size=16)
    shared = SYSTEM_A[:16]
    one = balancer.pick([*shared, *range(200, 216)])  # block 0 shared, block 1 its own
    two = balancer.pick([*shared, *range(300, 316)])  # prefers `one` (block 0), not loaded
    assert two == one
    balancer.release(one, 2)
    balancer.loads[1 - one] = 0
    assert balancer.pick([*shared, *range(200, 216), 5]) == one


def test_a_loaded_replica_gives_its_prefix_up_to_the_least_loaded():
    balancer = Balancer(2, block_size=16)
    home = balancer.pick([*SYSTEM_A, 0])
    for suffix in range(MIN_LOAD_GAP):  # up to the gap the prefix stays home
        assert balancer.pick([*SYSTEM_A, suffix + 1]) == home
    assert balancer.loads[home] - balancer.loads[1 - home] == MIN_LOAD_GAP + 1
    assert balancer.pick([*SYSTEM_A, 99]) == 1 - home  # past it: the least loaded
    balancer.release(home, MIN_LOAD_GAP + 1)
    assert balancer.loads == [1, 0] if home == 1 else [0, 1]


def test_round_robin_and_least_loaded_policies():
    rr = Balancer(3, block_size=16, policy="round-robin")
    assert [rr.pick(SYSTEM_A) for _ in range(4)] == [0, 1, 2, 0]
    least = Balancer(3, block_size=16, policy="least-loaded")
    least.loads = [2, 0, 1]
    assert least.pick(SYSTEM_A, num_seqs=3) == 1 and least.loads == [2, 3, 1]


def test_data_parallel_fields_are_checked():
    with pytest.raises(ValueError, match="data_parallel_size=0 must be >= 1"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 must be in \[0, data_par"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="data_parallel_balancer='nearest' must be one of"):
        EngineConfig(data_parallel_balancer="nearest")


def test_replicas_that_do_not_fit_name_both_sizes():
    devices = jax.devices()[:1] * 4  # four visible devices
    assert replica_devices(2, 2, 1, devices=devices) == devices[2:4]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 needs 6"):
        replica_devices(2, 3, 0, devices=devices)


def test_capacity_lines_count_the_replicas():
    from jaxserve.models.families.registry import load_model_config

    cap = plan_capacity(
        load_model_config(fixture_dir("llama")),
        max_model_len=256,
        device_memory_bytes=1 << 30,
        memory_utilization=0.5,
        num_blocks_override=100,
    )
    assert data_parallel_lines(cap, 1) == []
    lines = data_parallel_lines(cap, 2)
    assert lines[0] == "Data parallel: 2 replicas; KV cache size: 1,600 tokens per replica, " + (
        "3,200 tokens in all"
    )
    assert "6.25x per replica, 12.50x in all" in lines[1]


@dataclasses.dataclass
class FakeReplica:
    """An engine client that answers one token and records what it was asked."""

    rank: int
    config: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    tokenizer: object = None
    max_model_len: int = 256
    vocab_size: int = 320
    dead_error: BaseException | None = None
    is_alive: bool = True
    aborted: list[str] = dataclasses.field(default_factory=list)
    served: list[str] = dataclasses.field(default_factory=list)

    def stats(self) -> EngineStats:
        return EngineStats(self.rank, 1, 0.25 * (self.rank + 1), 10, 5, 0, 7, 3, 0, 100)

    async def generate(self, prompt_token_ids, params, request_id, *args):
        self.served.append(request_id)
        await asyncio.sleep(0)
        yield RequestOutput(request_id, None, list(prompt_token_ids), [], finished=True)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_the_client_streams_from_one_replica_and_sums_the_stats():
    replicas = [FakeReplica(0), FakeReplica(1)]
    engine = DataParallelEngine(replicas, Balancer(2, block_size=16))

    async def run() -> None:
        params = SamplingParams(max_tokens=1)
        for i in range(4):
            async for _ in engine.generate([*SYSTEM_A, i], params, f"a{i}"):
                pass
        stream = engine.generate([*SYSTEM_B, 0], params, "b0")
        await stream.__anext__()  # in flight: the balancer counts it
        assert engine.balancer.loads == [0, 1] or engine.balancer.loads == [1, 0]
        await engine.abort("b0")
        await stream.aclose()
        assert engine.balancer.loads == [0, 0]

    asyncio.run(run())
    home = replicas[0] if replicas[0].served[:1] == ["a0"] else replicas[1]
    assert home.served[:4] == ["a0", "a1", "a2", "a3"]  # sequential: never loaded
    assert [r.aborted for r in replicas if r.aborted] == [["b0"]]
    stats = engine.stats()
    assert stats.num_running == 1 and stats.num_waiting == 2 and stats.num_steps == 200
    assert stats.kv_cache_usage == pytest.approx(0.375)
    assert [s.num_running for s in engine.replica_stats()] == [0, 1]


TWO_REPLICAS = """
import asyncio, json, sys
import jax
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

config = EngineConfig(
    model=sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=4,
    max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=128,
    sampler_variants="compact", warmup=False,
)
a = [int(t) for t in range(10, 34)]  # three blocks shared
b = [int(t) for t in range(200, 224)]
prompts = [a + [50 + i] for i in range(3)] + [b + [60 + i] for i in range(3)]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

async def run(engine, prompts):
    async def one(i, prompt):
        tokens = []
        async for out in engine.generate(prompt, params, f"r{i}"):
            tokens += out.outputs[0].token_ids
        return tokens
    results = []
    for i, prompt in enumerate(prompts):  # one after another: the balancer sees no load
        results.append(await one(i, prompt))
    return results

dp = DataParallelEngine.from_config(
    EngineConfig(**{**config.__dict__, "data_parallel_size": 2})
)
dp.start()
dp_tokens = asyncio.run(run(dp, prompts))
replica_devices = [
    sorted(d.id for d in jax.tree.leaves(r.core.runner.kv_cache)[0].devices())
    for r in dp.replicas
]
stats = [s.__dict__ for s in dp.replica_stats()]
owners = [list(dp.balancer.num_prefix_routed)]

import httpx
from jaxserve.server.app import build_app
from jaxserve.server.background import BackgroundServer
from jaxserve.server.settings import ServerSettings

with BackgroundServer(build_app(dp, ServerSettings(served_model_names=("m",)))) as server:
    body = {"model": "m", "prompt": b + [70], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    health = httpx.get(server.url + "/health").status_code
    metrics = httpx.get(server.url + "/metrics").text
queries = [l for l in metrics.splitlines() if l.startswith("jaxserve:prefix_cache_queries")]
http = dict(tokens=completion["usage"]["completion_tokens"], health=health, queries=queries)
dp.shutdown()
single = AsyncEngine.from_config(config)
single.start()
single_tokens = asyncio.run(run(single, prompts))
single.shutdown()
print(json.dumps(dict(dp=dp_tokens, single=single_tokens, devices=replica_devices,
                      stats=stats, prefix_routed=owners[0], http=http)))
"""


def test_two_replicas_on_two_devices_route_by_prefix_and_match_one_engine():
    out = run_with_devices(TWO_REPLICAS, 2, str(fixture_dir("llama")), timeout=300)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dp"] == result["single"]  # greedy: the same tokens as one engine
    assert all(len(tokens) == 4 for tokens in result["dp"])
    assert result["devices"] == [[0], [1]]  # each replica's KV cache on its own device
    stats = result["stats"]
    # prefix a went to one replica, b to the other: each ran three requests of 25 tokens, and
    # the second and third found the three shared blocks in that replica's prefix cache
    assert [s["prefix_cache_queries"] for s in stats] == [75, 75]
    assert [s["prefix_cache_hits"] for s in stats] == [48, 48]
    assert [s["prompt_tokens"] for s in stats] == [75 - 48, 75 - 48]
    assert result["prefix_routed"] == [2, 2]
    # the unchanged server in front: one more request of prefix b, the replicas' stats summed
    http = result["http"]
    assert http["tokens"] == 4 and http["health"] == 200
    assert [q.split()[-1] for q in http["queries"]] == [str(75 + 75 + 25.0)]


def test_serve_flags_set_the_data_parallel_fields():
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import engine_config_from_args

    argv = ["serve", "-dp", "2", "--data-parallel-balancer", "round-robin"]
    config = engine_config_from_args(build_parser(argv).parse_args(argv))
    assert config.data_parallel_size == 2 and config.data_parallel_rank == 0
    assert config.data_parallel_balancer == "round-robin"
    default = engine_config_from_args(build_parser(["serve"]).parse_args(["serve"]))
    assert default.data_parallel_size == 1 and default.data_parallel_balancer == "prefix"


def test_serve_refuses_more_replicas_than_devices_naming_both_flags(caplog):
    from jaxserve.cli import main

    caplog.set_level(logging.INFO)
    n = len(jax.devices()) + 1
    argv = ["serve", str(fixture_dir("llama")), "-dp", str(n), "--port", "0"]
    assert main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"--data-parallel-size {n} x --tensor-parallel-size 1 needs {n} devices; "
        f"{n - 1} cpu devices are visible"
    ]


def test_capacity_counts_the_replicas(capsys):
    from jaxserve.cli import main

    argv = ["capacity", str(fixture_dir("llama")), "-dp", "4", "--device-memory", "80GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 1, data parallel 4" in out
    per_replica = int(re.search(r"^KV cache size: ([\d,]+) tokens", out, re.M)[1].replace(",", ""))
    assert f"{per_replica:,} tokens per replica, {4 * per_replica:,} tokens in all" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_tokens_all_replicas"] == 4 * plan["kv_cache_tokens"]
