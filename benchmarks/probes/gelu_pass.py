"""BERT's exact GELU as a pass of its own, in two forms (issue 40): ``jax.nn.gelu`` (through
``erfc``) against ``encoder.forward.gelu_erf`` (through ``erf``, in float32), on the up
projection's output of a 16,384-token BGE-large step ([16384, 4096] bf16): us a layer, against
the pass's bytes at the device's copy bandwidth, and their largest difference.

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
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"forms": rows, "max_difference": diff}, f, indent=1)


if __name__ == "__main__":
    main()
