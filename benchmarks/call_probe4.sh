#!/usr/bin/env bash
# Host launch cost per XLA command-buffer setting, and structured outputs with and without.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
git log -1 --format=%h
ALL="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
i=0
for flags in "" "$ALL"; do
  i=$((i+1)); echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 110 python3 benchmarks/decode_roofline.py --iters 10 --batches 1,64 --contexts 1024 > "$OUT/flags$i.log" 2>&1
  grep '^row' "$OUT/flags$i.log"; grep -E "Error|error:" "$OUT/flags$i.log" | head -2
done
for flags in "" "$ALL"; do
  i=$((i+1)); echo "== structured outputs, XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 170 python3 benchmarks/structured_outputs.py --num-compile-schemas 20 --output-json "$OUT/so$i.json" > "$OUT/so$i.log" 2>&1
  tail -7 "$OUT/so$i.log"
done
