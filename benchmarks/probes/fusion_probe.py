"""Do fused projections pay at small batch? One model's worth (32 layers) of the attention
input projections and the MLP's gate/up, as separate matmuls and as one concatenated matmul,
on the Llama-3-8B shapes, timed on the device.

    python -m benchmarks.probes.fusion_probe [--batches 1,8,64]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from benchmarks.common import best_time

H, Q, KV, INTER = 4096, 4096, 1024, 14336
LAYERS = int(os.environ.get("PROBE_LAYERS", 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    args = parser.parse_args()
    key = iter(jax.random.split(jax.random.key(0), 16))

    def w(*shape):  # one array per layer, as the model holds them
        k = next(key)
        return [
            jax.random.normal(jax.random.fold_in(k, i), shape, jnp.bfloat16) * 0.02
            for i in range(LAYERS)
        ]

    wq, wk, wv, wqkv = w(H, Q), w(H, KV), w(H, KV), w(H, Q + 2 * KV)
    wg, wu, wgu = w(H, INTER), w(H, INTER), w(H, 2 * INTER)

    @jax.jit
    def qkv_separate(x, wq, wk, wv):
        out = x
        for i in range(LAYERS):  # unrolled, as the model does
            q, k, v = x @ wq[i], x @ wk[i], x @ wv[i]
            out = out + q[:, :H] + k.sum() + v.sum()
        return out

    @jax.jit
    def qkv_fused(x, wqkv):
        out = x
        for i in range(LAYERS):
            qkv = x @ wqkv[i]
            out = out + qkv[:, :H] + qkv[:, Q : Q + KV].sum() + qkv[:, Q + KV :].sum()
        return out

    @jax.jit
    def mlp_separate(x, wg, wu):
        out = x
        for i in range(LAYERS):
            out = out + (jax.nn.silu(x @ wg[i]) * (x @ wu[i]))[:, :H]
        return out

    @jax.jit
    def mlp_fused(x, wgu):
        out = x
        for i in range(LAYERS):
            gu = x @ wgu[i]
            out = out + (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:])[:, :H]
        return out

    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| batch | qkv separate us | qkv fused us | gate/up separate us | gate/up fused us |")
    for batch in [int(b) for b in args.batches.split(",")]:
        x = jax.random.normal(next(key), (batch, H), jnp.bfloat16)
        times = [
            best_time(qkv_separate, x, wq, wk, wv),
            best_time(qkv_fused, x, wqkv),
            best_time(mlp_separate, x, wg, wu),
            best_time(mlp_fused, x, wgu),
        ]
        print(f"| {batch} | " + " | ".join(f"{t * 1e6:.0f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
