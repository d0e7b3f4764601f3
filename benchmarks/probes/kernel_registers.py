"""Registers and spills of the Mosaic GPU attention kernels, from ptxas, without a GPU.

The kernel runs one warpgroup a program and sits at ptxas' ceiling of 255 registers a thread
(two programs an SM by registers, as by shared memory): a change to a step's order (a tile
kept live longer, more page-table entries carried) can push it into spilling to local memory,
which the interpreter cannot show and a GPU run shows only as time. This compiles the kernel
for a compile-only H100 / H200 (``benchmarks/deviceless.py``) with Mosaic GPU's ptxas report
on (``MOSAIC_GPU_DUMP_PTXAS``), each configuration in a process of its own (ptxas writes to the
process's stderr), and tabulates registers, spill stores and spill loads (bytes a thread):

    .venv-deviceless/bin/python -m benchmarks.probes.kernel_registers \\
        --kv fp8,bf16 --block-kv 64,128 --issue-next read,p,end --lean no,yes --page-size 16,64

A launch of decode shape (64 sequences of one token, Llama-3-8B's 32/8 heads of 128, one KV
split) stands for every launch: registers depend on the tiles and the path, not the sizes.
``--kernel mla`` compiles the latent attention kernel (``pallas_kernels/mla/mosaic_gpu.py``:
three warpgroups, 232 registers a consumer thread by ``setmaxnreg``) at DeepSeek-V3's decode
shape (128 heads, latent 512 + rope 64, pages of 64) for each ``--block-kv``; ``--kv`` and
``--issue-next`` do not apply to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> dict[str, int] | None:
    """``{"registers", "spill_stores", "spill_loads"}`` of the last function ptxas reported in
    ``text`` (its verbose output), or None when it reported none."""
    used, spills = PTXAS_USED.findall(text), PTXAS_SPILLS.findall(text)
    if not used or not spills:
        return None
    stores, loads = spills[-1]
    return {"registers": int(used[-1]), "spill_stores": int(stores), "spill_loads": int(loads)}


def compile_deviceless(gpu: str, kernel: Any, shapes: list[tuple[tuple[int, ...], Any]]) -> None:
    """``kernel`` jitted and compiled for a compile-only ``gpu`` on arguments of ``shapes``
    ((shape, dtype) each), in this process: ptxas reports on its stderr."""
    import jax

    from benchmarks import deviceless

    with deviceless.as_gpu(gpu) as device:
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
        jax.jit(kernel).lower(*args).compile()


def page_operands(seqs: int, context: int, page_size: int) -> list[tuple[tuple[int, ...], Any]]:
    """A decode launch's kv_lens, page table, cu_q_lens and num_seqs: (shape, dtype) each."""
    import jax.numpy as jnp

    shapes = [(seqs,), (seqs, context // page_size), (seqs + 1,), (1,)]
    return [(shape, jnp.int32) for shape in shapes]


def compile_mla(block_kv: int, page_size: int, gpu: str) -> None:
    """The latent attention kernel's decode launch at DeepSeek-V3's shapes."""
    import jax.numpy as jnp

    from pallas_kernels.mla import mosaic_gpu

    seqs, pages, heads, bf16 = 64, 4096, 128, jnp.bfloat16
    config = mosaic_gpu.MlaMosaicConfig(block_kv=block_kv)

    def attention(*a):
        return mosaic_gpu.ragged_paged_mla_attention(*a, sm_scale=0.1, config=config)

    shapes = [((seqs, heads, 512), bf16), ((seqs, heads, 64), bf16)]
    shapes += [((pages, page_size, 1, 512), bf16), ((pages, page_size, 1, 64), bf16)]
    compile_deviceless(gpu, attention, shapes + page_operands(seqs, 4096, page_size))


def compile_kernel(
    kv: str, block_kv: int, issue_next: str, page_size: int, gpu: str, head_dim: int, lean: bool
) -> None:
    """One configuration of the attention kernel's decode launch."""
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import mosaic_gpu

    fp8 = kv == "fp8"
    kv_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    seqs, pages = 64, 4096
    heads = 32 if head_dim <= 128 else 16  # (Gemma-2-9B's 16 of 256 over 8)
    config = mosaic_gpu.KernelConfig(
        fp8_wgmma=fp8,
        block_kv=block_kv,
        num_splits=1,
        issue_next=issue_next,
        lean_registers=lean,
    )
    scales = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}

    def attention(*a):
        return mosaic_gpu.ragged_paged_attention(*a, sm_scale=0.1, config=config, **scales)

    cache = ((pages, page_size, 8, head_dim), kv_dtype)
    shapes = [((seqs, heads, head_dim), jnp.bfloat16), cache, cache]
    compile_deviceless(gpu, attention, shapes + page_operands(seqs, 4096, page_size))


def measure(config: dict, gpu: str) -> dict:
    """One configuration's row (``config``: kv, block_kv, issue_next, page_size, head_dim,
    lean): compiled in a child process, its ptxas report parsed."""
    child = [sys.executable, "-m", "benchmarks.probes.kernel_registers", "--child"]
    child += [json.dumps(config), gpu]
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600)
    found = parse_ptxas(done.stdout + done.stderr)
    if found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return {**config, "error": f"no ptxas report (exit {done.returncode}): {tail}"}
    return {**config, **found}


def table(rows: list[dict]) -> str:
    lines = [
        "| cache | head_dim | block_kv | issue_next | lean | page | registers | spill stores "
        "| spill loads |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = (
            f"| {r['kv']} | {r['head_dim']} | {r['block_kv']} | {r['issue_next']} | "
            f"{'yes' if r['lean'] else 'no'} | {r['page_size']} |"
        )
        if "error" in r:
            lines.append(f"{head} {r['error']} | | |")
        else:
            lines.append(f"{head} {r['registers']} | {r['spill_stores']} | {r['spill_loads']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        config, gpu = json.loads(argv[1]), argv[2]
        if config["kv"] == "mla":
            compile_mla(config["block_kv"], config["page_size"], gpu)
        else:
            compile_kernel(**{k: v for k, v in config.items() if k != "lean"}, gpu=gpu,
                           lean=config["lean"])  # fmt: skip
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="attention", choices=("attention", "mla"))
    parser.add_argument("--kv", default="fp8,bf16", help="cache dtypes: fp8 (native), bf16")
    parser.add_argument("--head-dim", default="128", help="128 (Llama's 32/8 heads), 256 (16/8)")
    parser.add_argument("--block-kv", default="64,128")
    parser.add_argument("--issue-next", default="read,p,end")
    parser.add_argument("--lean", default="no", help="KernelConfig.lean_registers: no,yes")
    parser.add_argument("--page-size", default="16")
    parser.add_argument("--gpu", default="h200", choices=("h100", "h200"))
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.kernel == "mla":  # its cache and copies are its own: one row per block_kv
        args.kv, args.head_dim, args.issue_next, args.lean = "mla", "512", "-", "no"
    grid = itertools.product(
        args.kv.split(","),
        [int(h) for h in args.head_dim.split(",")],
        [int(b) for b in args.block_kv.split(",")],
        args.issue_next.split(","),
        [lean == "yes" for lean in args.lean.split(",")],
        [int(p) for p in args.page_size.split(",")],
    )
    rows = []
    for kv, head_dim, block_kv, issue_next, lean, page_size in grid:
        config = dict(kv=kv, head_dim=head_dim, block_kv=block_kv, issue_next=issue_next,
                      lean=lean, page_size=page_size)  # fmt: skip
        rows.append(measure(config, args.gpu))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
