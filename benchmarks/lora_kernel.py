"""The grouped LoRA kernel against the dense product and the bytes floor, at Llama-3-8B's shapes.

For each projection group of a layer at rank 16 (``--rank``): qkv (4096 -> 4096 + 1024 + 1024,
one joined A), o (4096 -> 4096), gate/up (4096 -> 14336 + 14336, one joined A) and down (14336 ->
4096), with M adapter slots (``--slots``, default 1, 8, 64) and T tokens (``--tokens``, default
1, 64, 256) spread round-robin over min(M, T) slots (``--base-share`` of them on the base model
instead), times:
  kernel  ``pallas_kernels.lora.triton.lora_deltas`` (sort, shrink, expand: two launches),
  one launch  the same with ``LoraKernelConfig(fused=True)``, at steps of at most 16 tokens,
          over its steps along X (``--fused-block-ks``; the table shows ``FUSED_BLOCK_K``'s),
  split-K ``pallas_kernels.lora.split_k.lora_deltas`` (one launch, X split across programs,
          atomic adds), at every size,
  dense   ``pallas_kernels.lora.reference.lora_deltas`` (every slot's A and B, the one-hot
          mask between: what the model ran before the kernel, and runs off the GPU),
against the floor: the bytes of the used slots' A and B, plus x read and the terms written, at
4.3 TB/s. Each executable runs over ``--copies`` distinct weight stacks (so nothing is served
from the 50 MB L2); a time is the best of 5 runs, per call. The last table adds the groups up as
one model step's LoRA work (32 layers).

    python -m benchmarks.lora_kernel --output-json lora_kernel.json   # a few minutes on the H200
    python -m benchmarks.lora_kernel --smoke                          # tiny, interpret mode (CPU)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import BANDWIDTH, best_time
from pallas_kernels.lora import reference, split_k
from pallas_kernels.lora import triton as lt

LAYERS = 32
# name: (in features, out features of each projection sharing the input)
GROUPS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
SMOKE_GROUPS = {"qkv": (64, (64, 16, 16)), "down": (96, (64,))}
FUSED_MAX_TOKENS = 16  # the one launch is timed at steps of at most this many tokens


def token_slots(num_tokens: int, num_slots: int, base_share: float) -> np.ndarray:
    """Round-robin over min(M, T) slots (1..M), the first ``base_share`` of tokens on none,
    shuffled so the kernel's sort has work."""
    slots = (np.arange(num_tokens) % min(num_slots, num_tokens)) + 1
    slots[: int(base_share * num_tokens)] = 0
    return np.random.default_rng(0).permutation(slots).astype(np.int32)


def used_bytes(x_in: int, outs: tuple[int, ...], rank: int, slots: np.ndarray, itemsize: int):
    """The floor's bytes: the used slots' A and B, x read, the terms written."""
    used = len(set(slots.tolist()) - {0})
    weights = used * (x_in * rank * len(outs) + rank * sum(outs)) * itemsize
    return weights + len(slots) * (x_in + sum(outs)) * itemsize


def run_all(fn, xs, stacks, slots):
    return [fn(x, a, bs, slots) for x, (a, bs) in zip(xs, stacks, strict=True)]


def kernel_all(xs, stacks, slots, interpret: bool, config=lt.LoraKernelConfig()):
    call = functools.partial(lt.lora_deltas, interpret=interpret, config=config)
    return run_all(call, xs, stacks, slots)


def split_k_all(xs, stacks, slots, interpret: bool):
    call = functools.partial(split_k.lora_deltas, interpret=interpret)
    return run_all(call, xs, stacks, slots)


def dense_all(xs, stacks, slots):
    return run_all(reference.lora_deltas, xs, stacks, slots)


def make_stacks(key, m: int, x_in: int, outs, rank: int, copies: int, dtype):
    stacks = []
    for c in range(copies):
        k = jax.random.fold_in(key, c)
        a = jax.random.normal(k, (m, rank * len(outs), x_in), dtype) / x_in**0.5
        bs = tuple(
            jax.random.normal(jax.random.fold_in(k, i + 1), (m, rank, o), dtype) / rank**0.5
            for i, o in enumerate(outs)
        )
        stacks.append((a, bs))
    return stacks


def measure(args, groups) -> list[dict]:
    interpret = args.smoke or jax.default_backend() != "gpu"
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    copies = 2 if args.smoke else args.copies
    runs = dict(iters=2 if args.smoke else args.iters, runs=1 if args.smoke else 5)
    rows = []
    key = jax.random.key(0)
    for name, (x_in, outs) in groups.items():
        for m in [int(s) for s in args.slots.split(",")]:
            stacks = make_stacks(
                jax.random.fold_in(key, m), m, x_in, outs, args.rank, copies, dtype
            )
            for t in [int(s) for s in args.tokens.split(",")]:
                xs = [jax.random.normal(jax.random.key(i), (t, x_in), dtype) for i in range(copies)]
                slots_np = token_slots(t, m, args.base_share)
                slots = jnp.asarray(slots_np)
                kernel = jax.jit(kernel_all, static_argnums=(3, 4))
                kernel_s = best_time(kernel, xs, stacks, slots, interpret, **runs) / copies
                sweep: dict[int, float] = {}  # the one launch's step along X -> us
                if t <= FUSED_MAX_TOKENS and lt.one_launch_rank(args.rank):
                    for block_k in [int(k) for k in args.fused_block_ks.split(",")]:
                        one = lt.LoraKernelConfig(block_k=block_k, fused=True)
                        sec = best_time(kernel, xs, stacks, slots, interpret, one, **runs)
                        sweep[block_k] = sec / copies * 1e6
                split_us = None  # (the split-K form takes ranks that are powers of two from 16)
                if lt.one_launch_rank(args.rank):
                    split = jax.jit(split_k_all, static_argnums=(3,))
                    split_s = best_time(split, xs, stacks, slots, interpret, **runs) / copies
                    split_us = split_s * 1e6
                dense_s = best_time(jax.jit(dense_all), xs, stacks, slots, **runs) / copies
                floor = used_bytes(x_in, outs, args.rank, slots_np, jnp.dtype(dtype).itemsize)
                floor_s = floor / BANDWIDTH
                rows.append(
                    dict(group=name, slots=m, tokens=t, used=len(set(slots_np.tolist()) - {0}),
                         kernel_us=kernel_s * 1e6, one_launch_us=one_launch_us(sweep),
                         split_k_us=split_us,
                         fused_block_k_us=sweep,
                         dense_us=dense_s * 1e6, floor_us=floor_s * 1e6)
                )  # fmt: skip
                r = rows[-1]
                print(
                    f"  {name:8s} M={m:<3d} T={t:<4d} used={r['used']:<3d} kernel "
                    f"{r['kernel_us']:8.1f} us  split-K {_us(r['split_k_us'])} us  "
                    f"dense {r['dense_us']:8.1f} us  floor "
                    f"{r['floor_us']:6.1f} us"
                    + "".join(f"  one launch, block_k {k}: {v:.1f} us" for k, v in sweep.items()),
                    flush=True,
                )
            del stacks
    return rows


def one_launch_us(sweep: dict[int, float]) -> float | None:
    """The one launch's time at its default step along X, else the sweep's first."""
    return sweep.get(lt.FUSED_BLOCK_K, next(iter(sweep.values()), None))


def _step_ms(cell: list[dict], key: str) -> float | None:
    """One model step's sum (ms) of ``key`` over the groups; None where one was not timed."""
    values = [r[key] for r in cell]
    return None if None in values else LAYERS * sum(values) / 1e3


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_tables(rows: list[dict]) -> None:
    print("\n| group | slots | tokens | used | kernel us | one launch us | split-K us | dense us "
          "| floor us | kernel %floor | dense / kernel |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['group']} | {r['slots']} | {r['tokens']} | {r['used']} | "
            f"{r['kernel_us']:.1f} | {_us(r['one_launch_us'])} | {_us(r['split_k_us'])} | "
            f"{r['dense_us']:.1f} | "
            f"{r['floor_us']:.1f} | "
            f"{r['floor_us'] / r['kernel_us']:.0%} | {r['dense_us'] / r['kernel_us']:.2f}x |"
        )
    print(f"\none model step's LoRA terms ({LAYERS} layers, every group):")
    print("| slots | tokens | kernel ms | one launch ms | split-K ms | dense ms | floor ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    cells = sorted({(r["slots"], r["tokens"]) for r in rows})
    for m, t in cells:
        cell = [r for r in rows if (r["slots"], r["tokens"]) == (m, t)]
        keys = ("kernel_us", "one_launch_us", "split_k_us", "dense_us", "floor_us")
        total = {k: _step_ms(cell, k) for k in keys}
        print(f"| {m} | {t} | {total['kernel_us']:.3f} | {_ms(total['one_launch_us'])} | "
              f"{_ms(total['split_k_us'])} | "
              f"{total['dense_us']:.3f} | {total['floor_us']:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--slots", default="1,8,64")
    parser.add_argument("--tokens", default="1,64,256")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-share", type=float, default=0.0, help="tokens on no adapter")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument(
        "--fused-block-ks", default="128,256,512", help="the one launch's steps along X, swept"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    if args.smoke:
        args.slots, args.tokens, args.rank = "1,3", "1,20", 16  # T=1: one launch timed too
        args.fused_block_ks = "16,32"
        groups = SMOKE_GROUPS
    else:
        groups = {g: GROUPS[g] for g in args.groups.split(",")}
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = measure(args, groups)
    print_tables(rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
