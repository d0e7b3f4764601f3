#!/usr/bin/env bash
# The H200 benchmark suite, in one device call per part (see benchmarks/RESULTS.md).
#   part A: decode MBU grid + offline throughput against Hugging Face (issue scenarios 1, 3)
#   part B: jaxserve launch start-up (cold, warm), first-request TTFT, bench serve sweep (4, 5)
# Uses the machine's own jax; carry .whl (starlette, uvicorn) for part B.
# Usage: bash benchmarks/run_h200.sh A|B   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export JAXSERVE_COMPILATION_CACHE=/tmp/jaxserve-xla
part=${1:-A}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
if [ "$part" = A ]; then
  python3 benchmarks/decode_roofline.py --output-json "$OUT/roofline.json" 2>&1 | tee "$OUT/roofline.log" | grep -v Warning
  python3 -m jaxserve.bench.throughput --engine both --output-json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | tail -8
fi
if [ "$part" = B ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
  model=jaxserve/assets/configs/llama-3-8b
  flags="--load-format dummy --max-model-len 4096 --port 8011 --max-num-batched-tokens 2048"
  for start in cold warm; do
    t0=$(date +%s.%N)
    python3 -m jaxserve.cli launch $model $flags > "$OUT/launch_$start.log" 2>&1 &
    pid=$!
    until curl -sf localhost:8011/health >/dev/null; do sleep 0.5; kill -0 $pid 2>/dev/null || break; done
    python3 - "$t0" <<'PY' | tee -a "$OUT/startup.txt"
import json, sys, time, httpx
t0 = float(sys.argv[1])
body = {"model": httpx.get("http://localhost:8011/v1/models").json()["data"][0]["id"],
        "prompt": list(range(1000, 1512)), "max_tokens": 16, "stream": True, "ignore_eos": True}
sent = time.time()
with httpx.stream("POST", "http://localhost:8011/v1/completions", json=body, timeout=120) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            first = time.time(); break
print(json.dumps({"ready_s": sent - t0, "first_token_s": first - t0, "ttft_ms": (first - sent) * 1e3}))
PY
    if [ "$start" = warm ]; then
      python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 --request-rates 2,4,8,16,inf \
        --num-prompts 64 --random-input-len 512 --random-output-len 128 --ignore-eos \
        --result-dir "$OUT/serve" 2>&1 | tail -40
    fi
    kill -TERM $pid; wait $pid
    grep -E "KV cache size|Maximum concurrency|Compiled|Available KV" "$OUT/launch_$start.log"
  done
fi
