"""Prefix-aware routing against round robin: TTFT of a prefix-heavy workload on two
data-parallel replicas of the demo model (``--data-parallel-size 2``) and, with ``--ray``, on
two Ray Serve replicas (Ray's power-of-two router against ``request_router=prefix``), measured
in one run.

Two replicas (``DataParallelEngine``, each on its own virtual CPU device unless the process
already sees accelerators) serve rounds of the same workload: ``--num-prefixes`` shared system
prompts of ``--prefix-tokens`` tokens, ``--requests-per-prefix`` requests each with a short
suffix of its own, in a shuffled order, arriving at ``--rate`` requests per second (Poisson,
seeded) with ``--max-tokens`` greedy tokens each. Each round uses fresh system prompts, so no
round finds another's blocks in a cache. An unmeasured round runs first; then the policies
alternate round by round (``--rounds`` of each), since the machine's load drifts. The table
gives each policy's medians over its rounds of the per-round mean, p50 and p90 TTFT (time from
``generate`` to the first token) and of its prefix-cache hit rate; each round's line also shows
the prompt tokens each replica was sent.

With ``--ray`` the same process also starts a local Ray (``serve.run(build_app(...))``, as
``tests/test_ray_serve.py`` does) with two applications of two CPU replicas each, the same
engine flags, one per router (``ray-power-of-two``, ``ray-prefix``); their requests go through
a ``DeploymentHandle`` to ``JaxserveReplica.generate`` (no HTTP), and their hit rate is the
prompt tokens found in a prefix cache (each request's ``num_cached_tokens``) over all prompt
tokens. The arms then alternate four ways, each round starting with the next arm.

    python -m benchmarks.prefix_routing --ray --out prefix_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

if "jax" not in sys.modules:  # two virtual CPU devices, fixed when JAX's backend starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

from collections.abc import Callable
from typing import Any

from jaxserve.engine.balancer import Balancer
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

POLICIES = ("prefix", "round-robin")
RAY_ROUTERS = ("power-of-two", "prefix")
ENGINE_FLAGS = {  # the replicas' engine, in both arms
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "num_gpu_blocks_override": 2048,
    "serve_while_compiling": False,
}


def workload(args: argparse.Namespace, round_index: int) -> list[list[int]]:
    """The round's prompts in arrival order: fresh system prompts, each with its suffixes."""
    rng = random.Random(1000 + round_index)
    low, high = 5, 2000  # ordinary token ids of the demo model's vocabulary
    systems = [
        [rng.randrange(low, high) for _ in range(args.prefix_tokens)]
        for _ in range(args.num_prefixes)
    ]
    prompts = [
        system + [rng.randrange(low, high) for _ in range(args.suffix_tokens)]
        for system in systems
        for _ in range(args.requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


def engine_sender(engine: DataParallelEngine, args: argparse.Namespace, tag: str) -> Callable:
    """One request to the data-parallel engine: its TTFT in seconds."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[float, str, int]:
        sent = time.perf_counter()
        first = None
        async for _ in engine.generate(prompt, params, f"{tag}-{i}"):
            first = time.perf_counter() if first is None else first
        assert first is not None
        return first - sent, "", 0

    return one


def ray_sender(handle: Any, args: argparse.Namespace) -> Callable:
    """One request through a Ray Serve handle: its TTFT, replica and prompt tokens cached."""
    from jaxserve.integrations.ray_router import PromptRequest

    async def one(i: int, prompt: list[int]) -> tuple[float, str, int]:
        request = PromptRequest(prompt, max_tokens=args.max_tokens, ignore_eos=True)
        sent = time.perf_counter()
        first, last = None, None
        async for item in handle.options(stream=True).generate.remote(request):
            first = time.perf_counter() if first is None else first
            last = item
        assert first is not None and last is not None
        return first - sent, last["replica"], last["num_cached_tokens"]

    return one


async def run_round(
    send: Callable, prompts: list[list[int]], args: argparse.Namespace
) -> list[tuple[float, str, int]]:
    """Send the prompts at Poisson arrivals; each request's (TTFT in seconds, replica, prompt
    tokens found cached)."""
    rng = random.Random(7)
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(send(i, prompt)))
        await asyncio.sleep(rng.expovariate(args.rate))
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def round_result(ttfts: list[float], queries: list[int], hits: int) -> dict:
    """One round's TTFT statistics and what the replicas' prefix caches saw."""
    return {
        "mean_s": statistics.fmean(ttfts),
        "p50_s": percentile(ttfts, 0.5),
        "p90_s": percentile(ttfts, 0.9),
        "hit_rate": hits / sum(queries),
        "prompt_tokens_per_replica": queries,
    }


async def engine_round(
    engine: DataParallelEngine, policy: str, prompts: list[list[int]], args, tag: str
) -> dict:
    """A round on the data-parallel engine under ``policy``; hits from the replicas' stats."""
    engine.balancer = Balancer(2, engine.config.block_size, policy)
    before = engine.replica_stats()
    results = await run_round(engine_sender(engine, args, tag), prompts, args)
    pairs = list(zip(engine.replica_stats(), before, strict=True))
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs]
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs)
    return round_result([t for t, _, _ in results], queries, hits)


async def ray_round(handle: Any, prompts: list[list[int]], args) -> dict:
    """A round through a Ray Serve handle; hits from each request's cached prompt tokens."""
    results = await run_round(ray_sender(handle, args), prompts, args)
    per_replica: dict[str, int] = {}
    for (_, replica, _), prompt in zip(results, prompts, strict=True):
        per_replica[replica] = per_replica.get(replica, 0) + len(prompt)
    hits = sum(cached for _, _, cached in results)
    return round_result([t for t, _, _ in results], sorted(per_replica.values()), hits)


async def measure(
    engine: DataParallelEngine, handles: dict[str, Any], args: argparse.Namespace
) -> dict[str, list[dict]]:
    """Rounds of every arm, interleaved: the data-parallel policies, then the Ray routers."""
    arms = [f"dp-{p}" for p in POLICIES] + [f"ray-{r}" for r in handles]
    rounds: dict[str, list[dict]] = {arm: [] for arm in arms}
    warmup = argparse.Namespace(**{**vars(args), "requests_per_prefix": 2})
    for arm in arms:  # first steps of every replica, unmeasured
        await arm_round(engine, handles, arm, workload(warmup, -1 - arms.index(arm)), warmup, "w")
    for r in range(args.rounds):
        for k in range(len(arms)):
            arm = arms[(r + k) % len(arms)]
            prompts = workload(args, len(arms) * r + k)
            result = await arm_round(engine, handles, arm, prompts, args, f"{arm}-{r}")
            rounds[arm].append(result)
            ms = {key: 1e3 * result[key] for key in ("mean_s", "p50_s", "p90_s")}
            print(
                f"round {r} {arm:18s} mean {ms['mean_s']:7.1f} ms  p50 {ms['p50_s']:7.1f}  "
                f"p90 {ms['p90_s']:7.1f}  hit rate {result['hit_rate']:.2f}  "
                f"prompt tokens per replica {result['prompt_tokens_per_replica']}",
                flush=True,
            )
    return rounds


async def arm_round(engine, handles: dict[str, Any], arm: str, prompts, args, tag: str) -> dict:
    if arm.startswith("dp-"):
        return await engine_round(engine, arm.removeprefix("dp-"), prompts, args, tag)
    return await ray_round(handles[arm.removeprefix("ray-")], prompts, args)


def start_ray(args: argparse.Namespace) -> dict[str, Any]:
    """A local Ray with one application of two CPU replicas per router; their handles."""
    import ray
    from ray import serve

    from jaxserve.integrations.ray import build_app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    handles = {}
    for router in RAY_ROUTERS:
        app_args = {
            "name": f"jaxserve-{router}",
            "accelerator": "cpu",
            "num_replicas": "2",
            "request_router": router,
            **({"model": args.model} if args.model else {}),
            **{key: str(value).lower() for key, value in ENGINE_FLAGS.items()},
        }
        handles[router] = serve.run(build_app(app_args), name=router, route_prefix=f"/{router}")
    return handles


def summary(rounds: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each policy's medians over its rounds."""
    return {
        policy: {
            key: statistics.median(r[key] for r in results)
            for key in ("mean_s", "p50_s", "p90_s", "hit_rate")
        }
        for policy, results in rounds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="", help="model directory; default: the demo model")
    add("--num-prefixes", type=int, default=8)
    add("--prefix-tokens", type=int, default=200)
    add("--suffix-tokens", type=int, default=8)
    add("--requests-per-prefix", type=int, default=8)
    add("--max-tokens", type=int, default=8)
    add("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    add("--rounds", type=int, default=3, help="rounds of each policy, interleaved")
    add("--ray", action="store_true", help="also the Ray Serve arms (two routers)")
    add("--out", default=None, help="write the rounds and the summary as JSON here")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, data_parallel_size=2, **ENGINE_FLAGS)
    handles = start_ray(args) if args.ray else {}
    engine = DataParallelEngine.from_config(config)
    engine.start()
    try:
        rounds = asyncio.run(measure(engine, handles, args))
    finally:
        engine.shutdown()
        if args.ray:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    table = summary(rounds)
    print("\narm                mean TTFT   p50 TTFT   p90 TTFT   prefix-cache hit rate (medians)")
    for policy, row in table.items():
        print(f"{policy:18s} {1e3 * row['mean_s']:8.1f} ms {1e3 * row['p50_s']:7.1f} ms "
              f"{1e3 * row['p90_s']:7.1f} ms   {row['hit_rate']:.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "summary": table}, f, indent=2)


if __name__ == "__main__":
    main()
