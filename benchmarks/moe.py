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
  experts     one layer's experts alone (moe.moe_block: the Pallas Triton grouped matmul on a
              GPU) at the same batches, against the bytes of the experts the routing really
              touched, and how its grouped matmuls compiled; then the three grouped matmuls
              alone at those batches and a 2,048-token prefill step: our Triton kernel, XLA's
              ragged_dot (on the GPU, XLA's RaggedDotRewriter makes it a dense dot over every
              expert) and the Mosaic GPU grouped matmul that jax ships
              (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu), against the bytes floor of the
              experts touched and the bf16 compute floor
then Hugging Face ``generate_batch`` runs the throughput workload in a second process on the
same GPU (``jaxserve.bench.throughput --engine hf``: random weights made the same way as for
the dense models). Results: one JSON (--output-json) and a table.

    python -m benchmarks.moe --output-json /tmp/out/moe.json     # the H200 run (~8 minutes)
    python -m benchmarks.moe --engine jaxserve                    # jaxserve only
    python -m benchmarks.moe --smoke                              # tiny CPU run (CI)
    python -m benchmarks.moe --grouped-matmuls-only               # one layer's grouped
        matmuls on random weights, the whole GPU free, with a sweep of the kernel's tiles
    python -m benchmarks.moe --grouped-matmuls-only --fp8-experts     # and over fp8 experts
        (--quantization fp8's: fp8 values, f32 scales per expert and output channel), our
        kernel and ragged_dot, against the fp8 bytes floor
    python -m benchmarks.moe --grouped-matmuls-only --fp8-experts --mgpu-batches "" \
        --model jaxserve/assets/configs/deepseek-v3 --expert-split 8  # DeepSeek-V3's layer
                                                              # as one device holds it at -tp 8
    python -m benchmarks.moe --engine jaxserve --model jaxserve/assets/configs/gpt-oss-20b \
        --max-num-batched-tokens 2048                             # gpt-oss-20b (bf16 shape)

    python -m benchmarks.moe --engine jaxserve --model DIR --mgpu-batches "" \
        --max-num-batched-tokens 1024 --max-model-len 2048    # DeepSeek-V3, first 5 layers
                                                              # (run_h200.sh deepseek_v3)

gpt-oss-20b's attention sinks run inside the Pallas attention kernels. Its step budget of 2048
tokens dates from when they ran on the reference attention (which gathers every row's keys);
it is kept so that runs compare. DeepSeek-V3's latent attention runs on its reference (every
row gathers its sequence's latents; capacity planning reserves that); its decode floor reads
the latent cache (kv_bytes_per_token of the runner's capacity plan).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import functools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxserve
from benchmarks.common import BANDWIDTH, ROOT, best_time, decode_batch, time_device, time_pipelined
from jaxserve.bench.throughput import make_prompts
from jaxserve.config import ModelConfig, builtin_config_dir
from jaxserve.models import moe
from jaxserve.models.families.counting import num_params
from jaxserve.models.families.registry import layer_fields, load_model_config
from jaxserve.models.quant import QArray, quantize_experts
from jaxserve.runner.step import SchedulerOutput
from pallas_kernels.grouped_matmul import dispatch as gm_dispatch
from pallas_kernels.grouped_matmul import triton as gmt

PEAK_BF16_FLOPS = 989e12  # the H200's dense bf16 tensor-core peak (datasheet)
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


def grouped_matmul_lowering(hlo: str) -> str:
    """How compiled HLO runs the experts' grouped matmuls, read from its instructions: a
    ragged-dot instruction (the backend's own grouped matmul), a cuDNN or Pallas Triton custom
    call, or neither (XLA's RaggedDotRewriter: a dense dot over every expert). Metadata is
    dropped first: its op_name says ragged_dot whatever the lowering."""
    code = re.sub(r"metadata=\{[^}]*\}", "", hlo)
    if re.search(r"\sragged-dot\(", code):
        return "ragged-dot instruction (backend's own)"
    if "__cudnn$" in code:
        return "cuDNN grouped matmul"
    if "__gpu$xla.gpu.triton" in code:
        return "Pallas Triton grouped matmul"
    return "dense expansion over every expert"


def time_experts(runner, config: ModelConfig, batches: list[int], iters: int) -> list[dict]:
    """One layer's experts (routing, sort, three grouped matmuls on the path
    pallas_kernels.grouped_matmul picks, combine) alone."""
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
                "lowering": grouped_matmul_lowering(compiled.as_text()),
            }
        )
        print(
            f"experts batch={batch} touched={touched} device_us={seconds * 1e6:.1f} "
            f"floor_us={floor * 1e6:.1f} mbu={floor / seconds:.1%} [{rows[-1]['lowering']}]",
            flush=True,
        )
    return rows


def expert_mlp_on(grouped: Callable) -> Callable:
    """``moe.expert_mlp`` (silu, no biases) with ``grouped(lhs, rhs, group_sizes)`` for each
    of its three grouped matmuls."""

    def mlp(rows, group_sizes, w_gate, w_up, w_down):
        gate = grouped(rows, w_gate, group_sizes)
        up = grouped(rows, w_up, group_sizes)
        return grouped(jax.nn.silu(gate) * up, w_down, group_sizes)

    return mlp


def mgpu_grouped(lhs, rhs, group_sizes):
    """jax's own Mosaic GPU grouped matmul (Hopper), for comparison."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes, block_m=64, block_n=128, block_k=64,
        max_concurrent_steps=4, grid_block_n=1,
    )  # fmt: skip


def triton_grouped(config: gmt.GroupedMatmulConfig) -> Callable:
    """Our Pallas Triton grouped matmul with these tiles (None fields: the shape's default)."""
    interpret = jax.default_backend() != "gpu"
    return functools.partial(gmt.grouped_matmul, config=config, interpret=interpret)


def fp8_grouped(path: str) -> Callable:
    """The grouped matmul over quantized experts (a ``QArray``: fp8 values [G, K, N], f32
    scales [G, N]), weight-only: our Triton kernel (``path`` "triton") or ragged_dot on the
    values converted in XLA, the scales after ("xla")."""
    if path == "triton":
        interpret = jax.default_backend() != "gpu"
        return lambda lhs, w, sizes: gmt.grouped_matmul(
            lhs, w.q, sizes, w.scale, interpret=interpret
        )
    return lambda lhs, w, sizes: gm_dispatch.scaled_ragged_dot(lhs, w.q, sizes, w.scale)


def time_fp8(
    row: dict, fp8: moe.MoeWeights, rows: jax.Array, sizes: jax.Array, iters: int, xla: bool
) -> None:
    """``row`` with the three grouped matmuls over fp8 experts timed (``fp8_triton_us``, and
    ``fp8_xla_us`` with ``xla``) and their bytes floor (one byte a weight, the scales)."""
    assert isinstance(fp8.w_gate, QArray) and isinstance(fp8.w_down, QArray)
    _, hidden, inner = fp8.w_gate.q.shape
    per_expert = 3 * hidden * inner + (2 * inner + hidden) * 4
    row["fp8_floor_us"] = row["experts_touched"] * per_expert / BANDWIDTH * 1e6
    args = (rows, sizes, fp8.w_gate, fp8.w_up, fp8.w_down)
    try_time(row, "fp8_triton_us", jax.jit(expert_mlp_on(fp8_grouped("triton"))), *args,
             iters=iters)  # fmt: skip
    if xla:
        try_time(row, "fp8_xla_us", jax.jit(expert_mlp_on(fp8_grouped("xla"))), *args,
                 iters=iters)  # fmt: skip


# Tiles tried beside the default one (--sweep): decode-sized (16-32 rows a tile) and
# prefill-sized (64-128), each with a few column and K steps.
SWEEP = [
    gmt.GroupedMatmulConfig(16, 64, 128, 4, 4),
    gmt.GroupedMatmulConfig(16, 128, 64, 4, 4),
    gmt.GroupedMatmulConfig(16, 32, 256, 4, 3),
    gmt.GroupedMatmulConfig(32, 64, 128, 4, 4),
    gmt.GroupedMatmulConfig(64, 128, 64, 4, 3),
    gmt.GroupedMatmulConfig(64, 64, 64, 4, 4),
    gmt.GroupedMatmulConfig(128, 128, 64, 8, 3),
    gmt.GroupedMatmulConfig(128, 256, 64, 8, 3),
]


def config_name(config: gmt.GroupedMatmulConfig) -> str:
    c = config
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


def try_time(row: dict, key: str, fn, *args, iters: int) -> None:
    """``row[key]`` = microseconds per call, or ``row[key + '_error']`` = why it did not run
    (an XLA expansion out of memory, a kernel that does not compile)."""
    try:
        row[key] = best_time(fn, *args, iters=iters) * 1e6
    except Exception as exc:  # report it and go on with the other paths
        row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"


def time_grouped_matmuls(
    w: moe.MoeWeights,
    config: ModelConfig,
    batches: list[int],
    mgpu_batches: list[int],
    iters: int,
    sweep: bool = False,
    xla_batches: list[int] | None = None,  # None: every batch
    fp8: moe.MoeWeights | None = None,  # the same experts quantized: timed beside (fp8_*)
) -> list:
    """The three grouped matmuls of one layer on rows already sorted by expert, at each step
    size in ``batches`` (tokens: decode batches, or a prefill step): XLA's ragged_dot, our
    Pallas Triton kernel (default tiles; with ``sweep``, the best of SWEEP too) and the Mosaic
    GPU kernel jax ships, against the bytes floor of the experts the routing touched (and the
    bf16 compute floor, which binds at prefill)."""
    assert config.moe is not None
    itemsize = jnp.dtype(w.w_gate.dtype).itemsize
    per_expert_bytes = 3 * math.prod(w.w_gate.shape[1:]) * itemsize  # (M: this device's)
    xla = jax.jit(expert_mlp_on(jax.lax.ragged_dot))
    triton = jax.jit(expert_mlp_on(triton_grouped(gmt.GroupedMatmulConfig())))
    mgpu = jax.jit(expert_mlp_on(mgpu_grouped))
    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(1)
    out = []
    for batch in batches:
        num_tokens = max(16, 1 << (batch - 1).bit_length())
        x = jnp.asarray(rng.normal(0, 1, (num_tokens, config.hidden_size)), w.w_gate.dtype)
        logits = (x.astype(jnp.float32) @ w.router.astype(jnp.float32)).astype(jnp.float32)
        _, ids = moe.route(logits, config.moe)
        ids = jnp.where(jnp.arange(num_tokens)[:, None] < batch, ids, config.moe.num_experts)
        order, sizes = moe.sort_by_expert(ids, config.moe.num_experts)
        rows = x[order // config.moe.top_k]
        touched = int((sizes > 0).sum())
        row: dict = {"batch": batch, "rows": int(rows.shape[0]), "experts_touched": touched}
        row["floor_us"] = touched * per_expert_bytes / BANDWIDTH * 1e6
        flops = 2 * batch * config.moe.top_k * per_expert_bytes / itemsize
        row["flops_floor_us"] = flops / PEAK_BF16_FLOPS * 1e6
        args = (rows, sizes, w.w_gate, w.w_up, w.w_down)
        default = gmt.default_config(
            int(rows.shape[0]), config.moe.num_experts, gmt.has_large_shared_memory()
        )
        row["triton_config"] = config_name(default)
        try_time(row, "triton_us", triton, *args, iters=iters)
        if sweep and on_gpu:
            for tiles in SWEEP:
                try_time(row, config_name(tiles), jax.jit(expert_mlp_on(triton_grouped(tiles))),
                         *args, iters=iters)  # fmt: skip
            timed = [(row[config_name(t)], config_name(t)) for t in SWEEP if config_name(t) in row]
            if timed:
                row["triton_best_us"], row["triton_best_config"] = min(timed)
        if xla_batches is None or batch in xla_batches:
            try_time(row, "xla_us", xla, *args, iters=iters)
        if on_gpu and batch in mgpu_batches:
            try_time(row, "mgpu_us", mgpu, *args, iters=iters)
        if fp8 is not None:
            time_fp8(row, fp8, rows, sizes, iters, xla_batches is None or batch in xla_batches)
        out.append(row)
        print(f"grouped matmuls {row}", flush=True)
    return out


def check_lowering(config: ModelConfig, dtype: jnp.dtype, num_tokens: int = 64) -> dict:
    """How one layer's grouped matmuls compile here, from the HLO (nothing allocated): XLA's
    ragged_dot, and the path pallas_kernels.grouped_matmul picks (``moe.moe_block``'s)."""
    assert config.moe is not None
    e, h, m = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size

    def spec(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    rows = num_tokens * config.moe.top_k
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    xla = jax.jit(expert_mlp_on(jax.lax.ragged_dot)).lower(
        spec(rows, h), sizes, spec(e, h, m), spec(e, h, m), spec(e, m, h)
    )
    weights = moe.MoeWeights(spec(h, e), spec(e, h, m), spec(e, h, m), spec(e, m, h))
    fn = jax.jit(lambda x, w: moe.moe_block(x, w, config.moe, jax.nn.silu))
    chosen = fn.lower(spec(num_tokens, h), weights)
    return {
        "ragged_dot": grouped_matmul_lowering(xla.compile().as_text()),
        "moe_block": grouped_matmul_lowering(chosen.compile().as_text()),
    }


def random_moe_weights(
    config: ModelConfig, dtype: jnp.dtype, seed: int = 0, split: int = 1
) -> moe.MoeWeights:
    """One layer's router and experts, random (for --grouped-matmuls-only: no engine); with
    ``split`` N, the slice of each expert one device holds at -tp N (M / N)."""
    assert config.moe is not None
    e, h, m = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size // split
    keys = jax.random.split(jax.random.key(seed), 4)

    def normal(key, *shape: int) -> jax.Array:
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[-2])).astype(dtype)

    return moe.MoeWeights(
        normal(keys[0], h, e), normal(keys[1], e, h, m), normal(keys[2], e, h, m),
        normal(keys[3], e, m, h),
    )  # fmt: skip


def run_grouped_matmuls_only(args: argparse.Namespace) -> dict:
    """The grouped-matmul comparison alone, on one layer of random weights with the whole
    GPU free (XLA's dense expansion at prefill needs it), with the tile sweep."""
    config = load_model_config(args.model)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    result: dict = {"engine": "jaxserve", "device": jax.devices()[0].device_kind}
    result["jax"] = jax.__version__
    result["lowering"] = check_lowering(config, dtype)
    print(f"lowering: {result['lowering']}", flush=True)
    weights = random_moe_weights(config, dtype, split=args.expert_split)
    fp8 = None
    if args.fp8_experts:
        fp8 = moe.MoeWeights(
            weights.router,
            *(jax.jit(quantize_experts, static_argnums=1)(w, "fp8")
              for w in (weights.w_gate, weights.w_up, weights.w_down)),
        )  # fmt: skip
    result["expert_split"] = args.expert_split
    result["grouped_matmuls"] = time_grouped_matmuls(
        weights, config, args.batches + args.prefill_tokens, args.mgpu_batches, args.iters,
        sweep=not args.smoke and not args.fp8_experts, fp8=fp8,
    )  # fmt: skip
    return result


def run_jaxserve(args: argparse.Namespace) -> dict:
    """Decode, one layer's experts and its grouped matmuls, then throughput (the largest
    steps last), saving the result after each part: a failure keeps what came before it."""
    config = load_model_config(args.model)
    assert config.moe is not None
    result: dict = {"engine": "jaxserve", "device": jax.devices()[0].device_kind}
    result["jax"] = jax.__version__

    def save(part: str) -> None:
        print(f"done: {part}", flush=True)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2))

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    result["lowering"] = check_lowering(config, dtype)
    print(f"lowering: {result['lowering']}", flush=True)
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
        device, _ = time_device(runner, sched, args.iters)
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
    layer = next(w for w in runner.weights.layers if w.router is not None).moe_weights()
    assert layer is not None
    # NOTE: ragged_dot at decode batches only here: at prefill its dense expansion needs
    # more than the KV cache leaves free (--grouped-matmuls-only times it on an empty GPU).
    result["grouped_matmuls"] = time_grouped_matmuls(
        layer,
        config,
        args.batches + args.prefill_tokens,
        args.mgpu_batches,
        args.iters,
        xla_batches=args.batches,
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


def print_grouped_matmuls(rows: list[dict]) -> None:
    """The three grouped matmuls of one layer: each path's us, and the Triton kernel's share
    of the bytes floor (``roofline``)."""
    if not rows:
        return
    print(
        f"\n{'tokens':>6} {'rows':>6} {'experts':>7} {'floor us':>8} {'flops us':>8} "
        f"{'triton us':>9} {'roofline':>8} {'best us':>8} {'ragged_dot us':>13} "
        f"{'mosaic gpu us':>13}  tiles (default; best)"
    )

    def cell(r: dict, key: str, width: int) -> str:
        if key in r:
            return f"{r[key]:{width}.1f}"
        return f"{r.get(key[:-3] + '_us_error', '-')[:width]:>{width}}"

    for r in rows:
        share = f"{r['floor_us'] / r['triton_us']:8.1%}" if "triton_us" in r else f"{'-':>8}"
        print(
            f"{r['batch']:6d} {r['rows']:6d} {r['experts_touched']:7d} {r['floor_us']:8.1f} "
            f"{r['flops_floor_us']:8.1f} {cell(r, 'triton_us', 9)} {share} "
            f"{cell(r, 'triton_best_us', 8)} {cell(r, 'xla_us', 13)} {cell(r, 'mgpu_us', 13)}  "
            f"{r['triton_config']}; {r.get('triton_best_config', '-')}"
        )
    errors = {k: v for r in rows for k, v in r.items() if k.endswith("_error")}
    for key, error in errors.items():
        print(f"{key}: {error}")


def print_fp8_grouped_matmuls(rows: list[dict]) -> None:
    """bf16 against fp8 experts on our kernel: us, the fp8 bytes floor and its share."""
    rows = [r for r in rows if "fp8_floor_us" in r]
    if not rows:
        return
    print(
        f"\n{'tokens':>6} {'experts':>7} {'bf16 us':>8} {'bf16 roof':>9} {'fp8 floor':>9} "
        f"{'fp8 us':>8} {'fp8 roof':>8} {'speedup':>7} {'fp8 ragged_dot us':>17}"
    )
    for r in rows:
        bf16, fp8 = r.get("triton_us"), r.get("fp8_triton_us")
        xla = r.get("fp8_xla_us")
        print(
            f"{r['batch']:6d} {r['experts_touched']:7d} "
            + (f"{bf16:8.1f} {r['floor_us'] / bf16:9.1%} " if bf16 else f"{'-':>8} {'-':>9} ")
            + f"{r['fp8_floor_us']:9.1f} "
            + (f"{fp8:8.1f} {r['fp8_floor_us'] / fp8:8.1%} " if fp8 else f"{'-':>8} {'-':>8} ")
            + (f"{bf16 / fp8:6.2f}x " if bf16 and fp8 else f"{'-':>7} ")
            + (f"{xla:17.1f}" if xla else f"{r.get('fp8_xla_us_error', '-')[:17]:>17}")
        )


def print_table(result: dict, args: argparse.Namespace) -> None:
    js = result["jaxserve"]
    name = Path(args.model).name
    lowering = js.get("lowering", {})
    print(
        f"\n{name}, {args.load_format} weights; ragged_dot: {lowering.get('ragged_dot', '?')}; "
        f"the experts' path: {lowering.get('moe_block', '?')}"
    )
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
    print_grouped_matmuls(js.get("grouped_matmuls", []))
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
    parser.add_argument(
        "--prefill-tokens",
        default="2048",
        help="prefill step sizes (tokens) at which to time the grouped matmuls too",
    )
    parser.add_argument(
        "--grouped-matmuls-only",
        action="store_true",
        help="only the grouped-matmul comparison, on one layer of random weights (no engine, "
        "the whole GPU free), with a sweep of the Triton kernel's tiles",
    )
    parser.add_argument(
        "--fp8-experts",
        action="store_true",
        help="with --grouped-matmuls-only: time the grouped matmuls over the same experts "
        "quantized to fp8 too (--quantization fp8's layout), against bf16 (no tile sweep)",
    )
    parser.add_argument(
        "--expert-split",
        type=int,
        default=1,
        help="with --grouped-matmuls-only: each expert's M divided by this (the slice one "
        "device holds at -tp N; 8 for DeepSeek-V3 on 8 GPUs)",
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
        args.prefill_tokens = "32"
        args.num_prompts, args.input_len, args.output_len = 4, 16, 4
        args.max_num_seqs, args.max_num_batched_tokens = 4, 32
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.mgpu_batches = [int(b) for b in str(args.mgpu_batches).split(",") if b]
    args.prefill_tokens = [int(b) for b in str(args.prefill_tokens).split(",") if b]
    if args.context + 1 > args.max_model_len:
        raise SystemExit(f"--context {args.context} needs --max-model-len > {args.context}")
    if args.grouped_matmuls_only:
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
        result = run_grouped_matmuls_only(args)
        print(f"\n{Path(args.model).name}: lowering {result['lowering']}")
        print_grouped_matmuls(result["grouped_matmuls"])
        print_fp8_grouped_matmuls(result["grouped_matmuls"])
    elif args.engine == "hf":
        result = run_hf(args)
    elif args.engine == "jaxserve":
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
        result = run_jaxserve(args)
    else:
        # NOTE: one process per engine: XLA's allocator keeps the GPU memory it reserved
        # until its process ends, and Hugging Face needs that memory for its own copy.
        result = {engine: run_child(args, engine) for engine in ("jaxserve", "hf")}
        print_table(result, args)
    if args.engine == "jaxserve" and not args.grouped_matmuls_only:
        print_table({"jaxserve": result}, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0 if "error" not in result.get("jaxserve", {}) else 1


def run_child(args: argparse.Namespace, engine: str) -> dict:
    """This script with ``--engine engine`` in a process of its own; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{engine}.json"
        lists = ("batches", "mgpu_batches", "prefill_tokens")
        flags = ("engine", "output_json", "smoke", "time_budget", "grouped_matmuls_only")
        flags += ("fp8_experts",)
        forwarded = [
            f"--{name.replace('_', '-')}={value}"
            for name, value in vars(args).items()
            if name not in (*flags, *lists)
        ]
        forwarded += [f"--{name.replace('_', '-')}={','.join(map(str, getattr(args, name)))}"
                      for name in lists]  # fmt: skip
        left = args.time_budget - (time.perf_counter() - STARTED)
        cmd = [sys.executable, "-m", "benchmarks.moe", *forwarded, f"--time-budget={left}"]
        cmd += ["--engine", engine, "--output-json", str(out)]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, check=False, env={**os.environ, "PYTHONPATH": path})
        result = json.loads(out.read_text()) if out.exists() else {"engine": engine}
        if proc.returncode != 0:  # what it measured before failing, and the failure
            result["error"] = f"exit code {proc.returncode}"
        return result


if __name__ == "__main__":
    sys.exit(main())
