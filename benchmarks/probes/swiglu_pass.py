"""Does XLA fuse SwiGLU into a GEMM, and what does its pass cost? (issue 40)

A Qwen3-Embedding-0.6B step of 16,384 tokens spends about 95 us a layer (2.76 ms a step on an
H100, benchmarks/reports/2026-12-06-session-thirteen) in SwiGLU's element-wise pass: it reads
the gate/up GEMM's [16384, 6144] output and writes [16384, 3072]. A GEMM that applied SwiGLU in
its epilogue would write the [16384, 3072] product alone and run no pass. This compiles, at
that shape, the MLP's gate/up half in three forms (the fused [H, 2I] weight with its halves
sliced, as the models hold it; the weight interleaved [H, I, 2]; two GEMMs), and the whole MLP
with the down projection, and lists the fusions XLA made of each: where SwiGLU lands. On a GPU
it also times the gate/up GEMM alone against GEMM + SwiGLU (the most an epilogue could save)
and the MLP, then the Mosaic GPU kernel that applies SwiGLU in its epilogue
(``pallas_kernels/swiglu_matmul``) at a few tile configs.

    python -m benchmarks.probes.swiglu_pass                        # on a GPU
    .venv-deviceless/bin/python -m benchmarks.probes.swiglu_pass --deviceless h200   # no GPU

Answer without a GPU (a deviceless H200 compile, JAX 0.11.2, 2026-12-07): in every form SwiGLU
is a loop fusion of its own after the GEMM, with XLA's Triton GEMMs and with cuBLAS
(``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``) alike, and in the whole MLP it stays out of
the down projection's GEMM (``--xla_gpu_triton_gemm_any=true`` too): removing the pass takes a
GEMM kernel of our own with the epilogue.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.common import best_time

SHAPES = {  # (hidden, intermediate)
    "qwen3-embedding-0.6b": (1024, 3072),
    "llama-3-8b": (4096, 14336),
}


def halves(x, w):  # the models' form: one [H, 2I] weight, gate and up its halves
    gu = x @ w
    inter = w.shape[1] // 2
    return jax.nn.silu(gu[:, :inter]) * gu[:, inter:]


def interleaved(x, w):  # [H, I, 2]: gate and up side by side per column
    gu = jnp.einsum("th,hic->tic", x, w)
    return jax.nn.silu(gu[..., 0]) * gu[..., 1]


def two_gemms(x, wg, wu):
    return jax.nn.silu(x @ wg) * (x @ wu)


def gemm_alone(x, w):
    return x @ w


def mlp(x, w, wd):
    return halves(x, w) @ wd


def forms(hidden: int, inter: int) -> dict[str, tuple[Any, tuple]]:
    """name -> (function, its arguments' shapes past the [tokens, H] input)"""
    return {
        "halves": (halves, ((hidden, 2 * inter),)),
        "interleaved": (interleaved, ((hidden, inter, 2),)),
        "two_gemms": (two_gemms, ((hidden, inter), (hidden, inter))),
        "gemm_alone": (gemm_alone, ((hidden, 2 * inter),)),
        "mlp": (mlp, ((hidden, 2 * inter), (inter, hidden))),
    }


KERNEL = re.compile(
    r"= (.+?) (?:fusion|custom-call)\(.*?(?:kind=(\w+)|custom_call_target=\"([^\"]+)\")"
)


def kernels(hlo: str) -> list[str]:
    """The kernels of an optimized HLO module: each fusion's kind or custom call's target,
    with its output's shape."""
    found = []
    for line in hlo.splitlines():
        match = KERNEL.search(line)
        if match and "ENTRY" not in line:
            found.append(f"{match.group(2) or match.group(3)} -> {match.group(1)}")
    return found


KERNEL_CONFIGS = [  # (block_m, block_n, block_k, num_stages, warp_specialized[, pingpong])
    (128, 64, 64, 4, False),
    (128, 64, 128, 3, False),
    (64, 128, 64, 4, False),
    (64, 64, 64, 6, False),
    (128, 64, 64, 4, True),  # the persistent form: tiles of 2 x 128 rows
    (128, 64, 64, 3, True),
    (64, 128, 64, 3, True),
    (128, 64, 64, 6, True, True),  # the ping-pong schedule: a warpgroup's own tile, in turn
    (128, 64, 64, 4, True, True),
]


def time_kernel(tokens: int, hidden: int, inter: int) -> list[dict]:
    """The Mosaic GPU kernel (``pallas_kernels/swiglu_matmul``) at each of ``KERNEL_CONFIGS``
    on the ``halves`` form's inputs: ms, and its largest difference from the reference."""
    from pallas_kernels.swiglu_matmul import mosaic_gpu, reference

    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    w = jax.random.normal(keys[1], (hidden, 2 * inter), jnp.bfloat16) / hidden**0.5
    want = jax.jit(reference.swiglu_matmul)(x, w).astype(jnp.float32)
    rows = []
    for tiles in KERNEL_CONFIGS:
        config = mosaic_gpu.SwigluMatmulConfig(*tiles)
        kernel = jax.jit(functools.partial(mosaic_gpu.swiglu_matmul, config=config))
        try:
            error = float(jnp.abs(kernel(x, w).astype(jnp.float32) - want).max())
            ms = 1e3 * best_time(kernel, x, w)
        except Exception as exc:  # one config's failure leaves the others timed
            rows.append({"config": tiles, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"kernel {tiles}: {rows[-1]['error']}", flush=True)
            continue
        tflops = 2 * tokens * hidden * 2 * inter / ms / 1e9
        rows.append({"config": tiles, "ms": ms, "tflops": tflops, "max_error": error})
        print(
            f"kernel {tiles}: {ms:.3f} ms ({tflops:.0f} TFLOP/s), max error {error:.4f}", flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deviceless", default=None, help="h100 or h200: compile without a GPU")
    parser.add_argument("--tokens", type=int, default=16384, help="the step's rows")
    parser.add_argument("--shape", default="qwen3-embedding-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    device_ctx: Any = contextlib.nullcontext(None)
    if args.deviceless:
        from benchmarks.deviceless import as_gpu

        device_ctx = as_gpu(args.deviceless)
    rows = {}
    with device_ctx as device:
        sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        for name, (fn, weights) in forms(*SHAPES[args.shape]).items():
            shapes = ((args.tokens, SHAPES[args.shape][0]), *weights)
            specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
            compiled = jax.jit(fn).lower(*specs).compile()
            rows[name] = {"kernels": kernels(compiled.as_text())}
            if not args.deviceless:
                keys = jax.random.split(jax.random.key(0), len(shapes))
                arrays = [
                    jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys, shapes, strict=True)
                ]
                rows[name]["ms"] = 1e3 * best_time(compiled, *arrays)
            timed = f": {rows[name]['ms']:.3f} ms" if "ms" in rows[name] else ""
            print(f"{name}{timed}", flush=True)
            for kernel in rows[name]["kernels"]:
                print(f"    {kernel}")
    if not args.deviceless:
        saved = rows["halves"]["ms"] - rows["gemm_alone"]["ms"]
        print(f"SwiGLU's pass after the gate/up GEMM: {saved:.3f} ms (the most an epilogue saves)")
        if jax.default_backend() == "gpu":
            rows["kernel"] = time_kernel(args.tokens, *SHAPES[args.shape])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
