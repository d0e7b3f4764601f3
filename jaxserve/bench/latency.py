"""``jaxserve bench latency``: how long one batch takes, offline, as vLLM's ``bench latency``.

A batch of ``--batch-size`` random-token prompts (``--input-len`` tokens each, EOS ignored, so
each produces exactly ``--output-len`` tokens) goes through ``jaxserve.LLM.generate``, in this
process, ``--num-iters-warmup`` times unmeasured and then ``--num-iters`` times measured; each
iteration has fresh prompts, so the prefix cache never serves one. ``--batch-sizes 1,8,64``
sweeps several batch sizes with one engine. Per batch size it reports, in seconds:

- latency: ``generate`` called -> every request of the batch finished (avg and p10 ... p99);
- TTFT: ``generate`` called -> the last request of the batch has its first token (the
  engine's ``first_token_time``), i.e. the batch's prefill;
- TPOT: ``(latency - TTFT) / (output_len - 1)``, one decode step of the batch;
- output tokens/s: ``batch_size * output_len / avg latency``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.bench.throughput import add_engine_arguments, make_llm, make_prompts
from jaxserve.engine_config import BASE_MAX_NUM_SEQS

if TYPE_CHECKING:
    import jaxserve

PERCENTAGES = (10, 25, 50, 75, 90, 99)  # vLLM's


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]``; each a positive integer."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive integers like 1,8,64"
        )
    return sizes


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    parser.add_argument(
        "--batch-sizes",
        type=parse_batch_sizes,
        default=None,
        help="sweep these batch sizes in one run, e.g. 1,8,64 (replaces --batch-size)",
    )
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="unmeasured batches")
    parser.add_argument("--num-iters", type=int, default=30, help="measured batches")
    parser.add_argument("--output-json", default=None, help="write every number here")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the flags, in the user's words, or None."""
    for flag, minimum in (
        ("input_len", 1),
        ("output_len", 1),
        ("num_iters", 1),
        ("num_iters_warmup", 0),
        ("batch_size", 1),
    ):
        value = getattr(args, flag)
        if value < minimum:
            return f"--{flag.replace('_', '-')} must be at least {minimum} (got {value})"
    largest = max(args.batch_sizes or [args.batch_size])
    if args.max_num_seqs is not None and largest > args.max_num_seqs:
        return (
            f"batch size {largest} exceeds --max-num-seqs {args.max_num_seqs}: the batch would "
            "not run at once; raise --max-num-seqs"
        )
    length = args.input_len + args.output_len
    if args.max_model_len is not None and length > args.max_model_len:
        return (
            f"--input-len {args.input_len} + --output-len {args.output_len} = {length} exceeds "
            f"--max-model-len {args.max_model_len}"
        )
    return None


def time_batch(llm: jaxserve.LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """One batch through ``llm.generate``: (latency, TTFT) in seconds."""
    import jaxserve

    params = jaxserve.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    start_wall = time.time()  # the engine stamps first tokens with time.time()
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    latency = time.perf_counter() - start
    first_tokens = []
    for out in outputs:
        produced = len(out.outputs[0].token_ids)
        first = out.metrics.first_token_time if out.metrics is not None else None
        if out.error or produced != output_len or first is None:
            raise RuntimeError(
                f"request {out.request_id} produced {produced} of {output_len} tokens"
                + (f": {out.error}" if out.error else "")
            )
        first_tokens.append(first)
    return latency, max(first_tokens) - start_wall


def summarize(batch_size: int, output_len: int, timings: list[tuple[float, float]]) -> dict:
    """One batch size's numbers (seconds), with vLLM's key names for the latency."""
    latencies = np.array([t[0] for t in timings])
    ttfts = np.array([t[1] for t in timings])
    result: dict = {
        "batch_size": batch_size,
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTAGES},
        "avg_ttft": float(ttfts.mean()),
        "ttfts": ttfts.tolist(),
        "ttft_percentiles": {str(p): float(np.percentile(ttfts, p)) for p in PERCENTAGES},
        "avg_tpot": None,
        "tpots": None,
        "output_tokens_per_s": batch_size * output_len / float(latencies.mean()),
    }
    if output_len > 1:
        tpots = (latencies - ttfts) / (output_len - 1)
        result.update(avg_tpot=float(tpots.mean()), tpots=tpots.tolist())
    return result


def spec_decode_numbers(before: Any, after: Any) -> dict:
    """Speculative decoding between two ``SpecDecodeStats``: drafts, tokens drafted and
    accepted, and the mean acceptance length (1 + accepted drafts per draft)."""
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def print_batch(result: dict) -> None:
    print(f"\nBatch size {result['batch_size']}:")
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    tpot = result["avg_tpot"]
    print(
        f"Avg TTFT: {result['avg_ttft'] * 1e3:.2f} ms, avg TPOT: "
        + (f"{tpot * 1e3:.2f} ms" if tpot is not None else "- (one output token)")
        + f", output tokens/s: {result['output_tokens_per_s']:.1f}"
    )
    if "mean_acceptance_length" in result:
        print(
            f"Mean acceptance length: {result['mean_acceptance_length']:.2f} "
            f"({result['spec_num_accepted_tokens']} of {result['spec_num_draft_tokens']} "
            "drafted tokens accepted)"
        )


def print_table(report: dict) -> None:
    print(
        f"\nOffline latency: {report['input_len']} in / {report['output_len']} out, "
        f"{report['num_iters']} iterations after {report['num_iters_warmup']} warm-up, EOS ignored"
    )
    print(
        f"{'batch':>5s} {'avg ms':>9s} {'p50 ms':>9s} {'p99 ms':>9s} {'TTFT ms':>9s} "
        f"{'TPOT ms':>9s} {'out tok/s':>10s}"
    )
    for r in report["results"]:
        tpot = f"{r['avg_tpot'] * 1e3:9.2f}" if r["avg_tpot"] is not None else f"{'-':>9s}"
        print(
            f"{r['batch_size']:5d} {r['avg_latency'] * 1e3:9.2f} "
            f"{r['percentiles']['50'] * 1e3:9.2f} {r['percentiles']['99'] * 1e3:9.2f} "
            f"{r['avg_ttft'] * 1e3:9.2f} {tpot} "
            f"{r['output_tokens_per_s']:10.1f}"
        )


def run_latency(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem is not None:
        print(f"jaxserve bench latency: error: {problem}", file=sys.stderr)
        return 2
    batch_sizes = args.batch_sizes or [args.batch_size]
    if args.max_num_seqs is None and max(batch_sizes) > BASE_MAX_NUM_SEQS:
        args.max_num_seqs = max(batch_sizes)  # a device's default may hold fewer at once
    llm = make_llm(args)  # a model that does not fit: one line, before a weight is made
    vocab = llm.engine.vocab_size
    seed = args.seed
    results = []
    for batch_size in batch_sizes:
        timings = []
        for i in range(args.num_iters_warmup + args.num_iters):
            if i == args.num_iters_warmup:
                spec_before = llm.engine.spec_stats.copy()
            prompts = make_prompts(batch_size, args.input_len, vocab, seed)
            seed += 1  # fresh prompts each time: no prefix-cache hits
            timing = time_batch(llm, prompts, args.output_len)
            if i >= args.num_iters_warmup:
                timings.append(timing)
        results.append(summarize(batch_size, args.output_len, timings))
        if llm.engine.proposer is not None:  # speculative decoding: over the measured batches
            results[-1].update(spec_decode_numbers(spec_before, llm.engine.spec_stats))
        print_batch(results[-1])
    report = {
        "model": args.model,
        "load_format": args.load_format,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters_warmup": args.num_iters_warmup,
        "num_iters": args.num_iters,
        "batch_sizes": batch_sizes,
        "max_num_seqs": llm.engine.config.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_compiled_shapes": llm.engine.num_compiled_shapes,
        "speculative_config": getattr(args, "speculative_config", None),
        "results": results,
    }
    print_table(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_latency_arguments(parser)
    return run_latency(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
