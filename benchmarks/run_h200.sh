#!/usr/bin/env bash
# The H200 benchmark suite in one device call (results under $OUT; see benchmarks/RESULTS.md):
#   1. attention kernel check against the reference (native, bf16); compile time per bucket
#   2. decode MBU grid through the runner (scenario 1)
#   3. offline throughput, jaxserve (scenario 3)
#   4. jaxserve launch: cold start, first-request TTFT, bench serve sweep, warm start (4, 5)
#   5. offline throughput, Hugging Face generate_batch, if time remains (scenario 3)
# Uses the machine's own jax; carry .whl (starlette, uvicorn wheels).
# Usage: bash benchmarks/run_h200.sh [seconds budget, default 540]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
budget=${1:-540}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export JAXSERVE_COMPILATION_CACHE=/tmp/jaxserve-xla XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/device.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/device.txt"

echo "== 1. kernel check"
timeout 90 python3 -m pytest -q -m gpu tests/test_kernel_gpu.py -x 2>&1 | tail -3

echo "== 1b. compile time of one small and one large bucket ($(left) s left)"
timeout 150 python3 benchmarks/compile_time.py --output-json "$OUT/compile_time.json" 2>&1 | grep -E "^bucket|^all"

echo "== 2. decode roofline ($(left) s left)"
timeout $(( $(left) - 330 )) python3 benchmarks/decode_roofline.py --iters 10 \
  --batches 1,8,64,128,256 --output-json "$OUT/roofline.json" > "$OUT/roofline.log" 2>&1
grep -v -i warn "$OUT/roofline.log" | tail -16

echo "== 3. throughput jaxserve ($(left) s left)"
timeout $(( $(left) - 230 )) python3 -m jaxserve.bench.throughput --engine jaxserve \
  --max-num-batched-tokens 2048 --output-json "$OUT/throughput_jaxserve.json" > "$OUT/throughput_jaxserve.log" 2>&1
tail -1 "$OUT/throughput_jaxserve.log"

echo "== 4. launch + serve ($(left) s left)"
model=jaxserve/assets/configs/llama-3-8b
flags="--load-format dummy --max-model-len 4096 --port 8011 --max-num-batched-tokens 2048"
for phase in cold warm; do
  [ "$(left)" -lt 60 ] && break
  t0=$(date +%s.%N)
  python3 -m jaxserve.cli launch $model $flags > "$OUT/launch_$phase.log" 2>&1 &
  pid=$!
  until curl -sf localhost:8011/health >/dev/null; do sleep 0.5; kill -0 $pid 2>/dev/null || break; done
  python3 - "$t0" "$phase" <<'PY' | tee -a "$OUT/startup.jsonl"
import json, sys, time, httpx
t0, phase = float(sys.argv[1]), sys.argv[2]
model = httpx.get("http://localhost:8011/v1/models").json()["data"][0]["id"]
body = {"model": model, "prompt": list(range(1000, 1512)), "max_tokens": 16, "stream": True,
        "ignore_eos": True}
sent = time.time()
with httpx.stream("POST", "http://localhost:8011/v1/completions", json=body, timeout=120) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            first = time.time()
            break
print(json.dumps({"phase": phase, "ready_s": round(sent - t0, 1),
                  "first_token_s": round(first - t0, 1), "ttft_ms": round((first - sent) * 1e3, 1)}))
PY
  if [ "$phase" = cold ]; then
    timeout $(( $(left) - 120 )) python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 \
      --request-rates 2,4,8,16,inf --num-prompts 40 --random-input-len 512 --random-output-len 128 \
      --ignore-eos --result-dir "$OUT/serve" --disable-tqdm > "$OUT/serve.log" 2>&1
    grep -E "Request rate|Successful|Output token|Median TTFT|P95 TTFT|P95 ITL|Median ITL" "$OUT/serve.log"
  fi
  kill -TERM $pid; wait $pid
  grep -E "KV cache size|Maximum concurrency|Compiled" "$OUT/launch_$phase.log"
done

echo "== 5. throughput hf ($(left) s left)"
if [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 10 )) python3 -m jaxserve.bench.throughput --engine hf \
    --output-json "$OUT/throughput_hf.json" > "$OUT/throughput_hf.log" 2>&1
  tail -1 "$OUT/throughput_hf.log"
else
  echo "skipped: not enough time left"
fi
echo "== done in $(( $(date +%s) - start )) s"
