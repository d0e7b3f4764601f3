"""Multi-LoRA throughput and latency on the Llama-3-8B shape (dummy weights), through ``LLM``.

Offline throughput of ``--num-prompts`` requests of ``--input-len`` random prompt tokens and
``--output-len`` generated tokens, with 0 (the base model, LoRA off), 1, 8 and 64 distinct
rank-16 adapters on every projection spread round-robin over the requests (``--max-loras`` as
many as the run's adapters, so they all share each step); then the batch-1 time per output token
of the base model and of one adapter. Each run first serves one request on each adapter, so
the timed run's adapters are in their slots already (``lora_load.py`` measures loading). The
adapters are random PEFT directories written under
``--work-dir`` (``--num-files`` distinct weight files, reused under distinct adapter ids: each id
takes a slot of its own, as distinct adapters do). Targets (issue 39): 8 adapters >= 0.85x the
base's tokens/s; batch-1 TPOT <= 1.15x the base's.

    python -m benchmarks.lora --out lora.json
    python -m benchmarks.lora --model tests/fixtures/models/llama --num-prompts 8 \\
        --input-len 16 --output-len 8 --adapters 0,1,2 --rank 4 --max-model-len 64   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from benchmarks.common import ROOT
from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.models.families.registry import load_model_config

MODULES = {  # PEFT module -> (its block, in features, out features) from the config
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(path: Path, model: str, rank: int, seed: int) -> None:
    """A random PEFT adapter of ``rank`` on every projection of ``model``'s layers."""
    config = load_model_config(Path(model))
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.num_kv_heads * config.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    dims |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (num_in, num_out) in dims.items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            a = rng.standard_normal((rank, num_in), np.float32) / np.sqrt(num_in)
            b = rng.standard_normal((num_out, rank), np.float32) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float16)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    peft_config |= {"target_modules": list(MODULES), "base_model_name_or_path": model}
    (path / "adapter_config.json").write_text(json.dumps(peft_config))


def make_llm(args: argparse.Namespace, num_adapters: int) -> LLM:
    lora: dict[str, Any] = {}
    if num_adapters:
        max_loras = args.max_loras or num_adapters
        lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank)
        lora["max_cpu_loras"] = max(max_loras, num_adapters)
    return LLM(
        args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **lora,
    )


def throughput(llm: LLM, args: argparse.Namespace, loras: list[LoRARequest]) -> float:
    """Output tokens per second of the offline run (adapters round-robin over the requests)."""
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    prompts = [rng.integers(5, vocab, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    # Warm: one short request on each adapter first, so the timed run serves adapters already
    # in their slots (loading them is lora_load.py's measure); here it took 64 x 0.2 s.
    start = time.perf_counter()
    # (prompts of their own: the timed run's would be in the prefix cache after)
    warm = [rng.integers(5, vocab, args.input_len).tolist() for _ in range(len(loras) or 2)]
    llm.generate(warm, params, use_tqdm=False, lora_request=list(loras) or None)
    if loras:
        print(f"    {len(loras)} adapters loaded and warm in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


PROFILE_TOKENS = 16  # batch-1 decode steps traced (--profile-dir), after the prompt's


def tpot(llm: LLM, args: argparse.Namespace, lora: LoRARequest | None) -> float:
    """Seconds per output token at batch 1 (a run of one token subtracted: the prefill)."""
    prompt = [5 + i % (llm.engine.vocab_size - 5) for i in range(args.input_len)]

    def run(num_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        return time.perf_counter() - start

    run(args.output_len)  # warm
    seconds = (run(args.output_len) - run(1)) / (args.output_len - 1)
    if args.profile_dir:  # a traced run apart from the timed ones: where a step's time goes
        import jax

        name = "adapter" if lora else "base"
        with jax.profiler.trace(str(Path(args.profile_dir) / name), create_perfetto_trace=True):
            run(PROFILE_TOKENS + 1)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "jaxserve/assets/configs/llama-3-8b"))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--adapters", default="0,1,8,64", help="distinct adapters per run")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=0, help="0: the run's adapters")
    parser.add_argument("--num-files", type=int, default=8, help="distinct weight files")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--work-dir", default=None, help="where the adapters are written")
    parser.add_argument("--out", default="lora.json")
    parser.add_argument(
        "--profile-dir",
        default=None,
        help=f"trace {PROFILE_TOKENS} batch-1 decode steps of the base and the one-adapter runs "
        "here (DIR/base, DIR/adapter)",
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.adapters.split(",")]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="jaxserve-lora-"))
    files = [work / f"adapter{i}" for i in range(min(args.num_files, max(counts)))]
    for seed, path in enumerate(files):
        if not (path / "adapter_model.safetensors").exists():
            write_adapter(path, args.model, args.rank, seed)
    result: dict[str, Any] = {"args": vars(args), "throughput": {}, "tpot_s": {}}
    for count in counts:
        loras = [LoRARequest(f"a{i}", i + 1, str(files[i % len(files)])) for i in range(count)]
        llm = make_llm(args, count)
        result["throughput"][count] = tokens_per_s = throughput(llm, args, loras)
        print(f"{count:3d} adapters: {tokens_per_s:10.1f} output tokens/s", flush=True)
        if count <= 1:
            result["tpot_s"][count] = seconds = tpot(llm, args, loras[0] if loras else None)
            print(f"    batch-1 TPOT: {seconds * 1e3:.2f} ms", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        Path(args.out).write_text(json.dumps(result, indent=1))  # each run's, as it ends
    base = result["throughput"].get(0)
    if base:
        for count, value in result["throughput"].items():
            print(f"{count:3d} adapters: {value / base:.3f}x the base model's tokens/s")
    if 0 in result["tpot_s"] and 1 in result["tpot_s"]:
        print(f"batch-1 TPOT, one adapter: {result['tpot_s'][1] / result['tpot_s'][0]:.3f}x")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
