"""Does the rotary embedding's form decide how many passes XLA makes over q and k? The
rotate-half turn written with a concatenation, with a flip of the two halves, and as two
halves joined at the end; each after the per-head norm (Qwen3) and without it (Llama), from
one fused q/k/v projection's output, timed on the device with the fusions XLA made.

    python -m benchmarks.probes.rope_fusion [--forms concat,flip,halves]
    python -m benchmarks.probes.rope_fusion --run benchmarks.embeddings \
        --forms concat,halves+unzeroed -- ARGS...

The second runs a benchmark (its ARGS after ``--``) once per form in one process, the
rotary form patched in, padding zeroed; ``+unzeroed`` leaves the packed attention's padding
rows (decoders' whole prompts, encoders) as cuDNN wrote them
(``packed_segment_attention(zero_padding=False)``).

All forms compute the same bf16 products and sums as Hugging Face's ``q * cos +
rotate_half(q) * sin``: the probe checks that their outputs are equal bit for bit.

Answer (an H100, 2026-12-06; benchmarks/reports/2026-12-06-session-nine): after Qwen3's norm,
the halves fuse into the norm's pass (3 kernels against 5, 134 against 177 us at 16,384
tokens); the flip fuses nowhere. The Qwen3-0.6B embeddings: concat 34.3-34.5% of the peak,
halves 35.8-36.7%, halves with unzeroed padding 37.5%. Llama's decode step: no change.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import runpy
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import best_time
from jaxserve.models import rope
from jaxserve.models.layers import rms_norm


def rotary_concat(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The form before 2026-12-06 (the turned copy built by a concatenation)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rotary_flip(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The turned copy as a flip of the two halves (no concatenation at all)."""
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    sign = jnp.array([-1, 1], x.dtype)[:, None]  # -x2 first, then x1
    rotated = (jnp.flip(halves, axis=-2) * sign).reshape(x.shape)
    return x * cos + rotated * sin


FORMS = {"concat": rotary_concat, "flip": rotary_flip, "halves": rope.apply_rotary}

# (name, tokens, q heads, kv heads, head dim, per-head norm)
CASES = (
    ("qwen3 prompt step", 16384, 16, 8, 128, True),
    ("llama prompt step", 2048, 32, 8, 128, False),
    ("llama decode b64", 64, 32, 8, 128, False),
)


def fusions(compiled_text: str) -> dict[str, int]:
    """The optimized module's top-level fusions and custom calls, by XLA's name stem."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    names = re.findall(r"%(\w+?)(?:\.\d+)? = [^\n]*? (?:fusion|custom-call)\(", entry)
    return dict(collections.Counter(names))


def _with_zero_padding(packed, zero_padding: bool, *args, **kwargs):
    return packed(*args, **{**kwargs, "zero_padding": zero_padding})


def patched_runs(module: str, forms: list[str], argv: list[str]) -> None:
    """``python -m MODULE ARGV`` once per form, in this process (its --out or --output-json
    gets the form's name)."""
    from jaxserve.runner import encoder_runner, pooling_attention, segment_attention

    packed = segment_attention.packed_segment_attention
    flag = "--out" if "--out" in argv else "--output-json"
    out = argv[argv.index(flag) + 1]
    for spec in forms:
        form, _, unzeroed = spec.partition("+")
        rope.apply_rotary = FORMS[form]  # read at trace time by every model
        zeroed = functools.partial(_with_zero_padding, packed, not unzeroed)
        pooling_attention.packed_segment_attention = zeroed  # the decoders' whole prompts
        encoder_runner.packed_segment_attention = zeroed  # the encoders
        sys.argv = [module, *argv]
        sys.argv[sys.argv.index(flag) + 1] = out.replace(".json", f"_{form}{unzeroed}.json")
        print(f"-- {spec}", flush=True)
        runpy.run_module(module, run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="concat,flip,halves")
    parser.add_argument("--out", default=None, help="results JSON")
    parser.add_argument("--run", default=None, help="a benchmark module to run once per form")
    args, rest = parser.parse_known_args()
    if args.run:
        patched_runs(args.run, args.forms.split(","), [a for a in rest if a != "--"])
        return
    forms = args.forms.split(",")
    results = []
    for name, tokens, nq, nkv, dim, norm in CASES:
        key = jax.random.key(tokens)
        qkv = jax.random.normal(key, (tokens, nq + 2 * nkv, dim), jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(key, 1), (2, dim), jnp.bfloat16)
        positions = jnp.arange(tokens, dtype=jnp.int32) % 4096
        inv = rope.inv_freq(dim, 1e6, None)
        cos, sin = rope.cos_sin(positions[:, None] * inv[None, :], 1.0, jnp.bfloat16)
        outs = {}
        for form in forms:
            turn = FORMS[form]

            def step(qkv, w, cos, sin, turn=turn, nq=nq, nkv=nkv, norm=norm):
                q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
                if norm:
                    q, k = rms_norm(q, w[0], 1e-6), rms_norm(k, w[1], 1e-6)
                return turn(q, cos, sin), turn(k, cos, sin), v

            fn = jax.jit(step)
            text = fn.lower(qkv, w, cos, sin).compile().as_text()
            outs[form] = fn(qkv, w, cos, sin)
            seconds = best_time(fn, qkv, w, cos, sin, iters=50)
            moved = 2 * qkv.nbytes  # read once, written once: the least a pass can move
            row = {
                "case": name,
                "form": form,
                "us": seconds * 1e6,
                "GB/s at one pass": moved / seconds / 1e9,
                "fusions": fusions(text),
                "equal to concat": all(
                    bool(jnp.array_equal(a, b))
                    for a, b in zip(outs[form], outs.get("concat", outs[form]), strict=True)
                ),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'case':<20} {'form':<7} {'us':>9} {'kernels':>8}  equal")
    for r in results:
        kernels = sum(r["fusions"].values())
        print(
            f"{r['case']:<20} {r['form']:<7} {r['us']:>9.1f} {kernels:>8}  {r['equal to concat']}"
        )


if __name__ == "__main__":
    main()
