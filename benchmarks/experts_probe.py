"""One MoE layer's three grouped matmuls at the Qwen3-30B-A3B shape, every way this GPU runs them.

For rows = tokens x top_k sorted by expert (uniform random routing), it times and sizes:
  xla    jax.lax.ragged_dot as XLA lowers it here (XLA_FLAGS decides: the dense expansion over
         every expert, or cuDNN's grouped matmul with --xla_gpu_experimental_use_ragged_dot_fusion)
  mgpu   the Mosaic GPU grouped matmul jax ships (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu)
against the bytes floor of the experts touched, with the compiled temporaries and what the
compiled HLO holds (a ragged-dot instruction, a cuDNN call, or dense dots).

    python benchmarks/experts_probe.py --tokens 1,64,256,2048
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

BANDWIDTH = 4.3e12


def lowering(hlo: str) -> str:
    if "cudnn" in hlo.lower():
        return "cudnn"
    if re.search(r"= \S+ ragged-dot\(", hlo):
        return "ragged-dot"
    return "dense"


def best(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
    return min(times)


def mlp(grouped, rows, sizes, wg, wu, wd):
    return grouped(jax.nn.silu(grouped(rows, wg, sizes)) * grouped(rows, wu, sizes), wd, sizes)


def xla_grouped(lhs, rhs, sizes):
    return jax.lax.ragged_dot(lhs, rhs, sizes)


def mgpu_grouped(lhs, rhs, sizes):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=64, block_n=128, block_k=64,
        max_concurrent_steps=4, grid_block_n=1,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64,256,2048")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--kinds", default="xla,mgpu")
    p.add_argument("--label", default="")
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    e, h, m, k = a.experts, a.hidden, a.intermediate, a.top_k
    rng = np.random.default_rng(0)
    wg = jnp.asarray(rng.normal(0, 0.02, (e, h, m)), jnp.bfloat16)
    wu = jnp.asarray(rng.normal(0, 0.02, (e, h, m)), jnp.bfloat16)
    wd = jnp.asarray(rng.normal(0, 0.02, (e, m, h)), jnp.bfloat16)
    per_expert = 3 * h * m * 2
    results = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)])
        sizes = np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)
        rows = jnp.asarray(rng.normal(0, 1, (tokens * k, h)), jnp.bfloat16)
        touched = int((sizes > 0).sum())
        floor = touched * per_expert / BANDWIDTH
        for kind in a.kinds.split(","):
            grouped = {"xla": xla_grouped, "mgpu": mgpu_grouped}[kind]
            fn = jax.jit(lambda r, s, x, y, z, g=grouped: mlp(g, r, s, x, y, z))
            row = {"label": a.label, "kind": kind, "tokens": tokens, "rows": tokens * k,
                   "touched": touched, "floor_us": floor * 1e6}  # fmt: skip
            try:
                t0 = time.perf_counter()
                compiled = fn.lower(rows, jnp.asarray(sizes), wg, wu, wd).compile()
                row["compile_s"] = time.perf_counter() - t0
                mem = compiled.memory_analysis()
                row["temp_gib"] = getattr(mem, "temp_size_in_bytes", 0) / 2**30
                row["lowering"] = lowering(compiled.as_text())
                s = best(compiled, rows, jnp.asarray(sizes), wg, wu, wd)
                row["us"] = s * 1e6
                row["floor_share"] = floor / s
            except Exception as exc:  # report and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results.append(row)
            print(json.dumps(row), flush=True)
    if a.output_json:
        with open(a.output_json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    print(f"\n{'label':>6} {'kind':>5} {'tokens':>6} {'touched':>7} {'floor us':>8} {'us':>9} "
          f"{'floor%':>6} {'temp GiB':>8} lowering")  # fmt: skip
    for r in results:
        print(f"{r['label']:>6} {r['kind']:>5} {r['tokens']:>6} {r['touched']:>7} "
              f"{r['floor_us']:>8.1f} {r.get('us', float('nan')):>9.1f} "
              f"{r.get('floor_share', 0):>6.1%} {r.get('temp_gib', 0):>8.2f} "
              f"{r.get('lowering', r.get('error', '')[:60])}")  # fmt: skip


if __name__ == "__main__":
    main()
