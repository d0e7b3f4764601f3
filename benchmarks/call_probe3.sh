#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=.
timeout 150 python3 benchmarks/bench_attention.py --suite head256 --out "$OUT/head256.json" > "$OUT/head256.log" 2>&1
sed -n '/ | jax /,$p' "$OUT/head256.log" | cut -c1-140 | head -40; grep -E "Error" "$OUT/head256.log" | head -3
i=0
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"; do
  i=$((i+1)); echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 130 python3 benchmarks/decode_roofline.py --iters 10 --batches 1,64 --contexts 1024 > "$OUT/flags$i.log" 2>&1
  grep '^row' "$OUT/flags$i.log"; grep -E "Error" "$OUT/flags$i.log" | head -2
done
