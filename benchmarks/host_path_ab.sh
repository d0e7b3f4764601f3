#!/usr/bin/env bash
# Batch-1 latency before/after a host-path change, in one device call: for each tree, the model
# step alone and the offline loop (decode_roofline.py, batch 1 and 64, 1,024 context), offline
# `jaxserve bench latency` (1000 in / 256 out, batch 1) and one streamed request at a time over
# HTTP (`jaxserve bench serve --max-concurrency 1`); then, for this tree, a profile of the batch-1
# step summarised per kernel. OTHER: a tree of an earlier commit
# (`git archive COMMIT jaxserve pallas_kernels benchmarks | tar -x -C DIR`).
#   bash benchmarks/host_path_ab.sh .bench_before
set -uo pipefail
OTHER=${1:?usage: host_path_ab.sh OTHER_TREE}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export JAXSERVE_COMPILATION_CACHE=/tmp/jaxserve-xla
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
MODEL=$PWD/jaxserve/assets/configs/llama-3-8b
FLAGS="--load-format dummy --max-model-len 4096 --max-num-batched-tokens 1024"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"

run_tree() {  # $1: tree, $2: label
  ( cd "$1" && export PYTHONPATH=.:/tmp/site
    python3 -m benchmarks.decode_roofline --iters 10 --batches 1,64 --contexts 1024 \
      --output-json "$OUT/roofline_$2.json" > "$OUT/roofline_$2.log" 2>&1
    python3 -m jaxserve.cli bench latency --model "$MODEL" $FLAGS --batch-size 1 \
      --input-len 1000 --output-len 256 --num-iters-warmup 2 --num-iters 5 \
      --output-json "$OUT/latency_$2.json" > "$OUT/latency_$2.log" 2>&1
    python3 -m jaxserve.cli launch "$MODEL" $FLAGS --port 8011 > "$OUT/launch_$2.log" 2>&1 &
    pid=$!
    until curl -sf localhost:8011/health >/dev/null; do
      sleep 0.5; kill -0 $pid 2>/dev/null || break
    done
    python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 --max-concurrency 1 \
      --request-rate inf --num-prompts 6 --random-input-len 1000 --random-output-len 256 \
      --ignore-eos --disable-tqdm --result-dir "$OUT/serve_$2" > "$OUT/serve_$2.log" 2>&1
    kill -TERM $pid; wait $pid )
  echo "== $2"
  grep -E "^ +1 +1024" "$OUT/roofline_$2.log" || tail -3 "$OUT/roofline_$2.log"
  grep -E "^ +64 +1024" "$OUT/roofline_$2.log"
  grep -E "TPOT|TTFT|Avg latency" "$OUT/latency_$2.log" | head -4
  grep -E "Mean TPOT|Median TPOT|Mean TTFT|Median ITL" "$OUT/serve_$2.log"
}

run_tree "$OTHER" before
run_tree . after
( export PYTHONPATH=.:/tmp/site
  python3 -m benchmarks.decode_roofline --iters 5 --batches 1 --contexts 1024 \
    --profile-dir "$OUT/profile" --profile-batches 1 > "$OUT/profile.log" 2>&1
  python3 -m benchmarks.trace_summary "$OUT/profile" --steps 3 --top 20 | tee "$OUT/trace_summary.txt"
  find "$OUT/profile" -name "*.xplane.pb" -delete
  python3 -m benchmarks.probes.fusion_probe --batches 1,64 2>&1 | tail -4 )
