#!/usr/bin/env bash
# Structured outputs (#18); native tests of the grouped matmul and of attention sinks; host
# launch cost with XLA's command buffers for every op kind, and structured outputs again with
# them when they cut the launch.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
git log -1 --format=%h
so() {  # $1: label
  timeout 165 python3 benchmarks/structured_outputs.py --num-compile-schemas 20 --output-json "$OUT/so_$1.json" > "$OUT/so_$1.log" 2>&1
  echo "== structured outputs ($1)"; tail -7 "$OUT/so_$1.log"
}
so default
for t in "tests/test_grouped_matmul.py" "tests/test_kernel_gpu.py tests/test_kernel_triton.py -k sinks"; do
  echo "== pytest -m gpu $t"; timeout 100 python3 -m pytest -q -m gpu $t 2>&1 | tail -2
done
ALL="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
echo "== launch, default flags"
timeout 75 python3 benchmarks/decode_roofline.py --iters 10 --batches 64 --contexts 1024 > "$OUT/flags0.log" 2>&1; grep '^row' "$OUT/flags0.log"
echo "== launch, XLA_FLAGS=$ALL"
XLA_FLAGS="$ALL" timeout 75 python3 benchmarks/decode_roofline.py --iters 10 --batches 64 --contexts 1024 > "$OUT/flags1.log" 2>&1; grep '^row' "$OUT/flags1.log"; grep -E "rror" "$OUT/flags1.log" | head -2
a=$(grep -o 'launch_ms=[0-9.]*' "$OUT/flags0.log" | cut -d= -f2); b=$(grep -o 'launch_ms=[0-9.]*' "$OUT/flags1.log" | cut -d= -f2)
if [ -n "$a" ] && [ -n "$b" ] && awk "BEGIN {exit !($b < 0.7 * $a)}"; then XLA_FLAGS="$ALL" so command_buffers; fi
