"""bf16 KV cache against fp8 KV cache: the decode MBU grid and offline throughput side by side.

Reads what the ``kvfp8`` stage of benchmarks/run_h200.sh writes into one directory
(``roofline_kv_{auto,fp8}.json`` from decode_roofline.py, ``throughput_kv_{auto,fp8}.json``
from ``jaxserve bench throughput``, ``greedy_kv_fp8.json`` from greedy_agreement.py) and prints
Markdown tables for benchmarks/RESULTS.md:

    python -m benchmarks.kv_cache_dtype_compare --dir /tmp/out
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def roofline_table(bf16: dict, fp8: dict) -> list[str]:
    """One row per (batch, context) cell either run measured; fp8 speed-up on device time."""
    cells = {(r["batch"], r["context"]): {"bf16": r} for r in bf16["rows"]}
    for r in fp8["rows"]:
        cells.setdefault((r["batch"], r["context"]), {})["fp8"] = r
    lines = [
        f"Decode MBU grid: KV {bf16['meta'].get('kv_cache_dtype')} "
        f"({bf16['meta'].get('kv_tokens', 0):,} tokens) against "
        f"{fp8['meta'].get('kv_cache_dtype')} ({fp8['meta'].get('kv_tokens', 0):,} tokens)",
        "",
        "| batch | ctx | bf16 device ms | fp8 device ms | speed-up | bf16 MBU | fp8 MBU "
        "| bf16 tok/s | fp8 tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(row: dict | None, key: str, fmt: str) -> str:
        return format(row[key], fmt) if row else "-"

    for (batch, context), pair in sorted(cells.items(), key=lambda c: (c[0][1], c[0][0])):
        a, b = pair.get("bf16"), pair.get("fp8")
        speedup = f"{a['device_ms'] / b['device_ms']:.2f}x" if a and b else "-"
        lines.append(
            f"| {batch} | {context} | {cell(a, 'device_ms', '.2f')} | "
            f"{cell(b, 'device_ms', '.2f')} | {speedup} | {cell(a, 'mbu', '.1%')} | "
            f"{cell(b, 'mbu', '.1%')} | {cell(a, 'tokens_per_s', ',.0f')} | "
            f"{cell(b, 'tokens_per_s', ',.0f')} |"
        )
    return lines


def engine_result(throughput: dict) -> dict:
    """jaxserve's run in a ``bench throughput`` JSON: the file itself (one engine, with its
    ``engine`` field), or its ``"jaxserve"`` entry (the older form, one entry per engine)."""
    return throughput.get("jaxserve", throughput)


def throughput_table(bf16: dict, fp8: dict) -> list[str]:
    a, b = engine_result(bf16), engine_result(fp8)
    if "error" in a or "error" in b:
        return [f"Offline throughput: bf16 {a.get('error', 'ok')}, fp8 {b.get('error', 'ok')}"]
    return [
        "Offline throughput (jaxserve bench throughput, 256 x 512 in / 256 out):",
        "",
        "| KV cache | out tok/s | KV cache tokens |",
        "|---|---:|---:|",
        f"| bf16 | {a['output_tokens_per_s']:,.0f} | {a.get('kv_cache_tokens', 0):,} |",
        f"| fp8 | {b['output_tokens_per_s']:,.0f} | {b.get('kv_cache_tokens', 0):,} |",
        "",
        f"fp8 / bf16: {b['output_tokens_per_s'] / a['output_tokens_per_s']:.2f}x tokens/s, "
        f"{b.get('kv_cache_tokens', 0) / max(1, a.get('kv_cache_tokens', 0)):.2f}x KV tokens",
    ]


def greedy_line(result: dict) -> str:
    def share(margin: float) -> str:
        agreement = result[f"agreement_margin_{margin}"]
        value = "-" if agreement is None else f"{agreement:.1%}"
        return f"{value} of the {result[f'steps_margin_{margin}']:,} with a margin >= {margin}"

    return (
        f"Greedy agreement of fp8 KV with bf16 KV, teacher-forced over {result['positions']:,} "
        f"positions: {share(0.1)}, {share(0.25)}; logprob error "
        f"{result['logprob_error_mean']:.4f} mean, {result['logprob_error_max']:.4f} max"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the stage wrote its JSON")
    args = parser.parse_args()
    lines: list[str] = []
    roofline = [load(args.dir / f"roofline_kv_{kv}.json") for kv in ("auto", "fp8")]
    if roofline[0] and roofline[1]:
        lines += roofline_table(roofline[0], roofline[1]) + [""]
    else:
        lines.append("Decode MBU grid: missing roofline_kv_auto.json or roofline_kv_fp8.json")
    throughput = [load(args.dir / f"throughput_kv_{kv}.json") for kv in ("auto", "fp8")]
    if throughput[0] and throughput[1]:
        lines += throughput_table(throughput[0], throughput[1])
    else:
        lines.append(
            "Offline throughput: missing throughput_kv_auto.json or throughput_kv_fp8.json"
        )
    greedy = load(args.dir / "greedy_kv_fp8.json")
    if greedy:
        lines += ["", greedy_line(greedy)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
