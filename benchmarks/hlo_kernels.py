"""The kernels of an optimized XLA program, read from its HLO text: each fusion and custom call
outside the fused computations, grouped by kind, target and output shape, with the source op
that XLA's metadata names. A profile says how long each kernel took; this says what it holds.

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" python3 -m ...   # on the device
    python -m benchmarks.hlo_kernels /tmp/hlo/module_0123.jit_step.*after_optimizations.txt
    python -m benchmarks.hlo_kernels --largest /tmp/hlo   # the largest after-optimizations file

Grouped rows print largest first (the output bytes of one kernel times its count); ``--json``
writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(fusion|custom-call)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_KIND = re.compile(r"kind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_SHAPE = re.compile(r"(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # a fusion's kind (kLoop, kInput, kOutput, kCustom) or "custom-call"
    target: str  # the custom call's target, or the fusion's first op after its parameters
    shape: str  # the output's type as HLO prints it
    op_name: str  # the source op (XLA's metadata), shortened

    @property
    def output_bytes(self) -> int:
        total = 0
        for dtype, dims in _SHAPE.findall(self.shape):
            size = _BYTES.get(dtype) or _bits(dtype) // 8
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size
        return total


def _bits(dtype: str) -> int:
    """Bits of an HLO element type: ``f8e4m3fn`` 8, ``s32`` 32, ``f16`` 16."""
    return 8 if dtype.startswith("f8") else max(8, int(re.sub(r"\D", "", dtype) or 8))


def parse(text: str) -> list[Kernel]:
    """Every fusion and custom call of the program that runs as a kernel: those in computations
    that no fusion calls (the entry, loop bodies, command buffers)."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None or line.startswith(("ENTRY", "%")) and line.rstrip().endswith("{"):
            match = _COMPUTATION.match(line)
            if match:
                current = match.group(1)
                blocks[current] = []
                continue
        if current is not None:
            blocks[current].append(line)
    fused = {name for lines in blocks.values() for line in lines for name in _CALLS.findall(line)
             if " fusion(" in line}  # fmt: skip
    kernels = []
    for computation, lines in blocks.items():
        if computation in fused:
            continue
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match:
                kernels.append(_kernel(match, line, blocks))
    return kernels


def _kernel(match: re.Match[str], line: str, blocks: dict[str, list[str]]) -> Kernel:
    name, shape, op = match.groups()
    if op == "custom-call":
        target = _TARGET.search(line)
        kind, what = "custom-call", target.group(1) if target else "?"
    else:
        kind_match, calls = _KIND.search(line), _CALLS.search(line)
        kind = kind_match.group(1) if kind_match else "?"
        what = _first_op(blocks.get(calls.group(1), []) if calls else [])
    op_name = _OP_NAME.search(line)
    source = op_name.group(1) if op_name else ""
    return Kernel(name, kind, what, shape.strip(), "/".join(source.split("/")[-2:]))


def _first_op(lines: list[str]) -> str:
    """The ops a fused computation holds, besides parameters and tuples, most frequent first."""
    ops = Counter()
    for line in lines:
        match = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S+(?:\{[^}]*\})?\s+([\w\-]+)\(", line)
        if match and match.group(1) not in ("parameter", "tuple", "get-tuple-element", "constant"):
            ops[match.group(1)] += 1
    return "+".join(op for op, _ in ops.most_common(3)) or "?"


def grouped(kernels: list[Kernel]) -> list[dict]:
    """One row per (kind, target, shape): its count, one kernel's output bytes, a source op."""
    rows: dict[tuple[str, str, str], dict] = {}
    for k in kernels:
        row = rows.setdefault(
            (k.kind, k.target, k.shape),
            {"kind": k.kind, "what": k.target, "shape": k.shape, "count": 0,
             "output_bytes": k.output_bytes, "op_name": k.op_name},
        )  # fmt: skip
        row["count"] += 1
    return sorted(rows.values(), key=lambda r: -r["output_bytes"] * r["count"])


def print_rows(rows: list[dict], top: int) -> None:
    """The ``top`` grouped rows as a table."""
    print("| count | kind | holds | output | MB each | source op |")
    print("|---:|---|---|---|---:|---|")
    for r in rows[:top]:
        print(f"| {r['count']} | {r['kind']} | {r['what'][:48]} | {r['shape'][:40]} | "
              f"{r['output_bytes'] / 1e6:.2f} | {r['op_name'][:60]} |")  # fmt: skip


def largest_module(directory: Path) -> Path:
    files = sorted(directory.glob("*after_optimizations.txt"), key=lambda p: -p.stat().st_size)
    if not files:
        raise SystemExit(f"no *after_optimizations.txt under {directory}")
    return files[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="an HLO text file, or a dump directory")
    parser.add_argument("--largest", action="store_true", help="path is a dump directory")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    path = largest_module(args.path) if args.largest else args.path
    kernels = parse(path.read_text())
    rows = grouped(kernels)
    kinds = Counter(k.kind for k in kernels)
    counts = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    print(f"{path.name}: {len(kernels)} kernels ({counts})")
    print_rows(rows, args.top)
    if args.json:
        args.json.write_text(json.dumps({"file": path.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
