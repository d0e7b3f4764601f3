"""Embeddings throughput through ``LLM.embed`` against the compute roofline (issue 40).

10,000 texts of 256 random token ids each, dummy bf16 weights, with two models:

- ``qwen3``: a Qwen3-Embedding-0.6B-shaped decoder
  (``jaxserve/assets/configs/qwen3-embedding-0.6b``: hidden 1024, 28 layers, 16 / 8 heads of
  128, intermediate 3072, vocabulary 151,669, tied embeddings; last-token pooling and
  Normalize from its sentence-transformers files), served by the decoder's pooling runner
  (paged attention kernel, a KV cache);
- ``bge``: a BGE-large-en-v1.5-shaped BERT (``jaxserve/assets/configs/bge-large-en-v1.5``:
  hidden 1024, 24 layers, 16 heads, intermediate 4096, vocabulary 30,522, 512 positions; CLS
  pooling and Normalize), served by the encoder runner (``runner/encoder_runner.py``).

What is counted (printed with the results): FLOPs = 2 x non-embedding parameters x tokens
(every matmul weight and bias of the layers and the final norm; the token, position and type
embeddings are gathers, and a pooling runner multiplies by no LM head) + attention FLOPs
(QK^T and PV: 4 x L^2 x heads x head_dim per layer and text for the encoder's bidirectional
attention, half that for the decoder's causal attention, which the kernel skips). The share of
the roofline is FLOPs / seconds / 989e12 (H200 dense bf16). The timed run follows an untimed
one of its steps' shapes (one full step's texts and the last, partial step's: a shape's first
run took 190-240 ms on an H100, 2026-12-07, a start-up cost, not throughput); the start
(weights, warm-up compile) is reported apart.

    python -m benchmarks.embeddings --out X.json            # on the H200
    python -m benchmarks.embeddings --num-texts 64 --text-len 32 --max-num-batched-tokens 256 \\
        --max-model-len 64 --qwen3-model tests/fixtures/embeddings/qwen3_last \\
        --bge-model tests/fixtures/encoders/bert_embed --dtype float32 --out /tmp/e.json  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.engine.step_log import STEP_LOG_ENV

H200_BF16_FLOPS = 989e12
PROFILE_STEPS = 4  # steps traced with --profile-dir
CONFIGS = Path(__file__).resolve().parent.parent / "jaxserve" / "assets" / "configs"


def decoder_counts(config: dict[str, Any]) -> tuple[int, float]:
    """(non-embedding parameters, attention FLOPs per token pair and layer (causal: halved))."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = (
        hidden * heads * head_dim  # q
        + 2 * hidden * kv * head_dim  # k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # the two RMSNorms
        + (2 * head_dim if config.get("model_type") == "qwen3" else 0)  # q / k norms
    )
    params = config["num_hidden_layers"] * per_layer + hidden  # + the final norm
    return params, 0.5 * 4 * heads * head_dim


def encoder_counts(config: dict[str, Any]) -> tuple[int, float]:
    """(non-embedding parameters, attention FLOPs per token pair and layer (bidirectional))."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    per_layer = 4 * (hidden * hidden + hidden) + 2 * hidden * inter + inter + hidden + 4 * hidden
    params = config["num_hidden_layers"] * per_layer + 2 * hidden  # + the embeddings' LayerNorm
    return params, 4 * hidden


def run_model(name: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    import jaxserve

    raw = json.loads((model / "config.json").read_text())
    is_bert = raw.get("model_type") in ("bert", "xlm-roberta")
    params, attention_per_pair = (encoder_counts if is_bert else decoder_counts)(raw)
    layers = raw["num_hidden_layers"]
    if args.step_log_dir:  # each step's host spans against its wait for the device
        os.environ[STEP_LOG_ENV] = str(Path(args.step_log_dir) / f"{name}_steps.jsonl")
    started = time.perf_counter()
    llm = jaxserve.LLM(
        str(model),
        runner="pooling",
        load_format="dummy",
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
    )
    start_s = time.perf_counter() - started
    rng = np.random.default_rng(0)
    low = 1000 if raw["vocab_size"] > 2000 else 5  # clear of the special tokens
    texts = rng.integers(low, raw["vocab_size"], (args.num_texts, args.text_len)).tolist()
    per_step = max(1, args.max_num_batched_tokens // args.text_len)
    # untimed: each of the timed run's step shapes run once (a full step, the partial last)
    llm.embed(texts[: per_step + args.num_texts % per_step], use_tqdm=False)
    steps_before = llm.engine.num_steps
    t0 = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    steps = llm.engine.num_steps - steps_before  # the timed run's, before any traced step
    assert len(outputs) == args.num_texts and len(outputs[0].outputs.embedding) > 0
    if args.profile_dir:  # a few steps traced, apart from the timed run: where the time goes
        import jax

        with jax.profiler.trace(str(Path(args.profile_dir) / name), create_perfetto_trace=True):
            llm.embed(texts[: PROFILE_STEPS * per_step], use_tqdm=False)
    tokens = args.num_texts * args.text_len
    linear = 2 * params * tokens
    attention = attention_per_pair * args.text_len**2 * layers * args.num_texts
    flops = linear + attention
    result = {
        "model": name,
        "config": str(model),
        "runner": "encoder" if is_bert else "decoder pooling",
        "texts": args.num_texts,
        "text_len": args.text_len,
        "seconds": seconds,
        "steps": steps,
        "texts_per_s": args.num_texts / seconds,
        "tokens_per_s": tokens / seconds,
        "non_embedding_params": params,
        "flops_linear": linear,
        "flops_attention": attention,
        "attention_counted": "bidirectional" if is_bert else "causal (half of L^2)",
        "achieved_tflops": flops / seconds / 1e12,
        "roofline_share": flops / seconds / args.peak_flops,
        "start_s": start_s,
    }
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--models", default="qwen3,bge", help="comma list of qwen3, bge")
    parser.add_argument(
        "--profile-dir",
        default=None,
        help=f"after the timed run, trace {PROFILE_STEPS} steps of each model here (DIR/NAME)",
    )
    parser.add_argument(
        "--step-log-dir",
        type=Path,
        default=None,
        help="the engine's step log of each model (JAXSERVE_STEP_LOG) as DIR/NAME_steps.jsonl",
    )
    parser.add_argument("--qwen3-model", type=Path, default=CONFIGS / "qwen3-embedding-0.6b")
    parser.add_argument("--bge-model", type=Path, default=CONFIGS / "bge-large-en-v1.5")
    parser.add_argument("--num-texts", type=int, default=10_000)
    parser.add_argument("--text-len", type=int, default=256, help="tokens per text")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    args = parser.parse_args()
    paths = {"qwen3": args.qwen3_model, "bge": args.bge_model}
    results = []
    for name in args.models.split(","):
        result = run_model(name, paths[name], args)
        results.append(result)
        print(
            f"{name}: {result['texts_per_s']:,.0f} texts/s, {result['tokens_per_s']:,.0f} "
            f"tokens/s, {result['achieved_tflops']:.1f} TFLOP/s = "
            f"{100 * result['roofline_share']:.1f}% of {args.peak_flops / 1e12:.0f} TFLOP/s "
            f"({result['steps']} steps; counted: 2 x {result['non_embedding_params'] / 1e6:.1f}M "
            f"non-embedding params x tokens = {result['flops_linear'] / 1e12:.1f} TFLOP, + "
            f"{result['attention_counted']} attention {result['flops_attention'] / 1e12:.2f} "
            f"TFLOP; start {result['start_s']:.1f} s)",
            flush=True,
        )
    Path(args.out).write_text(json.dumps({"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
