"""The paged MLA kernel against the jnp reference and its floors, at DeepSeek-V3's shapes.

One layer's latent attention on one GPU (128 heads, kv_lora_rank 512, rope 64, page size 64,
bf16; ``--heads 16`` for a tensor-parallel-8 shard), timed as one jitted call:
  decode   a batch of 1, 64, 256 sequences x 4,096 and 32,768 cached tokens, one new token
           each, against the byte floor: the latent bytes the step reads (batch x context x
           (512 + 64) x 2) / 4.3e12 B/s;
  prefill  a 2,048-token step (a whole prompt; a chunk after 6,144 cached tokens) against the
           compute floor: 2 x heads x (visible keys summed over the rows) x (L + R + L) FLOPs
           / 989e12 FLOP/s (bf16 dense);
each on the reference (``JAXSERVE_MLA=off``'s path) and the kernels ``--kernels`` names with
their default blocking: ``triton`` (the Pallas Triton kernel, ``auto``'s on GPUs; the default)
and ``mosaic`` (the Pallas Mosaic GPU wgmma kernel, ``JAXSERVE_MLA=mosaic``; Hopper only,
skipped elsewhere). ``--sweep`` also times other blockings at every cell and reports each
kernel's best (Triton: heads per program, rows, KV tokens a step, warps, stages, splits; Mosaic
GPU: stages, splits). Each row also gives both floors of the cell, bytes and FLOPs
(``byte_floor_us``, ``compute_floor_us``: a decode at 128 heads does 2 x 128 x (512 + 64 + 512)
FLOPs per latent byte pair, so it is near both). A reference cell whose temporaries would pass
``--reference-max-gb`` is skipped.

    python -m benchmarks.mla --out mla.json                 # a few minutes on the H200
    python -m benchmarks.mla --kernels triton,mosaic --sweep --out mla_sweep.json
    python -m benchmarks.mla --smoke --out /tmp/mla.json    # tiny shapes, interpret mode (CPU)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import dataclasses
import functools
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import BANDWIDTH, best_time
from pallas_kernels.mla import mosaic_gpu as mla_mosaic
from pallas_kernels.mla import reference
from pallas_kernels.mla import triton as mla_triton

FLOPS = 989e12  # bf16 dense, the H200's (H100 SXM's) peak


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    latent: int
    rope_dim: int
    page_size: int


V3 = Shape(128, 512, 64, 64)
SMOKE = Shape(16, 128, 16, 16)  # latent 128: the smallest the Mosaic GPU kernel takes


@dataclasses.dataclass(frozen=True)
class Cell:
    step: str  # "decode" or "prefill"
    batch: int  # sequences
    context: int  # cached tokens per sequence after the step
    new_tokens: int  # per sequence this step


def cells(smoke: bool, batches: list[int], contexts: list[int]) -> list[Cell]:
    if smoke:
        return [Cell("decode", 3, 70, 1), Cell("prefill", 1, 48, 24)]
    decode = [Cell("decode", b, c, 1) for b in batches for c in contexts]
    return decode + [Cell("prefill", 1, 2048, 2048), Cell("prefill", 1, 8192, 2048)]


def make_inputs(cell: Cell, shape: Shape, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """A batch of ``cell.batch`` sequences over shuffled pages, random bf16 queries and cache."""
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    pages_per_seq = -(-cell.context // shape.page_size)
    num_pages = cell.batch * pages_per_seq
    rng = np.random.default_rng(seed)
    page_indices = rng.permutation(num_pages).reshape(cell.batch, pages_per_seq)
    num_tokens = cell.batch * cell.new_tokens
    heads, latent, rope_dim = shape.heads, shape.latent, shape.rope_dim
    cu = np.arange(cell.batch + 1, dtype=np.int32) * cell.new_tokens
    return (
        jax.random.normal(k1, (num_tokens, heads, latent), dtype),
        jax.random.normal(k2, (num_tokens, heads, rope_dim), dtype),
        jax.random.normal(k3, (num_pages, shape.page_size, 1, latent), dtype),
        jax.random.normal(k4, (num_pages, shape.page_size, 1, rope_dim), dtype),
        jnp.full((cell.batch,), cell.context, jnp.int32),
        jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray([cell.batch], jnp.int32),
    )


def byte_floor_us(cell: Cell, shape: Shape, itemsize: int) -> float:
    """The latent bytes the step reads (each sequence's context once) / 4.3e12 B/s."""
    nbytes = cell.batch * cell.context * (shape.latent + shape.rope_dim) * itemsize
    return nbytes / BANDWIDTH * 1e6


def compute_floor_us(cell: Cell, shape: Shape) -> float:
    """The causal FLOPs (scores and the weighted latent, every row's visible keys) / 989e12."""
    cached = cell.context - cell.new_tokens
    visible = sum(cached + t + 1 for t in range(cell.new_tokens))  # keys over the rows
    flops = 2 * shape.heads * visible * (2 * shape.latent + shape.rope_dim) * cell.batch
    return flops / FLOPS * 1e6


def floor_us(cell: Cell, shape: Shape, itemsize: int) -> float:
    """Decode: the byte floor; prefill: the compute floor (the table's "% of floor")."""
    if cell.step == "decode":
        return byte_floor_us(cell, shape, itemsize)
    return compute_floor_us(cell, shape)


def reference_gb(cell: Cell, shape: Shape) -> float:
    """The reference's largest temporaries: each row's gathered f32 latents and its scores."""
    rows = cell.batch * cell.new_tokens
    width = -(-cell.context // shape.page_size) * shape.page_size
    per_row = width * (shape.latent + shape.rope_dim + 2 * shape.heads) * 4
    return rows * per_row / 1e9


def sweep_configs(shape: Shape) -> list[mla_triton.MlaConfig]:
    configs = []
    for block_h in (16, 32, 64):
        for block_kv in (16, 32, 64):
            for num_warps in (4, 8):
                if block_h * shape.latent // (32 * num_warps) > 256:
                    continue  # the accumulator alone would pass 256 registers a thread
                configs.append(
                    mla_triton.MlaConfig(block_h=block_h, block_kv=block_kv, num_warps=num_warps)
                )
    configs.append(mla_triton.MlaConfig(block_h=64, block_kv=32, num_stages=3))
    configs.append(mla_triton.MlaConfig(block_h=64, block_kv=32, num_splits=1))
    return configs


# Prefill: more rows per program (fewer re-reads of each latent tile), or fewer heads per token.
PREFILL_SWEEP = [
    mla_triton.MlaConfig(block_rows=128, num_warps=8),
    mla_triton.MlaConfig(block_rows=32, num_warps=4),
    mla_triton.MlaConfig(block_h=16),
    mla_triton.MlaConfig(block_kv=64),
    mla_triton.MlaConfig(num_stages=3),
]


# Mosaic GPU: at 512 + 64 only block_kv 64 with 2 stages fits in shared memory, so the splits
# around the default's (a blocking that does not fit is reported and skipped), and the scores'
# product unrolled.
MOSAIC_SWEEP = [mla_mosaic.MlaMosaicConfig(num_splits=n) for n in (1, 2, 4, 8, 16, 32, 64)]
# The scores' latent product as one unrolled wgmma (before 327b00d: its descriptors spilled).
MOSAIC_SWEEP.append(mla_mosaic.MlaMosaicConfig(latent_chunk=512))


def label(config) -> str:
    """The fields that differ from the default blocking, or ``default``."""
    default = dataclasses.asdict(type(config)())
    fields = dataclasses.asdict(config).items()
    return ",".join(f"{k}={v}" for k, v in fields if v != default[k]) or "default"


# The reference's einsums by XLA's heuristic, untimed: its autotuner timed their candidates at
# every cell's shapes for minutes on an H100 (2026-12-07: the first cell had not printed after
# 200 s) and the reference is only the baseline the kernels are checked and compared against.
REFERENCE_OPTIONS = {"xla_gpu_autotune_level": 0}


def timed(what: str, fn, args, iters: int) -> float:
    """Microseconds per call of the jitted ``fn(*args)`` (``best_time``), after a progress
    line with its compile time (a cut-off run still shows where its time went)."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    us = best_time(compiled, *args, iters=iters) * 1e6
    print(f"   {what}: compiled in {compile_s:.1f} s, {us:.1f} us", flush=True)
    return us


def time_kernel(
    cell: Cell, args, kernel, configs: list, *, sm_scale: float, interpret: bool, iters: int
) -> dict:
    """Microseconds per call of ``kernel`` under each config's label (those that run)."""
    timings = {}
    for config in configs:
        fn = functools.partial(kernel, sm_scale=sm_scale, config=config, interpret=interpret)
        try:
            timings[label(config)] = timed(f"{cell} {label(config)}", jax.jit(fn), args, iters)
        except Exception as error:  # a blocking that does not compile (registers, smem)
            print(f"   {cell} {label(config)}: {type(error).__name__}: {str(error)[:120]}")
    return timings


def mosaic_skip_reason(args, interpret: bool) -> str | None:
    """Why the Mosaic GPU kernel is not timed here: not Hopper, or shapes it does not take."""
    reason = mla_mosaic.unsupported_reason(*args[:4])
    if reason is None and interpret:
        reason = mla_mosaic.interpreter_unsupported_reason()
    if reason is None and not interpret:
        major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
        reason = None if major == "9" else "not a Hopper GPU (wgmma)"
    return reason


def time_cell(cell: Cell, shape: Shape, args, *, kernels: list[str], interpret: bool,
              sweep: bool, iters: int, reference_max_gb: float) -> dict:  # fmt: skip
    sm_scale = (shape.latent + shape.rope_dim) ** -0.5
    itemsize = jnp.dtype(args[2].dtype).itemsize
    row: dict = dataclasses.asdict(cell) | {
        "floor_us": floor_us(cell, shape, itemsize),
        "byte_floor_us": byte_floor_us(cell, shape, itemsize),
        "compute_floor_us": compute_floor_us(cell, shape),
    }
    row["reference_us"] = None  # unless it runs: its temporaries may not fit
    if reference_gb(cell, shape) <= reference_max_gb:
        ref = jax.jit(
            functools.partial(reference.ragged_paged_mla_attention, sm_scale=sm_scale),
            compiler_options=REFERENCE_OPTIONS if jax.default_backend() == "gpu" else None,
        )
        try:
            row["reference_us"] = timed(f"{cell} reference", ref, args, iters)
        except Exception as error:  # out of memory
            print(f"   {cell} reference: {type(error).__name__}: {str(error)[:120]}")
    timing = functools.partial(
        time_kernel, cell, args, sm_scale=sm_scale, interpret=interpret, iters=iters
    )
    if "triton" in kernels:
        configs = [mla_triton.MlaConfig()]
        if sweep:
            configs += sweep_configs(shape) if cell.step == "decode" else PREFILL_SWEEP
        timings = timing(mla_triton.ragged_paged_mla_attention, configs)
        row["kernel_us"] = timings.get("default")
        row["best_config"], row["best_us"] = min(timings.items(), key=lambda kv: kv[1])
        row["configs_us"] = timings
    skip = mosaic_skip_reason(args, interpret) if "mosaic" in kernels else "not asked for"
    if skip is None:
        mosaic_configs = [mla_mosaic.MlaMosaicConfig()] + (MOSAIC_SWEEP if sweep else [])
        timings = timing(mla_mosaic.ragged_paged_mla_attention, mosaic_configs)
        row["mosaic_us"] = timings.get("default")
        if timings:
            best = min(timings.items(), key=lambda kv: kv[1])
            row["mosaic_best_config"], row["mosaic_best_us"] = best
        row["mosaic_configs_us"] = timings
    elif "mosaic" in kernels:
        print(f"   {cell} mosaic: skipped ({skip})")
    return row


def percent(floor: float, value: float | None) -> str:
    return "-" if value is None else f"{100 * floor / value:.0f}%"


def us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def best(r: dict, prefix: str) -> str:
    if r.get(f"{prefix}best_us") is None:
        return "-"
    return f"{r[f'{prefix}best_us']:.1f} ({r[f'{prefix}best_config']})"


def print_table(rows: list[dict]) -> None:
    """Triton's columns as before, then the Mosaic GPU kernel's (``-`` where not timed)."""
    print("| step | batch | context | new | floor us | byte / compute floor us | reference us "
          "| triton us | triton % of floor | triton best us (config) | mosaic us | mosaic % of "
          "floor | mosaic best us (config) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        floors = f"{r['byte_floor_us']:.1f} / {r['compute_floor_us']:.1f}"
        print(
            f"| {r['step']} | {r['batch']} | {r['context']} | {r['new_tokens']} | "
            f"{r['floor_us']:.2f} | {floors} | {us(r['reference_us'])} | "
            f"{us(r.get('kernel_us'))} | {percent(r['floor_us'], r.get('kernel_us'))} | "
            f"{best(r, '')} | {us(r.get('mosaic_us'))} | "
            f"{percent(r['floor_us'], r.get('mosaic_us'))} | {best(r, 'mosaic_')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--heads", type=int, default=V3.heads, help="query heads per GPU")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--kernels",
        default="triton",
        help="of triton,mosaic: the kernels to time (mosaic on Hopper only; not by default "
        "until it has run natively)",
    )
    parser.add_argument("--sweep", action="store_true", help="more blockings per decode cell")
    parser.add_argument("--reference-max-gb", type=float, default=60.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
    shape = SMOKE if args.smoke else dataclasses.replace(V3, heads=args.heads)
    interpret = args.smoke or jax.default_backend() != "gpu"
    iters = 1 if args.smoke else args.iters
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - {"triton", "mosaic"}
    if unknown:
        parser.error(f"--kernels: unknown {sorted(unknown)}; of triton, mosaic")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {shape}", flush=True)
    rows = []
    for cell in cells(args.smoke, batches, contexts):
        inputs = make_inputs(cell, shape, jnp.bfloat16)
        row = time_cell(cell, shape, inputs, kernels=kernels, interpret=interpret,
                        sweep=args.sweep, iters=iters,
                        reference_max_gb=args.reference_max_gb)  # fmt: skip
        print(
            json.dumps({k: v for k, v in row.items() if not k.endswith("configs_us")}), flush=True
        )
        rows.append(row)
        del inputs
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            info = {"device": jax.devices()[0].device_kind, "shape": dataclasses.asdict(shape)}
            json.dump(info | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
