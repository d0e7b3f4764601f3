"""Greedy agreement of a KV cache dtype with the bf16 cache, teacher-forced, through jaxserve.LLM.

Two runs, one process each (each engine takes the device's memory):

    python -m benchmarks.greedy_agreement --kv-cache-dtype auto --save ref.npz
    python -m benchmarks.greedy_agreement --kv-cache-dtype fp8 --reference ref.npz

The first generates greedy continuations of random prompts and records, at every position of
prompt + continuation, the top-1 token, its margin over the top-2 and the logprob of the next
token (prompt logprobs). The second feeds the same ids and reports the share of positions whose
top-1 token agrees, among those where the reference's top-2 margin is at least 0.1 and 0.25
(near ties flip with any rounding), and the logprob error. The Llama-3-8B shape with dummy
weights by default; ``--model DIR --load-format auto`` for a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import jaxserve
from jaxserve.config import builtin_config_dir
from jaxserve.engine_config import KV_CACHE_DTYPES

MARGINS = (0.1, 0.25)


def teacher_forced(llm: jaxserve.LLM, sequences: list[list[int]]) -> dict[str, np.ndarray]:
    """top1, margin and next-token logprob at every position after the first, concatenated."""
    params = jaxserve.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    top1, margin, chosen = [], [], []
    for ids, out in zip(sequences, outputs, strict=True):
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            ranked = sorted(entry.values(), key=lambda lp: lp.rank)
            top1.append(max(entry, key=lambda t: entry[t].logprob))
            margin.append(ranked[0].logprob - ranked[1].logprob)
            chosen.append(entry[ids[position]].logprob)
    return {"top1": np.asarray(top1), "margin": np.asarray(margin), "chosen": np.asarray(chosen)}


def compare(reference: dict, run: dict) -> dict:
    error = np.abs(run["chosen"] - reference["chosen"])
    result: dict = {
        "positions": int(len(error)),
        "logprob_error_mean": float(error.mean()),
        "logprob_error_max": float(error.max()),
    }
    for m in MARGINS:
        clear = reference["margin"] >= m
        result[f"steps_margin_{m}"] = int(clear.sum())
        agree = run["top1"][clear] == reference["top1"][clear]
        result[f"agreement_margin_{m}"] = float(agree.mean()) if clear.any() else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--save", type=Path, help="reference run: write ids and results here")
    parser.add_argument("--reference", type=Path, help="compare against this saved run")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the llama fixture, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.model = str(Path(__file__).parents[1] / "tests/fixtures/models/llama")
        args.load_format, args.num_prompts, args.input_len, args.output_len = "auto", 2, 20, 8
    if (args.save is None) == (args.reference is None):
        parser.error("give exactly one of --save (the reference run) and --reference")
    llm = jaxserve.LLM(
        args.model,
        load_format=args.load_format,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype="bfloat16",
        max_model_len=args.input_len + args.output_len + 1,  # + the teacher-forced pass token
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=2048,
        warmup=False,
    )
    if args.save is not None:
        rng = np.random.default_rng(0)
        vocab = min(llm.engine.vocab_size, 30000)
        prompts = rng.integers(100, vocab, size=(args.num_prompts, args.input_len)).tolist()
        greedy = jaxserve.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, greedy, use_tqdm=False)
        sequences = [
            p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)
        ]
        np.savez(args.save, sequences=np.asarray(sequences), **teacher_forced(llm, sequences))
        print(f"saved {len(sequences)} sequences of {len(sequences[0])} tokens to {args.save}")
        return 0
    saved = np.load(args.reference)
    sequences = saved["sequences"].tolist()
    result = {"kv_cache_dtype": args.kv_cache_dtype, "model": args.model}
    result.update(compare(dict(saved), teacher_forced(llm, sequences)))
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
