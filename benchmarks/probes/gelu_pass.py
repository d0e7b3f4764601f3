"""BERT's exact GELU as a pass of its own, in two forms (issue 40): ``jax.nn.gelu`` (through
``erfc``) against ``encoder.forward.gelu_erf`` (through ``erf``, in float32), on the up
projection's output of a 16,384-token BGE-large step ([16384, 4096] bf16): us a layer, against
the pass's bytes at the device's copy bandwidth, and their largest difference. On a GPU also
the whole intermediate projection (x [16384, 1024] @ w [1024, 4096] + b, then GELU): XLA's GEMM
and pass against ``pallas_kernels/swiglu_matmul``'s ``gelu_matmul`` (bias and GELU in the
epilogue of its persistent GEMM) at a few tile configs.

    python -m benchmarks.probes.gelu_pass --out gelu.json          # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from benchmarks.common import best_time
from jaxserve.models.encoder.forward import gelu_erf

FORMS = {
    "jax.nn.gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_erf": gelu_erf,
    "copy": lambda x: x * 1,  # the bytes alone: one read, one write
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.key(0), (args.rows, args.width), jnp.bfloat16) * 3
    rows, outs = {}, {}
    for name, fn in FORMS.items():
        f = jax.jit(fn)
        outs[name] = f(x).astype(jnp.float32)
        rows[name] = {"us": 1e6 * best_time(f, x)}
    diff = float(jnp.abs(outs["jax.nn.gelu"] - outs["gelu_erf"]).max())
    for name, row in rows.items():
        print(
            f"{name}: {row['us']:.1f} us ({rows['copy']['us'] / row['us']:.0%} of a copy's speed)"
        )
    print(f"largest difference between the two GELUs: {diff:.5f}")
    result: dict = {"forms": rows, "max_difference": diff}
    if jax.default_backend() == "gpu":
        result["projection"] = time_projection(args.rows, 1024, args.width)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


KERNEL_CONFIGS = [  # (block_m, block_n, block_k, num_stages, pingpong) of the persistent form
    (128, 128, 64, 3, False),
    (128, 64, 64, 4, False),
    (64, 128, 64, 4, False),
    (128, 128, 64, 5, True),  # the ping-pong schedule: a warpgroup's own tile, in turn
    (128, 128, 64, 4, True),
    (128, 64, 64, 6, True),
]


def time_projection(rows: int, hidden: int, width: int) -> dict:
    """gelu(x @ w + b): XLA's GEMM (its bias in the GEMM's epilogue) and GELU pass against the
    kernel at each of ``KERNEL_CONFIGS``: us, and the largest difference from the reference."""
    from pallas_kernels.swiglu_matmul import mosaic_gpu, reference

    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
    w = jax.random.normal(keys[1], (hidden, width), jnp.bfloat16) / hidden**0.5
    b = jax.random.normal(keys[2], (width,), jnp.bfloat16)
    want = jax.jit(reference.gelu_matmul)(x, w, b).astype(jnp.float32)
    xla = jax.jit(lambda x, w, b: gelu_erf(x @ w + b))
    out: dict = {"xla_us": 1e6 * best_time(xla, x, w, b), "kernel": []}
    print(f"XLA GEMM + GELU pass: {out['xla_us']:.1f} us", flush=True)
    for tiles in KERNEL_CONFIGS:
        *blocking, pingpong = tiles
        config = mosaic_gpu.SwigluMatmulConfig(*blocking, warp_specialized=True, pingpong=pingpong)
        kernel = jax.jit(functools.partial(mosaic_gpu.gelu_matmul, config=config))
        try:
            error = float(jnp.abs(kernel(x, w, b).astype(jnp.float32) - want).max())
            us = 1e6 * best_time(kernel, x, w, b)
        except Exception as exc:  # one config's failure leaves the others timed
            out["kernel"].append({"config": tiles, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"kernel {tiles}: {out['kernel'][-1]['error']}", flush=True)
            continue
        tflops = 2 * rows * hidden * width / us / 1e6
        out["kernel"].append({"config": tiles, "us": us, "tflops": tflops, "max_error": error})
        print(f"kernel {tiles}: {us:.1f} us ({tflops:.0f} TFLOP/s), max error {error:.4f}")
    return out


if __name__ == "__main__":
    main()
