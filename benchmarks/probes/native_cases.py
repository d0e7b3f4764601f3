"""Each native test case of a latent attention kernel in a process of its own, with a time
limit and a line per phase, so that a case which stalls says where.

``pytest -m gpu tests/test_mla_mosaic_gpu.py`` on an H100 (2026-12-07) stalled in a different
case on each of three runs (``v3_decode_b1_32k`` twice, ``latent256_heads32_stages3`` once,
which passed alone in a later run) and a run killed at its limit printed nothing of where:
``-q`` dots carry no name and no phase. Here each case runs in a child process that prints a
JSON line as it enters each phase (``inputs``, ``reference``, ``compile``, ``run``: the
kernel on NaN-poisoned memory as the tests run it, ``compare``) with the seconds the previous
one took; the parent kills a child past ``--case-timeout`` and reports the phase it was in,
then goes on with the next case.
``--repeats`` runs each case's compiled kernel several times on fresh inputs (a stall that
comes and goes shows as a repeat that never ends).

    python3 -m benchmarks.probes.native_cases --kernel mosaic --case-timeout 60 --repeats 5

Prints a table last; ``--out`` keeps the rows as JSON. ``--interpret`` runs the kernels in their
interpreters (on the CPU: the small cases; CI checks the harness so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, sys, time
import jax, numpy as np
from tests.conftest import reference_compiled_plainly
kernel, name, repeats, interpret = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
if kernel == "mosaic":
    from tests.test_mla_mosaic_gpu import _gpu_cases, compare
    from pallas_kernels.mla import mosaic_gpu as impl
else:
    from tests.test_mla_kernel import _gpu_cases, attention_kwargs, assert_matches
    from pallas_kernels.mla import triton as impl
from pallas_kernels.mla import reference
case = next(c for c in _gpu_cases() if c.name == name)
last = time.perf_counter()
def phase(what, **extra):
    global last
    now = time.perf_counter()
    print(json.dumps({"phase": what, "previous_s": round(now - last, 2), **extra}), flush=True)
    last = now
for repeat in range(repeats):
    seed = int(np.random.default_rng().integers(2**31))
    phase("inputs", repeat=repeat, seed=seed)
    if kernel == "mosaic":
        args, kwargs = case.inputs(seed), case.kwargs()
    else:
        from tests.test_mla_kernel import make_inputs
        args, kwargs = make_inputs(np.random.default_rng(seed), case), attention_kwargs(case)
    jax.block_until_ready(args)
    phase("reference")
    ref = reference_compiled_plainly(
        lambda *a: reference.ragged_paged_mla_attention(*a, **kwargs), *args)
    ref.block_until_ready()
    phase("compile")
    mode = {}
    if interpret:  # Mosaic GPU's interpreter (NPROC threads) or Pallas Triton's
        from jax.experimental.pallas import mosaic_gpu as plgpu
        mode = {"interpret": plgpu.InterpretGPUParams() if kernel == "mosaic" else True}
    fn = lambda *a: impl.ragged_paged_mla_attention(*a, **kwargs, config=case.config, **mode)
    scrub = jax.numpy.full((1 << 26,), jax.numpy.nan, jax.numpy.float32)  # as _poisoned_run
    scrub.block_until_ready()
    del scrub
    donor = jax.numpy.full(ref.shape, jax.numpy.nan, ref.dtype)
    call = jax.jit(lambda donor, *a: fn(*a), donate_argnums=0)
    compiled = call.lower(donor, *args).compile()
    phase("run")
    out = compiled(donor, *args)
    out.block_until_ready()
    phase("compare")
    if kernel == "mosaic":
        error = compare(case, out, ref)
    else:
        try:
            assert_matches(case, out, ref, seed)
            error = None
        except AssertionError as e:
            error = str(e)[:200]
    phase("done", error=error)
"""


def case_names(kernel: str) -> list[str]:
    module = "tests.test_mla_mosaic_gpu" if kernel == "mosaic" else "tests.test_mla_kernel"
    code = f"from {module} import _gpu_cases; print(' '.join(c.name for c in _gpu_cases()))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()


def run_case(
    kernel: str, name: str, repeats: int, timeout_s: float, interpret: bool = False
) -> dict:
    """The case's phases as its child printed them, and how it ended."""
    start = time.perf_counter()
    env = {**os.environ, "NPROC": "4"} if interpret else None  # Mosaic GPU's interpreter's
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, kernel, name, str(repeats), "1" if interpret else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        out, _ = child.communicate(timeout=timeout_s)
        ended = "exited" if child.returncode == 0 else f"failed (rc {child.returncode})"
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        ended = f"killed after {timeout_s:.0f} s"
    phases = [json.loads(line) for line in out.splitlines() if line.startswith('{"phase"')]
    errors = [p["error"] for p in phases if p["phase"] == "done" and p["error"]]
    row = {
        "case": name,
        "ended": ended,
        "wall_s": round(time.perf_counter() - start, 1),
        "last_phase": phases[-1]["phase"] if phases else "start-up",
        "repeats_done": sum(p["phase"] == "done" for p in phases),
        "errors": errors,
        "phases": phases,
    }
    if ended != "exited":
        row["tail"] = out[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("mosaic", "triton"), default="mosaic")
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    parser.add_argument("--case-timeout", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--interpret", action="store_true", help="the kernels' interpreters (CPU, small cases)"
    )
    args = parser.parse_args()
    names = args.cases.split(",") if args.cases else case_names(args.kernel)
    rows = []
    for name in names:
        row = run_case(args.kernel, name, args.repeats, args.case_timeout, args.interpret)
        print(
            f"{name}: {row['ended']} in {row['wall_s']} s, last phase {row['last_phase']}, "
            f"{row['repeats_done']}/{args.repeats} done, errors {len(row['errors'])}",
            flush=True,
        )
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
    print("| case | ended | wall s | last phase | done | errors |")
    print("|---|---|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['ended']} | {r['wall_s']} | {r['last_phase']} | "
            f"{r['repeats_done']}/{args.repeats} | {len(r['errors'])} |"
        )


if __name__ == "__main__":
    main()
