#!/usr/bin/env bash
# One device call: structured outputs (#18) and the experts' grouped matmul options (#20).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c 'import jax; from jax._src.lib import cuda_versions as c; print("jax", jax.__version__, "cudnn", c.cudnn_get_version() if c else None)' 2>&1 | tail -1
git log -1 --format=%h
timeout 250 python3 benchmarks/structured_outputs.py --output-json "$OUT/so.json" > "$OUT/so.log" 2>&1
tail -12 "$OUT/so.log"
timeout 80 python3 benchmarks/experts_probe.py --kinds xla --label plain --output-json "$OUT/experts.jsonl" > "$OUT/xla.log" 2>&1
XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true timeout 80 python3 benchmarks/experts_probe.py --kinds xla --label cudnn --output-json "$OUT/experts.jsonl" > "$OUT/cudnn.log" 2>&1
timeout 150 python3 benchmarks/experts_probe.py --kinds mgpu --label mgpu --output-json "$OUT/experts.jsonl" > "$OUT/mgpu.log" 2>&1
for f in xla cudnn mgpu; do sed -n '/ label /,$p' "$OUT/$f.log"; grep -E "Error|error" "$OUT/$f.log" | head -3; done
