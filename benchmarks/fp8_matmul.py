"""The fp8-matmul kernel against XLA and the bytes floor, at Llama-3-8B's projections (#36).

For each projection (fused qkv 4096 -> 6144, o 4096 -> 4096, fused gate/up 4096 -> 28672, down
14336 -> 4096) and token count M, times:
  bf16        XLA's GEMM on the bf16 weight (the model's layout [K, N]),
  xla_wo      ``quant.linear``'s fp8 weight-only path (what decode steps run today),
  xla_w8a8    per-token activation quantization, then XLA's fp8 dot (what prefill runs),
  kernel_w8a8 / kernel_wo   ``pallas_kernels.fp8_matmul`` with its planned tiles, W8A8 and
              weight-only, and (``--sweep``, at M = 1 and 16) other tiles of the W8A8 kernel,
against the floor: the fp8 weight's bytes (values and scales) / 4.3 TB/s. Each executable runs
the matmul over ``--copies`` distinct weights (nothing served from the 50 MB L2); a time is the
best of 5 runs over the copies, per matmul. The last table adds the projections up as one model
step's matmuls (32 layers; the lm_head, never quantized, left out) per arm.

    python -m benchmarks.fp8_matmul                 # a few minutes on the H200
    python -m benchmarks.fp8_matmul --sweep --batches 1,16
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts
os.environ.setdefault("JAXSERVE_FP8_MATMUL", "off")  # quant.linear is XLA's paths here
os.environ.setdefault("JAXSERVE_SKINNY_MATMUL", "off")

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.common import BANDWIDTH, best_time
from jaxserve.models import quant
from pallas_kernels.fp8_matmul import mosaic_gpu as fm

LAYERS = 32
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ARMS = ("bf16", "xla_wo", "xla_w8a8", "kernel_w8a8", "kernel_wo")
SWEEP = [
    dict(block_k=256),
    dict(num_stages=6),
    dict(block_k=256, num_stages=6),
    dict(block_n=128),
    dict(block_n=128, block_k=256),
    dict(num_stages=8),
]


def arm_fn(arm: str, config: fm.Fp8MatmulConfig):
    """The matmuls of one arm over every copy (each weight its own x: no merged dots)."""

    def one(x, w_bf16, w):
        if arm == "bf16":
            return jnp.dot(x, w_bf16)
        if arm == "xla_wo":
            return quant.linear(x, w, "TH,HI->TI")
        if arm == "xla_w8a8":  # quant.linear's W8A8 path, at any M (it takes it from 128 rows)
            xq, x_scale = quant.quantize_tokens_fp8(x)
            contract = (((1,), (1,)), ((), ()))
            y = jax.lax.dot_general(xq, w.q, contract, preferred_element_type=jnp.float32)
            return (y * x_scale * w.scale).astype(x.dtype)
        return fm.fp8_matmul(x, w.q, w.scale, act_quant=arm == "kernel_w8a8", config=config)

    def run(xs, bf16, weights):
        return [one(x, b, w) for x, b, w in zip(xs, bf16, weights, strict=True)]

    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--sweep", action="store_true", help="more W8A8 tiles at M = 1 and 16")
    parser.add_argument("--budget-s", type=float, default=240, help="past this, no sweep")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    started = time.perf_counter()
    rows = []
    key = jax.random.key(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        key, sub = jax.random.split(key)
        bf16 = [
            jax.random.normal(jax.random.fold_in(sub, i), (k, n), jnp.bfloat16) / k**0.5
            for i in range(args.copies)
        ]
        weights = [quant.quantize(w.T, "fp8", (k,), (n,)) for w in bf16]
        floor = weights[0].nbytes / BANDWIDTH
        for m in [int(b) for b in args.batches.split(",")]:
            xs = [
                jax.random.normal(jax.random.fold_in(sub, 1000 + i), (m, k), jnp.bfloat16)
                for i in range(args.copies)
            ]
            cells = [(arm, fm.Fp8MatmulConfig()) for arm in ARMS]
            if args.sweep and m in (1, 16) and time.perf_counter() - started < args.budget_s:
                cells += [
                    ("kernel_w8a8", dataclasses.replace(fm.Fp8MatmulConfig(), **change))
                    for change in SWEEP
                ]
            for arm, config in cells:
                if arm.startswith("kernel") and m > fm.MAX_ROWS:
                    continue
                try:
                    fn = arm_fn(arm, config)
                    t = best_time(fn, xs, bf16, weights, iters=5, runs=5) / args.copies
                except Exception as e:  # a config that does not compile or fit: say so, go on
                    print(f"  {name} M={m} {arm} {config}: {type(e).__name__}: {e}"[:300])
                    continue
                tiles = fm.plan(m, k, n, config, fm.num_sms())
                label = (
                    f"n{tiles.block_n} k{tiles.block_k} st{tiles.num_stages} s{tiles.num_splits}"
                )
                print(
                    f"  {name:8s} M={m:<3d} {arm:12s} {label:20s} {t * 1e6:8.1f} us "
                    f"{floor / t:5.0%} of the fp8 floor",
                    flush=True,
                )
                rows.append(
                    dict(shape=name, k=k, n=n, m=m, arm=arm, tiles=label, us=t * 1e6,
                         floor_us=floor * 1e6, default=config == fm.Fp8MatmulConfig())
                )  # fmt: skip
        del bf16, weights

    print("\n| projection | M | " + " | ".join(ARMS) + " | best kernel tiles | fp8 floor us |")
    print("|---|---:|" + "---:|" * len(ARMS) + "---|---:|")
    for name in args.shapes.split(","):
        for m in sorted({r["m"] for r in rows if r["shape"] == name}):
            cell = [r for r in rows if r["shape"] == name and r["m"] == m]
            by_arm = {r["arm"]: r for r in cell if r["default"]}
            kernels = [r for r in cell if r["arm"] == "kernel_w8a8"]
            best = min(kernels, key=lambda r: r["us"]) if kernels else None
            floor_us = cell[0]["floor_us"]
            values = [
                f"{by_arm[a]['us']:.1f} ({floor_us / by_arm[a]['us']:.0%})" if a in by_arm else "-"
                for a in ARMS
            ]
            tiles = f"{best['tiles']}: {best['us']:.1f}" if best else "-"
            print(f"| {name} | {m} | " + " | ".join(values) + f" | {tiles} | {floor_us:.1f} |")
    print(f"\nOne model step's quantized matmuls ({LAYERS} layers), ms:")
    print("| M | " + " | ".join(ARMS) + " | fp8 floor |")
    print("|---:|" + "---:|" * (len(ARMS) + 1))
    for m in sorted({r["m"] for r in rows}):
        sums = []
        for arm in ARMS:
            cell = [r for r in rows if r["m"] == m and r["arm"] == arm and r["default"]]
            whole = len(cell) == len(args.shapes.split(","))
            sums.append(f"{LAYERS * sum(r['us'] for r in cell) / 1e3:.2f}" if whole else "-")
        floor = LAYERS * sum({r["shape"]: r["floor_us"] for r in rows}.values()) / 1e3
        print(f"| {m} | " + " | ".join(sums) + f" | {floor:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
