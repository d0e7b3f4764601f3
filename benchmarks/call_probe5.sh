#!/usr/bin/env bash
# Native tests of the new kernels, and the batch-1 step with the skinny matmul off and on.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=.
git log -1 --format=%h
for t in tests/test_skinny_matmul.py tests/test_grouped_matmul.py "tests/test_kernel_gpu.py tests/test_kernel_triton.py -k sinks"; do
  echo "== pytest -m gpu $t"; timeout 120 python3 -m pytest -q -m gpu $t -x 2>&1 | tail -2
done
for q in "" "--quantization fp8"; do for mode in off auto; do
  echo "== skinny $mode $q"
  JAXSERVE_SKINNY_MATMUL=$mode timeout 90 python3 benchmarks/decode_roofline.py --iters 10 --batches 1,8 --contexts 1024 $q > "$OUT/skinny_$mode$q.log" 2>&1
  grep '^row' "$OUT/skinny_$mode$q.log"; grep -E "Error" "$OUT/skinny_$mode$q.log" | head -2
done; done
