"""Prefix-aware routing against round robin: TTFT of a prefix-heavy workload on two
data-parallel replicas of the demo model (``--data-parallel-size 2``), measured in one run.

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

    python -m benchmarks.prefix_routing --out prefix_routing.json
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

from jaxserve.engine.balancer import Balancer
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

POLICIES = ("prefix", "round-robin")


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


async def run_round(
    engine: DataParallelEngine, prompts: list[list[int]], args: argparse.Namespace, tag: str
) -> list[float]:
    """Send the prompts at Poisson arrivals; each request's TTFT in seconds."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(7)

    async def one(i: int, prompt: list[int]) -> float:
        sent = time.perf_counter()
        first = None
        async for _ in engine.generate(prompt, params, f"{tag}-{i}"):
            first = time.perf_counter() if first is None else first
        assert first is not None
        return first - sent

    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(i, prompt)))
        await asyncio.sleep(rng.expovariate(args.rate))
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def round_result(ttfts: list[float], before: list, after: list) -> dict:
    """One round's TTFT statistics and what the replicas' prefix caches saw meanwhile."""
    pairs = list(zip(after, before, strict=True))
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs]
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs)
    return {
        "mean_s": statistics.fmean(ttfts),
        "p50_s": percentile(ttfts, 0.5),
        "p90_s": percentile(ttfts, 0.9),
        "hit_rate": hits / sum(queries),
        "prompt_tokens_per_replica": queries,
    }


async def measure(engine: DataParallelEngine, args: argparse.Namespace) -> dict[str, list[dict]]:
    rounds: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    warmup = argparse.Namespace(**{**vars(args), "requests_per_prefix": 2})
    await run_round(engine, workload(warmup, -1), warmup, "warmup")  # first steps, unmeasured
    for r in range(args.rounds):
        for k, policy in enumerate(POLICIES if r % 2 == 0 else POLICIES[::-1]):
            engine.balancer = Balancer(2, engine.config.block_size, policy)
            before = engine.replica_stats()
            ttfts = await run_round(engine, workload(args, 2 * r + k), args, f"{policy}-{r}")
            result = round_result(ttfts, before, engine.replica_stats())
            rounds[policy].append(result)
            ms = {key: 1e3 * result[key] for key in ("mean_s", "p50_s", "p90_s")}
            print(
                f"round {r} {policy:12s} mean {ms['mean_s']:7.1f} ms  p50 {ms['p50_s']:7.1f}  "
                f"p90 {ms['p90_s']:7.1f}  hit rate {result['hit_rate']:.2f}  "
                f"prompt tokens per replica {result['prompt_tokens_per_replica']}",
                flush=True,
            )
    return rounds


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
    add("--out", default=None, help="write the rounds and the summary as JSON here")
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        data_parallel_size=2,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        num_gpu_blocks_override=2048,
        serve_while_compiling=False,
    )
    engine = DataParallelEngine.from_config(config)
    engine.start()
    try:
        rounds = asyncio.run(measure(engine, args))
    finally:
        engine.shutdown()
    table = summary(rounds)
    print("\npolicy        mean TTFT   p50 TTFT   p90 TTFT   prefix-cache hit rate (medians)")
    for policy, row in table.items():
        print(f"{policy:12s} {1e3 * row['mean_s']:8.1f} ms {1e3 * row['p50_s']:7.1f} ms "
              f"{1e3 * row['p90_s']:7.1f} ms   {row['hit_rate']:.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds, "summary": table}, f, indent=2)


if __name__ == "__main__":
    main()
