"""Qwen3-30B-A3B on the H200 (shipped config, dummy bf16 weights): decode against the roofline
and offline throughput against Hugging Face, in one run.

One jaxserve process starts ``jaxserve.LLM`` (every step bucket compiled once) and measures:
  throughput  256 prompts x 512 in / 256 out, EOS ignored (``jaxserve bench throughput``'s run)
  decode      batch 1, 64, 256 at --context tokens, through the runner (decode_roofline.py's
              timing): device ms per step against its floor,
                floor = (dense bytes + touched experts x expert bytes + KV read) / 4.3 TB/s,
              dense bytes the weights outside the experts (embedding excluded), touched the
              experts a batch of B tokens reaches per layer: top_k at batch 1, then
              E (1 - (1 - top_k / E)^B) under uniform routing (126 of 128 at batch 64, all at 256)
  experts     one layer's experts alone (jax.lax.ragged_dot) at the same batches, against the
              bytes of the experts the routing really touched, and how XLA lowered ragged_dot
              (a cuDNN grouped matmul, or the dense expansion over every expert); then its
              three grouped matmuls alone, ragged_dot against the Mosaic GPU grouped matmul
              that jax ships (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu)
then Hugging Face ``generate_batch`` runs the throughput workload in a second process on the
same GPU (``jaxserve.bench.throughput --engine hf``: random weights made the same way as for
the dense models). Results: one JSON (--output-json) and a table.

    python benchmarks/moe.py --output-json /tmp/out/moe.json     # the H200 run (~8 minutes)
    python benchmarks/moe.py --engine jaxserve                    # jaxserve only
    python benchmarks/moe.py --smoke                              # tiny CPU run (CI)
    python benchmarks/moe.py --engine jaxserve --model jaxserve/assets/configs/gpt-oss-20b \
        --max-num-batched-tokens 2048                             # gpt-oss-20b (bf16 shape)

    python benchmarks/moe.py --engine jaxserve --model DIR --mgpu-batches "" \
        --max-num-batched-tokens 1024 --max-model-len 2048    # DeepSeek-V3, first 5 layers
                                                              # (run_h200.sh deepseek_v3)

gpt-oss-20b's attention sinks run on the reference attention (no Pallas kernel takes them
yet): its decode numbers measure that, and its step budget is kept at 2048 tokens because the
reference gathers every row's keys. DeepSeek-V3's latent attention runs on its reference
too (every row gathers its sequence's latents; capacity planning reserves that); its decode
floor reads the latent cache (kv_bytes_per_token of the runner's capacity plan).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import BANDWIDTH, decode_batch, time_device, time_pipelined  # noqa: E402

import jaxserve  # noqa: E402
from jaxserve.bench.throughput import make_prompts  # noqa: E402
from jaxserve.config import ModelConfig, builtin_config_dir  # noqa: E402
from jaxserve.models import moe  # noqa: E402
from jaxserve.models.families import layer_fields, num_params  # noqa: E402
from jaxserve.runner.step import SchedulerOutput  # noqa: E402

ROOT = Path(__file__).parents[1]
STARTED = time.perf_counter()


def expected_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Experts a batch of ``batch`` tokens reaches per layer under uniform routing."""
    if batch == 1:
        return float(top_k)
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def expert_bytes(config: ModelConfig, itemsize: int) -> tuple[int, int]:
    """(bytes of one expert of one layer, bytes of all weights outside the experts less the
    embedding)."""
    per_expert = sum(
        math.prod(f.shape_for(config)[1:]) for f in layer_fields(config) if f.is_of_each_expert
    )
    assert config.moe is not None
    num_moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    all_experts = num_moe_layers * config.moe.num_experts * per_expert
    dense = num_params(config, include_embedding=False) - all_experts
    return per_expert * itemsize, dense * itemsize


def ragged_dot_lowering(hlo: str) -> str:
    if "cudnn" in hlo.lower():
        return "cuDNN grouped matmul"
    if "ragged" in hlo.lower():
        return "ragged-dot (backend's own)"
    return "dense expansion over every expert"


def time_experts(runner, config: ModelConfig, batches: list[int], iters: int) -> list[dict]:
    """One layer's experts (routing, sort, three ragged_dots, combine) alone."""
    layer = next(w for w in runner.weights.layers if w.router is not None)
    weights = layer.moe_weights()
    assert config.moe is not None and weights is not None
    per_expert_bytes, _ = expert_bytes(config, runner.dtype.itemsize)
    fn = jax.jit(lambda x, w, n: moe.moe_block(x, w, config.moe, jax.nn.silu, num_valid_tokens=n))
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        num_tokens = max(16, 1 << (batch - 1).bit_length())  # the runner's token bucket
        x = jnp.asarray(rng.normal(0, 1, (num_tokens, config.hidden_size)), runner.dtype)
        n = jnp.int32(batch)
        compiled = fn.lower(x, weights, n).compile()
        logits = np.asarray(x[:batch].astype(jnp.float32) @ weights.router.astype(jnp.float32))
        _, ids = moe.route(jnp.asarray(logits), config.moe)
        touched = len(np.unique(np.asarray(ids)))
        jax.block_until_ready(compiled(x, weights, n))
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(iters):
                out = compiled(x, weights, n)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - start) / iters)
        seconds = min(samples)
        floor = touched * per_expert_bytes / BANDWIDTH
        rows.append(
            {
                "batch": batch,
                "experts_touched": touched,
                "device_us": seconds * 1e6,
                "floor_us": floor * 1e6,
                "mbu": floor / seconds,
                "lowering": ragged_dot_lowering(compiled.as_text()),
            }
        )
        print(
            f"experts batch={batch} touched={touched} device_us={seconds * 1e6:.1f} "
            f"floor_us={floor * 1e6:.1f} mbu={floor / seconds:.1%} [{rows[-1]['lowering']}]",
            flush=True,
        )
    return rows


def best_time(fn, *args, iters: int) -> float:
    """Seconds per call of ``fn(*args)`` dispatched back to back (best of three runs)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return min(samples)


def mgpu_expert_mlp(rows, group_sizes, w_gate, w_up, w_down):
    """``moe.expert_mlp`` on jax's own Mosaic GPU grouped matmul (Hopper), for comparison."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    def grouped(lhs, rhs):
        return ragged_dot_mgpu.ragged_dot(
            lhs, rhs, group_sizes=group_sizes, block_m=64, block_n=128, block_k=64,
            max_concurrent_steps=4, grid_block_n=1,
        )  # fmt: skip

    return grouped(jax.nn.silu(grouped(rows, w_gate)) * grouped(rows, w_up), w_down)


def time_grouped_matmuls(
    runner, config: ModelConfig, batches: list[int], mgpu_batches: list[int], iters: int
) -> list:
    """The three grouped matmuls of one layer on rows already sorted by expert: XLA's
    ragged_dot against the Mosaic GPU kernel jax ships (jax.experimental.pallas.ops.gpu)."""
    layer = next(w for w in runner.weights.layers if w.router is not None)
    w = layer.moe_weights()
    assert config.moe is not None and w is not None
    per_expert_bytes, _ = expert_bytes(config, runner.dtype.itemsize)
    xla = jax.jit(lambda r, g, a, b, c: moe.expert_mlp(r, g, a, b, c, jax.nn.silu))
    mgpu = jax.jit(mgpu_expert_mlp)
    rng = np.random.default_rng(1)
    out = []
    for batch in batches:
        num_tokens = max(16, 1 << (batch - 1).bit_length())
        x = jnp.asarray(rng.normal(0, 1, (num_tokens, config.hidden_size)), runner.dtype)
        logits = (x.astype(jnp.float32) @ w.router.astype(jnp.float32)).astype(jnp.float32)
        _, ids = moe.route(logits, config.moe)
        ids = jnp.where(jnp.arange(num_tokens)[:, None] < batch, ids, config.moe.num_experts)
        order, sizes = moe.sort_by_expert(ids, config.moe.num_experts)
        rows = x[order // config.moe.top_k]
        touched = int((sizes > 0).sum())
        row = {"batch": batch, "rows": int(rows.shape[0]), "experts_touched": touched}
        row["floor_us"] = touched * per_expert_bytes / BANDWIDTH * 1e6
        args = (rows, sizes, w.w_gate, w.w_up, w.w_down)
        row["xla_us"] = best_time(xla, *args, iters=iters) * 1e6
        if jax.default_backend() == "gpu" and batch in mgpu_batches:
            try:
                row["mgpu_us"] = best_time(mgpu, *args, iters=iters) * 1e6
            except Exception as exc:  # an experimental kernel: report why it did not run
                row["mgpu_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.append(row)
        print(f"grouped matmuls {row}", flush=True)
    return out


def check_lowering(config: ModelConfig, dtype: jnp.dtype, num_tokens: int = 64) -> str:
    """How XLA lowers one layer's ragged_dot here, from the compiled HLO (nothing allocated)."""
    assert config.moe is not None
    e, h, m = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size

    def spec(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    weights = moe.MoeWeights(spec(h, e), spec(e, h, m), spec(e, h, m), spec(e, m, h))
    fn = jax.jit(lambda x, w: moe.moe_block(x, w, config.moe, jax.nn.silu))
    return ragged_dot_lowering(fn.lower(spec(num_tokens, h), weights).compile().as_text())


def run_jaxserve(args: argparse.Namespace) -> dict:
    """Decode, one layer's experts and its grouped matmuls, then throughput (the largest
    steps last), saving the result after each part: a failure keeps what came before it."""
    config = ModelConfig.from_hf_dir(args.model)
    assert config.moe is not None
    result: dict = {"engine": "jaxserve", "device": jax.devices()[0].device_kind}
    result["jax"] = jax.__version__

    def save(part: str) -> None:
        print(f"done: {part}", flush=True)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2))

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    result["lowering"] = check_lowering(config, dtype)
    print(f"ragged_dot lowering: {result['lowering']}", flush=True)
    save("lowering")
    start = time.perf_counter()
    llm = jaxserve.LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.max_num_seqs, max(args.batches)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        warmup=not args.smoke,  # the smoke run compiles only the shapes it meets
    )
    result["startup_seconds"] = time.perf_counter() - start
    result["num_compiled_shapes"] = llm.engine.num_compiled_shapes
    runner = llm.engine.runner
    print(f"startup {result['startup_seconds']:.1f} s", flush=True)
    save("startup")

    itemsize = runner.dtype.itemsize
    per_expert, dense = expert_bytes(config, itemsize)
    num_moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    kv_per_token = runner.capacity.kv_bytes_per_token  # (MLA: its latent, not K and V)
    rng = np.random.default_rng(0)
    result["decode"] = decode = []
    for batch in args.batches:
        sched = decode_batch(runner, batch, args.context, rng)
        device = time_device(runner, sched, args.iters)
        wall = time_pipelined(runner, sched, args.iters)
        touched = expected_touched(config.moe.num_experts, config.moe.top_k, batch)
        step_bytes = (
            dense
            + num_moe_layers * touched * per_expert
            + batch * (args.context + 1) * kv_per_token
        )
        floor = step_bytes / BANDWIDTH
        decode.append(
            {
                "batch": batch,
                "context": args.context,
                "experts_touched": touched,
                "step_gb": step_bytes / 1e9,
                "device_ms": device * 1e3,
                "wall_ms": wall * 1e3,
                "floor_ms": floor * 1e3,
                "mbu": floor / device,
                "tokens_per_s": batch / wall,
            }
        )
        finished = [item.seq.seq_id for item in sched.scheduled]
        runner.inputs.update_states(SchedulerOutput([], 0, finished_seq_ids=finished))
        r = decode[-1]
        print(
            f"decode batch={batch} ctx={args.context} touched={touched:.1f} "
            f"device_ms={r['device_ms']:.2f} wall_ms={r['wall_ms']:.2f} "
            f"floor_ms={r['floor_ms']:.2f} mbu={r['mbu']:.1%}",
            flush=True,
        )
        save(f"decode batch {batch}")
    result["experts"] = time_experts(runner, config, args.batches, args.iters)
    save("experts")
    result["grouped_matmuls"] = time_grouped_matmuls(
        runner, config, args.batches, args.mgpu_batches, args.iters
    )
    save("grouped matmuls")

    prompts = make_prompts(args.num_prompts, args.input_len, config.vocab_size, seed=0)
    params = jaxserve.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result["throughput"] = {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
    }
    print(f"throughput {generated / elapsed:.1f} out tok/s ({elapsed:.1f} s)", flush=True)
    save("throughput")
    return result


def run_hf(args: argparse.Namespace) -> dict:
    """``jaxserve bench throughput --engine hf``, in a process of its own: its output JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf.json"
        cmd = [
            sys.executable, "-m", "jaxserve.bench.throughput", "--engine", "hf",
            "--model", args.model, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--output-json", str(out),
        ]  # fmt: skip
        timeout = max(30.0, args.time_budget - (time.perf_counter() - STARTED))
        try:
            proc = subprocess.run(cmd, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"engine": "hf", "error": f"not done in the {timeout:.0f} s left"}
        if proc.returncode != 0:
            return {"engine": "hf", "error": f"exit code {proc.returncode}"}
        return json.loads(out.read_text())


def print_table(result: dict, args: argparse.Namespace) -> None:
    js = result["jaxserve"]
    name = Path(args.model).name
    print(f"\n{name}, {args.load_format} weights, ragged_dot: {js.get('lowering', '?')}")
    if "error" in js:
        print(f"jaxserve stopped ({js['error']}) after: {', '.join(js)}")
    print(f"decode at context {args.context}")
    print(
        f"{'batch':>5} {'experts':>7} {'GB/step':>8} {'device ms':>9} {'wall ms':>8} "
        f"{'floor ms':>8} {'roofline':>8} {'tok/s':>9}"
    )
    for r in js.get("decode", []):
        print(
            f"{r['batch']:5d} {r['experts_touched']:7.1f} {r['step_gb']:8.2f} "
            f"{r['device_ms']:9.2f} {r['wall_ms']:8.2f} {r['floor_ms']:8.2f} {r['mbu']:8.1%} "
            f"{r['tokens_per_s']:9.1f}"
        )
    header = f"{'batch':>5} {'experts':>7} {'layer us':>9} {'floor us':>8} {'roofline':>8}"
    print(f"\n{header}  lowering")
    for r in js.get("experts", []):
        print(
            f"{r['batch']:5d} {r['experts_touched']:7d} {r['device_us']:9.1f} "
            f"{r['floor_us']:8.1f} {r['mbu']:8.1%}  {r['lowering']}"
        )
    print(f"\n{'batch':>5} {'rows':>5} {'experts':>7} {'floor us':>8} {'ragged_dot us':>13} "
          f"{'mosaic gpu us':>13}")  # fmt: skip
    for r in js.get("grouped_matmuls", []):
        mgpu = f"{r['mgpu_us']:13.1f}" if "mgpu_us" in r else r.get("mgpu_error", "-")[:40]
        print(
            f"{r['batch']:5d} {r['rows']:5d} {r['experts_touched']:7d} {r['floor_us']:8.1f} "
            f"{r['xla_us']:13.1f} {mgpu}"
        )
    if "throughput" not in js:
        return
    tput = js["throughput"]["output_tokens_per_s"]
    print(
        f"\nOffline throughput {args.num_prompts} x {args.input_len}/{args.output_len}: "
        f"jaxserve {tput:.1f} out tok/s"
    )
    hf = result.get("hf")
    if hf is not None and "error" not in hf:
        print(f"hf generate_batch {hf['output_tokens_per_s']:.1f} out tok/s")
        print(f"ratio jaxserve / hf: {tput / hf['output_tokens_per_s']:.1f}x")
    elif hf is not None:
        print(f"hf: {hf['error']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("qwen3-30b-a3b")))
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--mgpu-batches",
        default="64",
        help="batches at which to time the Mosaic GPU grouped matmul too (its 128 groups "
        "unroll: each shape takes a while to compile)",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--engine",
        default="both",
        choices=["jaxserve", "hf", "both"],
        help="both: jaxserve, then Hugging Face, each in its own process (each wants the GPU)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=560.0,
        help="seconds for the whole run: Hugging Face gets what jaxserve leaves of it",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny MoE fixture on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/qwen3_moe")
        args.load_format, args.iters = "auto", 2
        args.engine = "jaxserve" if args.engine == "both" else args.engine
        args.batches, args.context, args.max_model_len = "1,4", 32, 64
        args.num_prompts, args.input_len, args.output_len = 4, 16, 4
        args.max_num_seqs, args.max_num_batched_tokens = 4, 32
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.mgpu_batches = [int(b) for b in str(args.mgpu_batches).split(",") if b]
    if args.context + 1 > args.max_model_len:
        raise SystemExit(f"--context {args.context} needs --max-model-len > {args.context}")
    if args.engine == "hf":
        result = run_hf(args)
    elif args.engine == "jaxserve":
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
        result = run_jaxserve(args)
    else:
        # NOTE: one process per engine: XLA's allocator keeps the GPU memory it reserved
        # until its process ends, and Hugging Face needs that memory for its own copy.
        result = {engine: run_child(args, engine) for engine in ("jaxserve", "hf")}
        print_table(result, args)
    if args.engine == "jaxserve":
        print_table({"jaxserve": result}, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0 if "error" not in result.get("jaxserve", {}) else 1


def run_child(args: argparse.Namespace, engine: str) -> dict:
    """This script with ``--engine engine`` in a process of its own; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{engine}.json"
        lists = ("batches", "mgpu_batches")
        forwarded = [
            f"--{name.replace('_', '-')}={value}"
            for name, value in vars(args).items()
            if name not in ("engine", "output_json", "smoke", "time_budget", *lists)
        ]
        forwarded += [f"--{name.replace('_', '-')}={','.join(map(str, getattr(args, name)))}"
                      for name in lists]  # fmt: skip
        left = args.time_budget - (time.perf_counter() - STARTED)
        cmd = [sys.executable, __file__, *forwarded, f"--time-budget={left}"]
        cmd += ["--engine", engine, "--output-json", str(out)]
        proc = subprocess.run(cmd, check=False)
        result = json.loads(out.read_text()) if out.exists() else {"engine": engine}
        if proc.returncode != 0:  # what it measured before failing, and the failure
            result["error"] = f"exit code {proc.returncode}"
        return result


if __name__ == "__main__":
    sys.exit(main())
