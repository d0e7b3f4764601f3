"""What BERT's MLP up-projection costs with each GELU, at BGE-large's shape (issue 40).

The H200 trace of 2026-12-05 put BGE-large's exact GELU (an f32 erf over [16384, 4096]) at
5.1 of a 34 ms step, a fusion of its own after the cuBLAS GEMM. This times, in bf16 at
[16384, 1024] x [1024, 4096] + bias, the GEMM with no activation, with the exact (erf) GELU and
with the tanh form (which XLA may fold into cuBLAS's epilogue), and prints the largest
difference of each GELU's bf16 output from the f32 exact GELU of the same bf16 inputs.

    python -m benchmarks.probes.gelu_epilogue      # on a GPU, about 20 seconds
    python -m benchmarks.probes.gelu_epilogue 64   # 64 tokens (a CPU smoke run)
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

TOKENS, HIDDEN, INTER = 16384, 1024, 4096


def timed(fn, *args, repeats: int = 50) -> float:
    """Median milliseconds of one call (compiled and warmed first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def up(x, w, b, act):
    return act(jnp.einsum("TH,HI->TI", x, w) + b)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else TOKENS
    key = jax.random.PRNGKey(0)
    kx, kw, kb = jax.random.split(key, 3)
    x = jax.random.normal(kx, (tokens, HIDDEN), jnp.bfloat16)
    w = (jax.random.normal(kw, (HIDDEN, INTER), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (INTER,), jnp.float32) * 0.1).astype(jnp.bfloat16)
    acts = {
        "none": lambda h: h,
        "gelu_erf": functools.partial(jax.nn.gelu, approximate=False),
        "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    }
    results = {}
    for name, act in acts.items():
        fn = jax.jit(functools.partial(up, act=act))
        results[f"{name}_ms"] = timed(fn, x, w, b)
    pre = (jnp.einsum("TH,HI->TI", x, w, preferred_element_type=jnp.float32) + b).astype(
        jnp.bfloat16
    )
    exact = jax.nn.gelu(pre.astype(jnp.float32), approximate=False)
    for name in ("gelu_erf", "gelu_tanh"):
        got = acts[name](pre).astype(jnp.float32)
        results[f"{name}_max_abs_error"] = float(jnp.max(jnp.abs(got - exact)))
    results["device"] = jax.devices()[0].device_kind
    print(json.dumps(results))
    print(
        f"| none | erf | tanh | erf err | tanh err |\n|---:|---:|---:|---:|---:|\n"
        f"| {results['none_ms']:.3f} ms | {results['gelu_erf_ms']:.3f} ms | "
        f"{results['gelu_tanh_ms']:.3f} ms | {results['gelu_erf_max_abs_error']:.2e} | "
        f"{results['gelu_tanh_max_abs_error']:.2e} |"
    )


if __name__ == "__main__":
    main()
