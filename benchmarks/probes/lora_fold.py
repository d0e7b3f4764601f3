"""Would folding LoRA's shrink into the base GEMM pay at decode? A batch-1 decode step's
projections (Llama-3-8B shapes, 32 layers, no attention: its cost is the same in every form),
a 16-token bucket with one token on an adapter (rank 16 on every projection), timed on the
device in these forms:

  base      no adapter: the norms, the four projection groups, SwiGLU and the residual adds;
  kernel    the LoRA terms on ``pallas_kernels.lora.dispatch`` (two Triton launches a group,
            the norm's weight read in by the shrink);
  dense     XLA's dense product over every slot as two GEMMs (``reference.form_deltas``, ``gemm``);
  joined    the same with each group's B matrices joined block-diagonally (``[M, n * R,
            sum O]``), so q/k/v's expand is one GEMM, not three, and gate/up's one, not two;
  folded    each group's A matrices appended to its base weight's output columns, so the base
            GEMM also makes ``x @ A`` (no shrink launch), then XLA's dense expand;
  reduced   both products as multiply-and-sum in float32 over A's minor axis, no GEMM
            (``reference.form_deltas``, ``reduced``: the dense path's form for decode on the GPU):
            XLA makes each shrink one reduction kernel (no split-K GEMM and its reduce) and
            fuses each expand, a sum over R, into an element-wise kernel (a deviceless H100
            compile, 2 layers: 6.5 kernels a layer beside the base step's where the GEMMs add
            16 and folded 8);
  merged    the adapter merged into the weights (``W + A @ B``): what one adapter alone costs
            at best (the lower bound of any form).

    python -m benchmarks.probes.lora_fold [--slots 1,8] [--layers 32]

``folded`` was the question (1.114x the base against the GEMMs' 1.166x at one slot, H100),
``reduced`` the next. The step's LoRA terms cost about 11.6 us a group at one token on
an H100 (launch latency, not bytes), two launches a group; folding removes one launch a group
and adds ``slots x rank`` columns to each base GEMM. Each form's output is checked against the
dense product (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import best_time
from jaxserve.models.layers import rms_norm, rms_rows
from pallas_kernels.lora import dispatch, reference

H, Q, KV, INTER, RANK, TOKENS = 4096, 4096, 1024, 14336, 16, 16
GROUPS = {  # group -> (in features, each output's features)
    "qkv": (H, (Q, KV, KV)),
    "o": (Q, (H,)),
    "gate_up": (H, (INTER, INTER)),
    "down": (INTER, (H,)),
}


def make_layer(key, slots: int) -> dict:
    """One layer's base weights [in, out] and each group's A [M, n * R, in] (as the stacks
    store it) and Bs [M, R, O]."""
    keys = iter(jax.random.split(key, 32))
    layer: dict = {"attn_norm": jnp.ones(H, jnp.bfloat16), "mlp_norm": jnp.ones(H, jnp.bfloat16)}
    for group, (size_in, outs) in GROUPS.items():
        w = jax.random.normal(next(keys), (size_in, sum(outs)), jnp.bfloat16) * 0.02
        a = jax.random.normal(next(keys), (slots, len(outs) * RANK, size_in), jnp.bfloat16) * 0.02
        bs = tuple(
            jax.random.normal(next(keys), (slots, RANK, o), jnp.bfloat16) * 0.02 for o in outs
        )
        layer[group] = (w, a, bs)
    return layer


def fold(layer: dict) -> dict:
    """Each group's base weight with every slot's A appended to its output columns."""
    folded = dict(layer)
    for group in GROUPS:
        w, a, bs = layer[group]
        slots, cols, size_in = a.shape
        a_cols = jnp.transpose(a, (2, 0, 1)).reshape(size_in, slots * cols)  # [in, M * n * R]
        folded[group] = (jnp.concatenate([w, a_cols], axis=1), a, bs)
    return folded


def join(layer: dict) -> dict:
    """Each group's B matrices as one block-diagonal ``[M, n * R, sum O]``: its n expands in
    one GEMM (the zeros off the diagonal add nothing)."""
    joined = dict(layer)
    for group in GROUPS:
        w, a, bs = layer[group]
        slots, cols, _ = a.shape
        rank, width = cols // len(bs), sum(b.shape[2] for b in bs)
        block = jnp.zeros((slots, cols, width), bs[0].dtype)
        col = 0
        for i, b in enumerate(bs):
            block = block.at[:, i * rank : (i + 1) * rank, col : col + b.shape[2]].set(b)
            col += b.shape[2]
        joined[group] = (w, a, (block,))
    return joined


def merge(layer: dict, slot: int) -> dict:
    """Slot ``slot``'s adapter merged into the base weights (``W + A @ B``)."""
    merged = dict(layer)
    for group in GROUPS:
        w, a, bs = layer[group]
        parts = jnp.split(a[slot], len(bs), axis=0)  # [R, in] each
        delta = jnp.concatenate([p.T @ b[slot] for p, b in zip(parts, bs, strict=True)], axis=1)
        merged[group] = ((w.astype(jnp.float32) + delta).astype(w.dtype), a, bs)
    return merged


def step(layers: list[dict], x: jax.Array, slots: jax.Array, form: str) -> jax.Array:
    """The step's projections in ``form`` (see the module docstring)."""
    num_slots = layers[0]["qkv"][1].shape[0]
    mask = reference.slot_mask(slots, num_slots, x.dtype)

    def group(name: str, layer: dict, rows: jax.Array, scale: jax.Array | None):
        w, a, bs = layer[name]
        inp = rows if scale is None else scale * rows
        _, outs = GROUPS[name]
        if form == "folded":
            y = inp @ w
            base, xa = y[:, : sum(outs)], y[:, sum(outs) :]
            xa = xa.reshape(-1, num_slots, a.shape[1]) * mask[:, :, None]
            parts = jnp.split(xa, len(bs), axis=2)
            terms = [jnp.einsum("TMR,MRO->TO", p, b) for p, b in zip(parts, bs, strict=True)]
            return base + jnp.concatenate(terms, axis=1)
        base = inp @ w
        if form in ("base", "merged"):
            return base
        if form == "kernel":
            terms = dispatch.lora_deltas(rows, a, bs, slots, mask, scale)
        else:  # dense, joined (its layers' B joined: one term a group) or reduced
            how = "reduced" if form == "reduced" else "gemm"
            terms = reference.form_deltas(inp, a, bs, mask, how)
        return base + jnp.concatenate(terms, axis=1)

    for layer in layers:
        rows = rms_rows(x, 1e-5)
        qkv = group("qkv", layer, rows, layer["attn_norm"])
        attn = qkv[:, :Q]  # stands in for attention's output (same shape)
        x = x + group("o", layer, attn, None)
        rows = rms_rows(x, 1e-5)
        gate_up = group("gate_up", layer, rows, layer["mlp_norm"])
        h = jax.nn.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        x = x + group("down", layer, h, None)
    return rms_norm(x, jnp.ones(H, x.dtype), 1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="1,8", help="adapter slots (--max-loras) to try")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20, help="calls a timed run")
    parser.add_argument("--forms", default="base,dense,joined,kernel,folded,reduced,merged")
    parser.add_argument("--out", default=None, help="results JSON")
    args = parser.parse_args()
    forms = args.forms.split(",")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    results = []
    for num_slots in [int(s) for s in args.slots.split(",")]:
        key = jax.random.key(num_slots)
        layers = [make_layer(jax.random.fold_in(key, i), num_slots) for i in range(args.layers)]
        x = jax.random.normal(jax.random.fold_in(key, 10**6), (TOKENS, H), jnp.bfloat16)
        slots = jnp.zeros(TOKENS, jnp.int32).at[0].set(1)  # one token on slot 1: batch 1
        variants = {
            "folded": [fold(layer) for layer in layers] if "folded" in forms else None,
            "joined": [join(layer) for layer in layers] if "joined" in forms else None,
            "merged": [merge(layer, 0) for layer in layers] if "merged" in forms else None,
        }
        want = None
        row: dict = {"slots": num_slots, "layers": args.layers}
        for form in forms:
            weights = variants.get(form) or layers
            call = functools.partial(jax.jit(step, static_argnames="form"), form=form)
            out = np.asarray(call(weights, x, slots), np.float32)  # (compiles)
            if form == "dense":
                want = out
            row[f"{form}_ms"] = best_time(call, weights, x, slots, iters=args.iters) * 1e3
            if want is not None and form in ("kernel", "joined", "folded", "merged", "reduced"):
                rows = slice(0, 1) if form == "merged" else slice(None)  # merged: all rows
                row[f"{form}_max_error"] = float(np.abs(out[rows] - want[rows]).max())
            del weights
        results.append(row)
        print(json.dumps(row), flush=True)
        del layers, variants
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'slots':>5} " + " ".join(f"{form + ' ms':>11}" for form in forms) + "  vs base")
    for row in results:
        times = " ".join(f"{row.get(f'{form}_ms', float('nan')):>11.3f}" for form in forms)
        ratios = " ".join(
            f"{form} {row[f'{form}_ms'] / row['base_ms']:.3f}x"
            for form in forms
            if form != "base" and "base_ms" in row and f"{form}_ms" in row
        )
        print(f"{row['slots']:>5} {times}  {ratios}")


if __name__ == "__main__":
    main()
