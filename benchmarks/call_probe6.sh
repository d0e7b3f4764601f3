#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=.:/tmp/site
timeout 160 python3 benchmarks/structured_outputs.py --num-compile-schemas 20 --output-json "$OUT/so.json" > "$OUT/so.log" 2>&1
tail -8 "$OUT/so.log"
timeout 60 python3 -m pytest -q -m gpu tests/test_grouped_matmul.py 2>&1 | grep -E "Error|FAILED|passed|failed" | cut -c1-250 | head -12
timeout 60 python3 -m pytest -q -m gpu tests/test_skinny_matmul.py 2>&1 | grep -E "Error|FAILED|passed|failed" | cut -c1-250 | head -12
