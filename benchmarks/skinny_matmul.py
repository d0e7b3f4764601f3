"""The skinny-matmul kernel against XLA and the bytes floor, at Llama-3-8B's projections.

For each projection (fused qkv 4096 -> 6144, o 4096 -> 4096, fused gate/up 4096 -> 28672, down
14336 -> 4096, lm_head 4096 -> 128256), token count M and weight format (bf16 in the model's
[K, N] layout; fp8 e4m3 [N, K] with per-channel scales, as ``quant.QArray``), times:
  XLA     ``jnp.einsum`` for bf16, ``quant.linear``'s weight-only path for fp8 (what the model
          runs with JAXSERVE_SKINNY_MATMUL=off),
  kernel  ``pallas_kernels.skinny_matmul.triton`` with its planned tiles, and a few other tile
          configs (``--sweep``: more),
against the floor: the weight's bytes (values and scales) / 4.3 TB/s. Each executable runs the
matmul over ``--copies`` distinct weights (so nothing is served from the 50 MB L2) and returns
every output; a time is the best of 5 runs over the copies, per matmul. The last table adds the
projections up as one model step's matmuls (32 layers + lm_head) at each M. Past
``--budget-s`` seconds only the planned tiles are timed, to keep the run near 3 minutes.

    python -m benchmarks.skinny_matmul                    # about 3 minutes on the H200
    python -m benchmarks.skinny_matmul --sweep --batches 1 --shapes qkv,down
    python -m benchmarks.skinny_matmul --smoke            # tiny shapes, interpret mode (CPU)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts
os.environ.setdefault("JAXSERVE_SKINNY_MATMUL", "off")  # the XLA baseline is quant.linear's

import argparse
import dataclasses
import json
import time
import warnings

import jax
import jax.numpy as jnp

from benchmarks.common import BANDWIDTH, best_time
from jaxserve.models import quant
from pallas_kernels.skinny_matmul import triton as sm

LAYERS = 32
# name: (K, N, times per model step)
SHAPES = {
    "qkv": (4096, 6144, LAYERS),
    "o": (4096, 4096, LAYERS),
    "gate_up": (4096, 28672, LAYERS),
    "down": (14336, 4096, LAYERS),
    "lm_head": (4096, 128256, 1),
}
SMOKE_SHAPES = {"qkv": (64, 96, 2), "down": (96, 64, 2)}


# NOTE: each weight gets its own x: dots that share an operand may be merged by XLA (DotMerger),
# which would concatenate the weights on every run.
def xla_matmuls(xs: list, weights: list) -> list[jax.Array]:
    """What the model runs with the kernel off: ``quant.linear`` (einsum, or fp8 weight-only)."""
    return [quant.linear(x, w, "TH,HI->TI") for x, w in zip(xs, weights, strict=True)]


def kernel_matmuls(
    xs: list, weights: list, config: sm.SkinnyConfig, interpret: bool
) -> list[jax.Array]:
    """The kernel over each weight."""

    def one(x, w):
        if isinstance(w, quant.QArray):  # fp8 [N, K] and its per-channel scales
            return sm.skinny_matmul(
                x, w.q, w.scale, w_layout="nk", config=config, interpret=interpret
            )
        return sm.skinny_matmul(x, w, config=config, interpret=interpret)

    return [one(x, w) for x, w in zip(xs, weights, strict=True)]


def configs(m: int, k: int, n: int, itemsize: int, layout: str, sweep: bool):
    """(label, SkinnyConfig): the plan first, then variations around it."""
    base = sm.plan(m, k, n, itemsize, layout, sm.num_sms(), sm.SkinnyConfig())
    assert base.block_n and base.block_k and base.num_splits
    out = [("plan", base)]
    variants: list[dict[str, int]] = [dict(num_splits=base.num_splits * 2)]
    if base.num_splits > 1:
        variants.append(dict(num_splits=1))  # no partial sums (and no reduction after)
    else:
        variants.append(dict(num_stages=4))
    if sweep:
        variants += [
            dict(block_n=base.block_n * 2, num_warps=8),
            dict(num_splits=max(1, base.num_splits // 2)),
            dict(block_k=base.block_k * 2),
            dict(block_k=max(16, base.block_k // 2), num_stages=5),
            dict(block_n=max(16, base.block_n // 2)),
            dict(block_n=base.block_n * 4, num_splits=1),
            dict(num_warps=8),
            dict(num_warps=2),
            dict(num_stages=2),
        ]
    for change in variants:
        config = dataclasses.replace(base, **change)  # type: ignore[arg-type]
        if config != base and all(c != config for _, c in out):
            label = ",".join(f"{key}={value}" for key, value in change.items())
            out.append((label, config))
    return out


def describe(config: sm.SkinnyConfig) -> str:
    return (
        f"n{config.block_n} k{config.block_k} s{config.num_splits} "
        f"w{config.num_warps} st{config.num_stages}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,8,16,64")
    parser.add_argument("--formats", default="bf16,fp8")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="more tile configs per cell")
    parser.add_argument(
        "--budget-s", type=float, default=150, help="past this, only the planned tiles run"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    copies = 2 if args.smoke else args.copies
    batches = [int(b) for b in args.batches.split(",")]
    interpret = args.smoke or jax.default_backend() != "gpu"
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    rows = []
    key = jax.random.key(0)
    started = time.perf_counter()
    for name, (k, n, per_step) in shapes.items():
        for fmt in args.formats.split(","):
            if fmt == "fp8" and name == "lm_head":
                continue  # never quantized (quant.py)
            key, sub = jax.random.split(key)
            bf16 = [
                jax.random.normal(jax.random.fold_in(sub, i), (k, n), dtype) / k**0.5
                for i in range(copies)
            ]  # the model's layout [K, N]
            weights: list = bf16
            if fmt == "fp8":
                weights = [quant.quantize(w.T, "fp8", (k,), (n,)) for w in bf16]
                del bf16
            nbytes = weights[0].nbytes
            floor = nbytes / BANDWIDTH
            for m in batches:
                xs = [
                    jax.random.normal(jax.random.fold_in(sub, 1000 + i), (m, k), dtype)
                    for i in range(copies)
                ]

                xla_s = (
                    best_time(jax.jit(xla_matmuls), xs, weights, iters=args.iters, runs=5) / copies
                )
                item = 1 if fmt == "fp8" else 2
                layout = "nk" if fmt == "fp8" else "kn"
                results = []
                cells = configs(m, k, n, item, layout, args.sweep)
                if time.perf_counter() - started > args.budget_s:
                    cells = cells[:1]
                for label, config in cells:
                    try:
                        fn = jax.jit(kernel_matmuls, static_argnums=(2, 3))
                        t = (
                            best_time(fn, xs, weights, config, interpret, iters=args.iters, runs=5)
                            / copies
                        )
                    except Exception as e:  # a config Triton cannot compile: say so, go on
                        print(f"  {name} M={m} {fmt} {label}: {type(e).__name__}: {e}"[:300])
                        continue
                    results.append((t, label, config))
                    print(
                        f"  {name:8s} M={m:<3d} {fmt:4s} {describe(config):26s} "
                        f"{t * 1e6:8.1f} us  {floor / t:5.0%} of floor  (XLA {xla_s * 1e6:.1f})",
                        flush=True,
                    )
                best_t, best_label, best = min(results, key=lambda r: r[0])
                plan_t = results[0][0] if results and results[0][1] == "plan" else float("nan")
                rows.append(
                    dict(
                        shape=name, k=k, n=n, m=m, format=fmt, per_step=per_step,
                        mbytes=nbytes / 1e6, floor_us=floor * 1e6, xla_us=xla_s * 1e6,
                        plan_us=plan_t * 1e6, best_us=best_t * 1e6, best=describe(best),
                        best_label=best_label,
                    )
                )  # fmt: skip
            del weights

    print("\n| projection | M | weights | MB | floor us | XLA us | plan us | best us | best "
          "config | XLA %floor | plan %floor | best %floor | XLA / best |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['shape']} [{r['k']} -> {r['n']}] | {r['m']} | {r['format']} | "
            f"{r['mbytes']:.0f} | {r['floor_us']:.1f} | {r['xla_us']:.1f} | {r['plan_us']:.1f} | "
            f"{r['best_us']:.1f} | {r['best']} | {r['floor_us'] / r['xla_us']:.0%} | "
            f"{r['floor_us'] / r['plan_us']:.0%} | {r['floor_us'] / r['best_us']:.0%} | "
            f"{r['xla_us'] / r['best_us']:.2f}x |"
        )
    print("\nOne model step's matmuls (32 layers + lm_head; lm_head bf16 in both formats):")
    print("| M | weights | floor ms | XLA ms | kernel (plan) ms | kernel (best) ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for fmt in args.formats.split(","):
        for m in batches:
            cells = [r for r in rows if r["m"] == m and r["format"] == fmt]
            if fmt == "fp8":
                cells += [r for r in rows if r["m"] == m and r["shape"] == "lm_head"]
            if {r["shape"] for r in cells} != set(shapes):
                continue
            total = {
                col: sum(r[col] * r["per_step"] for r in cells) / 1e3
                for col in ("floor_us", "xla_us", "plan_us", "best_us")
            }
            print(
                f"| {m} | {fmt} | {total['floor_us']:.2f} | {total['xla_us']:.2f} | "
                f"{total['plan_us']:.2f} | {total['best_us']:.2f} |"
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
