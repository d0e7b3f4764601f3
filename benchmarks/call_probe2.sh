#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
timeout 200 python3 benchmarks/structured_outputs.py --num-compile-schemas 20 --output-json "$OUT/so.json" > "$OUT/so.log" 2>&1
tail -9 "$OUT/so.log"
timeout 200 python3 benchmarks/decode_roofline.py --model jaxserve/assets/configs/gemma-2-9b --iters 5 --batches 1 --contexts 1024,4096 --profile-dir "$OUT/gprof" --profile-batches 1 > "$OUT/gemma.log" 2>&1
grep -E "^ +1 +" "$OUT/gemma.log"; tail -2 "$OUT/gemma.log"
for c in 1024 4096; do echo "== ctx $c"; python3 benchmarks/trace_summary.py "$OUT/gprof/b1_ctx$c" --steps 3 --top 12; done > "$OUT/gemma_trace.txt" 2>&1
find "$OUT/gprof" -name "*.xplane.pb" -delete
cat "$OUT/gemma_trace.txt" | cut -c1-150
