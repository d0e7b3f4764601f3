#!/usr/bin/env bash
# Before/after on one device, in one call: the decode MBU grid (batch 1, 64, 256 at 1,024
# context) and offline throughput (256 x 512/256), for this tree and for another tree of the
# project (an earlier commit: `git archive COMMIT jaxserve pallas_kernels benchmarks | tar -x -C DIR`),
# in the order A B B A so that drift on a shared machine hits both. Each run compiles on a
# compilation cache of its own: XLA's autotuner times candidate kernels while it compiles, and
# a cache shared by the trees hands a later run the kernels an earlier run picked, so the
# trees do not get independent picks (on 2026-12-04 one tree's offline throughput spread over
# 8,375-8,824 tok/s in five runs: compare means of several runs, never one pair). Results under $OUT: the table, and
# every log and JSON in one archive (runs.tgz).
#   bash benchmarks/ab_compare.sh .bench_before
set -uo pipefail
OTHER=${1:?usage: ab_compare.sh OTHER_TREE}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import jax; print("jax", jax.__version__)' | tee -a "$OUT/device.txt"

run_tree() {  # $1: tree, $2: label, $3: round
  ( cd "$1" && export PYTHONPATH=. JAXSERVE_COMPILATION_CACHE=/tmp/jaxserve-xla-$2-$3
    python3 -m benchmarks.decode_roofline --iters 20 --batches 1,64,256 --contexts 1024 \
      --output-json "$OUT/roofline_$2_$3.json" > "$OUT/roofline_$2_$3.log" 2>&1
    python3 -m jaxserve.bench.throughput --engine jaxserve --max-model-len 4096 \
      --output-json "$OUT/throughput_$2_$3.json" > "$OUT/throughput_$2_$3.log" 2>&1 )
  echo "$2 round $3: $(grep -c '^row' "$OUT/roofline_$2_$3.log") roofline rows," \
    "$(tail -1 "$OUT/throughput_$2_$3.log")"
}

for round in $(seq 1 "${ROUNDS:-2}"); do  # A B, then B A: an order effect hits both
  if [ $((round % 2)) = 1 ]; then
    run_tree "$OTHER" before "$round"; run_tree . after "$round"
  else
    run_tree . after "$round"; run_tree "$OTHER" before "$round"
  fi
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(kind, label):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{kind}_{label}_*.json"))]
print("| tree | batch | device ms (best of rounds) | wall ms | MBU |")
for label in ("before", "after"):
    runs = load("roofline", label)
    for i, row in enumerate(runs[0]["rows"] if runs else []):
        best = min((r["rows"][i] for r in runs), key=lambda r: r["device_ms"])
        print(f"| {label} | {best['batch']} | {best['device_ms']:.2f} | {best['wall_ms']:.2f} | {best['mbu']:.1%} |")
for label in ("before", "after"):
    tps = [r.get("output_tokens_per_s") or r.get("output_throughput") for r in load("throughput", label)]
    mean = sum(tps) / len(tps) if tps else float("nan")
    print(f"throughput {label}: {[round(t, 1) for t in tps]}, mean {mean:,.1f} tok/s")
PY
tar -czf "$OUT/runs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json) && rm -f "$OUT"/*.log "$OUT"/*.json
