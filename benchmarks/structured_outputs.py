"""Structured outputs: output tokens/s with every request under a JSON schema against the same
batch unconstrained, in one run, and the CPU time to compile a typical schema.

The default is the Llama-3-8B shape with dummy (random) weights and the demo model's
tokenizer (a dummy model needs a tokenizer whose ids cover the vocabulary; ids past the demo
tokenizer's 4,096 are simply never allowed by a constraint). ``--tokenizer`` takes a real one
(e.g. a Llama 3 tokenizer directory) where the machine has it: the per-token mask cost grows
with the vocabulary.

The schema asks for an array of at least ``--output-len`` records, so every constrained
sequence runs to ``max_tokens`` like the unconstrained ones: both batches do the same work,
and the difference is what the constraint costs (host masks overlapped with the forward pass,
the mask transfer and the masked sampler).

    python -m benchmarks.structured_outputs --output-json so.json          # on the H200
    python -m benchmarks.structured_outputs --smoke                       # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LLAMA_3_8B = ROOT / "jaxserve" / "assets" / "configs" / "llama-3-8b"
DEMO = ROOT / "jaxserve" / "assets" / "demo"
FIXTURE = ROOT / "tests" / "fixtures" / "models" / "llama"

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "ok"],
    "additionalProperties": False,
}


def records_schema(min_items: int) -> dict:
    return {
        "type": "object",
        "properties": {"records": {"type": "array", "items": RECORD, "minItems": min_items}},
        "required": ["records"],
        "additionalProperties": False,
    }


def typical_schema(i: int) -> dict:
    """A tool-call-sized schema, different per ``i`` so nothing comes from the cache."""
    return {
        "title": f"call_{i}",
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "include": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    }


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def measure_compile(llm, num: int) -> dict:
    """p50 / p99 of compiling distinct typical schemas on this CPU (one thread)."""
    from jaxserve.sampling_params import StructuredOutputsParams

    compiler = llm.engine.grammar_compiler
    compiler.compile(StructuredOutputsParams(json=json.dumps(typical_schema(-1))))  # tokenizer
    times = []
    for i in range(num):
        spec = StructuredOutputsParams(json=json.dumps(typical_schema(i)))
        start = time.perf_counter()
        compiler.compile(spec)
        times.append(time.perf_counter() - start)
    return {
        "num_schemas": num,
        "compile_p50_ms": percentile_ms(times, 50),
        "compile_p99_ms": percentile_ms(times, 99),
    }


class Phases:
    """Host seconds spent in each named engine call during a run (instance attributes shadow
    the methods for the run, then go): where a step's host time goes."""

    def __init__(self, llm) -> None:
        engine = llm.engine
        self.targets = {
            "step": (engine, "step"),
            "schedule": (engine.scheduler, "schedule"),
            "dispatch": (engine.runner, "dispatch"),
            "collect": (engine.runner, "collect"),
            "process": (engine, "_process"),
            "grammar states": (engine.structured_outputs, "update_states"),
            "start masks": (engine.structured_outputs, "start_masks"),
            "fill masks": (engine.structured_outputs, "_fill"),
            "sample": (engine.runner, "sample"),
        }
        self.seconds: dict[str, list[float]] = {name: [] for name in self.targets}

    def __enter__(self) -> Phases:
        for name, (obj, attr) in self.targets.items():
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr in self.targets.values():
            delattr(obj, attr)

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - start)

        return timed

    def per_step_ms(self) -> dict[str, float]:
        steps = max(1, len(self.seconds["step"]))
        return {name: sum(t) / steps * 1e3 for name, t in self.seconds.items()}


def run_batch(llm, prompts: list, params, phases: Phases | None = None) -> dict:
    start = time.perf_counter()
    if phases is None:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        with phases:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "texts": [o.outputs[0].text for o in outputs],
        "host_ms_per_step": phases.per_step_ms() if phases is not None else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(LLAMA_3_8B), help="model (config) directory")
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--tokenizer", default=str(DEMO), help="tokenizer directory")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--num-compile-schemas", type=int, default=200)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-json", default=None, help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="tiny fixture model, few tokens")
    args = parser.parse_args()
    if args.smoke:
        args.model = args.tokenizer = str(FIXTURE)
        args.load_format, args.dtype = "auto", "float32"
        args.batch_size, args.input_len, args.output_len = 4, 8, 12
        args.max_num_batched_tokens = 32
        args.num_compile_schemas = 5

    import jaxserve

    llm = jaxserve.LLM(
        args.model,
        tokenizer=args.tokenizer,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = np.random.default_rng(0)
    vocab = min(llm.engine.vocab_size, llm.engine.tokenizer.vocab_size)
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()}
        for _ in range(args.batch_size)
    ]
    schema = records_schema(args.output_len)
    plain = jaxserve.SamplingParams(
        temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True
    )
    constrained = plain.replace(structured_outputs={"json": json.dumps(schema)})
    # One pass of each first: compiles, the grammar and its tokenizer are then warm.
    run_batch(llm, prompts[:2], plain)
    run_batch(llm, prompts[:2], constrained)
    unconstrained_run = run_batch(llm, prompts, plain, Phases(llm))
    phases = Phases(llm)
    constrained_run = run_batch(llm, prompts, constrained, phases)
    mask_times = phases.seconds["fill masks"]  # on the worker thread
    texts = constrained_run.pop("texts")
    valid = sum('{"records":[' in text for text in texts)
    unconstrained_run.pop("texts")
    ratio = constrained_run["output_tokens_per_s"] / unconstrained_run["output_tokens_per_s"]
    result = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "unconstrained": unconstrained_run,
        "json_schema": constrained_run,
        "constrained_over_unconstrained": ratio,
        "constrained_outputs_well_formed": valid,
        "host_mask_per_step_p50_ms": percentile_ms(mask_times, 50) if mask_times else None,
        "host_mask_per_step_p99_ms": percentile_ms(mask_times, 99) if mask_times else None,
        "schema_compile": measure_compile(llm, args.num_compile_schemas),
        "device": str(__import__("jax").devices()[0]),
    }
    rows = [
        ("unconstrained", unconstrained_run["output_tokens_per_s"], 1.0),
        ("json schema", constrained_run["output_tokens_per_s"], ratio),
    ]
    print(f"{'batch ' + str(args.batch_size):<16}{'output tok/s':>14}{'vs plain':>10}")
    for name, rate, rel in rows:
        print(f"{name:<16}{rate:>14,.0f}{rel:>10.3f}")
    compile_ms = result["schema_compile"]
    print(
        f"host mask per step: p50 {result['host_mask_per_step_p50_ms']:.3f} ms, "
        f"p99 {result['host_mask_per_step_p99_ms']:.3f} ms; schema compile (CPU): "
        f"p50 {compile_ms['compile_p50_ms']:.2f} ms, p99 {compile_ms['compile_p99_ms']:.2f} ms"
    )
    print(f"well-formed constrained outputs: {valid}/{args.batch_size}")
    print("host ms per step:  " + "  ".join(f"{name:>8.8}" for name in phases.targets))
    for name, run in (("unconstrained", unconstrained_run), ("json schema", constrained_run)):
        per_step = run["host_ms_per_step"]
        print(f"{name:<17}" + "  ".join(f"{per_step[p]:>8.2f}" for p in phases.targets))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
