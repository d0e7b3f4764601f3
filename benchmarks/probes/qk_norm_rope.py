"""Qwen3's per-head norm and rotary on q and k (issue 40): XLA's passes (the decoder's
``normed_rotary``: a reduction, then the norm and rotation, for each of q and k, and the copy
of v out of the fused product) against ``pallas_kernels/qk_norm_rope``'s one pass per tensor
(and XLA's copy of v), on a 16,384-token Qwen3-Embedding-0.6B step's fused q/k/v product
([16384, 32, 128] bf16): us a layer, the kernel at a few token blocks, against the bytes at
the device's copy bandwidth; the largest difference between the two.

    python -m benchmarks.probes.qk_norm_rope --out qk.json       # on a GPU (interpret: --smoke)
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import best_time
from jaxserve.models.decoder import normed_rotary
from pallas_kernels.qk_norm_rope import triton

BLOCKS = (8, 16, 32)


def xla_form(qkv, wq, wk, cos, sin, *, n, kv):
    rotary = (cos[:, None], sin[:, None])
    q = normed_rotary(qkv[:, :n], wq, 1e-6, False, rotary)
    k = normed_rotary(qkv[:, n : n + kv], wk, 1e-6, False, rotary)
    return q, k, qkv[:, n + kv :]


def kernel_form(qkv, wq, wk, cos, sin, *, n, kv, block_t, interpret):
    norm = functools.partial(triton.normed_rope, eps=1e-6, block_t=block_t, interpret=interpret)
    q = norm(qkv, wq, cos, sin, first=0, heads=n)
    k = norm(qkv, wk, cos, sin, first=n, heads=kv)
    return q, k, qkv[:, n + kv :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", default="16,8,128", help="q heads, kv heads, head size")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, kv, d = map(int, args.heads.split(","))
    t = 32 if args.smoke else args.tokens
    rng = np.random.default_rng(0)
    qkv = jnp.asarray(3 * rng.standard_normal((t, n + 2 * kv, d)), jnp.bfloat16)
    wq, wk = (jnp.asarray(1 + 0.3 * rng.standard_normal(d), jnp.bfloat16) for _ in range(2))
    angles = rng.uniform(0, 100, (t, d // 2))
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], -1)), jnp.bfloat16)
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], -1)), jnp.bfloat16)
    operands = (qkv, wq, wk, cos, sin)
    copy_bytes = 2 * qkv.size * qkv.dtype.itemsize  # every head read once, written once
    rows: dict = {}
    xla = jax.jit(functools.partial(xla_form, n=n, kv=kv))
    want = xla(*operands)
    forms = {"xla": xla}
    for block_t in BLOCKS if not args.smoke else (16,):
        forms[f"kernel block_t={block_t}"] = jax.jit(
            functools.partial(kernel_form, n=n, kv=kv, block_t=block_t, interpret=args.smoke)
        )
    for name, fn in forms.items():
        try:
            got = fn(*operands)
            us = 1e6 * best_time(fn, *operands, iters=2 if args.smoke else 20)
        except Exception as exc:  # one block's failure leaves the others timed
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name}: {rows[name]['error']}")
            continue
        diff = max(
            float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max())
            for g, w in zip(got, want, strict=True)
        )
        rows[name] = {"us": us, "gb_per_s": copy_bytes / us / 1e3, "max_difference": diff}
        print(f"{name}: {us:.1f} us ({copy_bytes / us / 1e3:.0f} GB/s of a single pass's bytes),"
              f" largest difference from XLA's {diff:.4f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": t, "heads": [n, kv, d], "forms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
