"""Loading adapters while serving (issue 39): the neighbours' inter-token latency, quiet and
while adapters load.

A server (``jaxserve launch --enable-lora``, loading at run time allowed, its background
compile ended) streams ``--neighbours`` base-model requests at once (``--input-len`` random
prompt tokens, ``--output-len`` generated, greedy, EOS ignored), twice, each time beside
``--loads`` short streamed requests spaced over the run: on the base model in the quiet run;
in the loading run each on a new adapter posted to ``/v1/load_lora_adapter`` just before it
(its weights read and checked on the host, then written into a slot on the device). The two
runs differ by the loads only. Reported: the neighbours' ITL p50 / p99 / max in each run and
the p99's ratio, loading over quiet (target at most 1.2), and each load's seconds.
The adapters are random rank-``--rank`` PEFT directories on every projection
(``benchmarks/lora.py``'s), written first; with ``--loads`` above ``--max-loras`` the later ones
take the slots of the earlier.

    python -m benchmarks.lora_load --out lora_load.json          # Llama-3-8B shape, dummy
    python -m benchmarks.lora_load --smoke --out lora_load.json    # the fixture model, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import ROOT
from benchmarks.lora import write_adapter
from jaxserve.bench.datasets import SampleRequest
from jaxserve.bench.serve import ServeBenchConfig, send_request
from jaxserve.bench.stats import RequestOutput
from jaxserve.models.families.registry import load_model_config


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    """The server, once its /health answers and its background compile has ended (its log in
    ``log_path``): a compile beside the runs would be part of what they measure."""
    command = [
        sys.executable, "-m", "jaxserve.cli", "launch", args.model,
        "--port", str(args.port),
        "--max-model-len", str(args.max_model_len),
        "--enable-lora", "--max-loras", str(args.max_loras),
        "--max-lora-rank", str(args.rank),
        "--served-model-name", "base",
    ]  # fmt: skip
    if args.dummy:
        command += ["--load-format", "dummy"]
    env = dict(os.environ, JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.start_timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start in {args.start_timeout} s")
        log = log_path.read_text(errors="replace")
        if "Compiled every bucket" in log or "tokens failed" in log:
            try:
                if httpx.get(f"{url(args)}/health", timeout=1).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
        time.sleep(0.2)


def url(args: argparse.Namespace) -> str:
    return f"http://127.0.0.1:{args.port}"


def prompts(args: argparse.Namespace, count: int, seed: int, output_len: int) -> list:
    """Random token-id prompts, new ones for each run (the same again would come from the
    prefix cache)."""
    vocab = load_model_config(args.model).vocab_size
    rng = np.random.default_rng(seed)
    return [
        SampleRequest(rng.integers(10, vocab, args.input_len).tolist(), args.input_len, output_len)
        for _ in range(count)
    ]


async def stream_all(
    client: httpx.AsyncClient, config: ServeBenchConfig, model: str, samples: list
) -> list[RequestOutput]:
    t0 = time.perf_counter()
    return list(
        await asyncio.gather(*(send_request(client, config, model, s, t0) for s in samples))
    )


async def side_requests(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    args: argparse.Namespace,
    adapters: list[Path] | None,
    count: int,
    spacing: float,
) -> list[dict[str, Any]]:
    """``count`` short streamed requests, ``spacing`` seconds apart: each on a new adapter
    posted just before it (``adapters``), or on the base model (None: the same requests
    without the loads, so that a run with loads differs from one without by the loads only)."""
    rows = []
    for i in range(count):
        await asyncio.sleep(spacing)
        name, start = "base", time.perf_counter()
        if adapters is not None:
            name = f"load{i}"
            response = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[i])}
            )
            if response.status_code != 200:
                raise RuntimeError(f"loading {name}: HTTP {response.status_code} {response.text}")
        posted = time.perf_counter() - start
        (sample,) = prompts(args, 1, 1000 + i, 8)
        out = await send_request(client, config, name, sample, start)
        if not out.success:
            raise RuntimeError(f"the request on {name} failed: {out.error}")
        rows.append({"model": name, "load_s": posted, "first_token_s": out.ttft})
        if adapters is not None:
            print(f"loaded {name} in {posted:.3f} s, its first token {out.ttft:.3f} s", flush=True)
    return rows


async def with_side_requests(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    args: argparse.Namespace,
    seed: int,
    adapters: list[Path] | None,
    spacing: float,
) -> tuple[list[RequestOutput], list[dict[str, Any]], float]:
    """The neighbours streamed while ``side_requests`` run: (their outputs, the side rows,
    the neighbours' seconds)."""
    start = time.perf_counter()
    samples = prompts(args, args.neighbours, seed, args.output_len)
    neighbours = asyncio.create_task(stream_all(client, config, "base", samples))
    side = await side_requests(client, config, args, adapters, args.loads, spacing)
    outputs = await neighbours
    return outputs, side, time.perf_counter() - start


def itl_stats(outputs: list[RequestOutput]) -> dict[str, float]:
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} neighbours failed: {failed[0]}")
    itls = sorted(1e3 * gap for o in outputs for gap in o.itls)
    return {
        "itl_p50_ms": statistics.median(itls),
        "itl_p99_ms": float(np.percentile(itls, 99)),
        "itl_max_ms": itls[-1],
        "num_itls": len(itls),
    }


async def run(args: argparse.Namespace, adapters: list[Path]) -> dict[str, Any]:
    config = ServeBenchConfig(
        base_url=url(args), ignore_eos=True, show_progress=False, scrape_metrics=False
    )
    async with httpx.AsyncClient(base_url=url(args), timeout=600) as client:
        # Warm: the base model's shapes, and one adapter loaded and run (what the first load
        # compiles, if anything, is not the loads' cost); then the neighbours alone, timed.
        await stream_all(client, config, "base", prompts(args, args.neighbours, 1, 16))
        await side_requests(client, config, args, adapters[-1:], 1, 0.0)
        start = time.perf_counter()
        await stream_all(client, config, "base", prompts(args, args.neighbours, 2, 16))
        spacing = (time.perf_counter() - start) * args.output_len / 16 / (args.loads + 1)
        quiet, _, quiet_s = await with_side_requests(client, config, args, 3, None, spacing)
        loading, loads, loading_s = await with_side_requests(
            client, config, args, 4, adapters, spacing
        )
    result = {"quiet": itl_stats(quiet), "loading": itl_stats(loading), "loads": loads}
    result["quiet"]["seconds"], result["loading"]["seconds"] = quiet_s, loading_s
    result["p99_ratio"] = result["loading"]["itl_p99_ms"] / result["quiet"]["itl_p99_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "jaxserve/assets/configs/llama-3-8b"))
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--neighbours", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--smoke", action="store_true", help="the fixture model, tiny, on the CPU")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--work-dir", default=None, help="where the adapters are written")
    parser.add_argument("--out", default="lora_load.json")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.dummy = str(ROOT / "tests/fixtures/models/llama"), False
        args.neighbours, args.input_len, args.output_len, args.loads = 4, 16, 48, 2
        args.rank, args.max_model_len, args.max_loras = 4, 128, 2
    if not args.port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxserve-lora-load-"))
    adapters = [work / f"adapter{i}" for i in range(args.loads + 1)]  # the last warms up
    for seed, path in enumerate(adapters):
        write_adapter(path, args.model, args.rank, seed)
    server = start_server(args, work / "server.log")
    try:
        result = asyncio.run(run(args, adapters))
    finally:
        server.terminate()
        server.wait(60)
    result["args"] = vars(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{'neighbours':<10} {'ITL p50 ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for run_name in ("quiet", "loading"):
        row = result[run_name]
        print(
            f"{run_name:<10} {row['itl_p50_ms']:10.2f} {row['itl_p99_ms']:8.2f} "
            f"{row['itl_max_ms']:8.2f}"
        )
    loads = [row["load_s"] for row in result["loads"]]
    print(
        f"p99 loading / quiet: {result['p99_ratio']:.3f} (target <= 1.2); {len(loads)} loads, "
        f"{statistics.median(loads):.3f} s median"
    )


if __name__ == "__main__":
    main()
