#!/usr/bin/env bash
# The H200 benchmark suite, stage by stage (results under $OUT; see benchmarks/RESULTS.md).
# Each argument is STAGE[:SECONDS], run in order, each under its own time limit:
#   kernel       attention kernels against the reference, native (pytest -m gpu): Mosaic GPU
#                (every head size, bf16 and fp16) and the Pallas Triton tier
#   attention    attention tiers against the KV-read floor (bench_attention.py --suite tiers):
#                the Triton kernel forced on the H200 (target >= 40% at decode b=64 x 4096,
#                plus a config sweep there) and Mosaic GPU at the Gemma-2-9B shape (head_dim 256)
#   sinks        gpt-oss-20b's attention (64/8 heads, head_dim 64, full and 128-token window)
#                without and with attention sinks, Mosaic GPU and Triton beside the XLA reference
#                (bench_attention.py --suite sinks; the sink cases of the kernel stage alone:
#                pytest -m gpu -k sinks)
#   fp8start     issue 36 item 5 end to end: cold launches (dummy Llama-3-8B, empty compilation
#                cache) to the end of the background compile, bf16, then fp8 weights + fp8 KV
#                under each of $FP8_START_SETS (default "default autotune0": the XLA option sets of
#                JAXSERVE_FP8_XLA_OPTIONS) -> seconds to the first token and to every bucket,
#                $OUT/fp8start_<mode>.log (target: fp8 at most 1.2x bf16; about 3 cold starts)
#   compile      compile time of one small and one large step bucket (benchmarks/probes/compile_time.py)
#   fp8compile   the 16- and 2,048-token steps in bf16 and fp8, each compiled under XLA's default
#                options, autotune level 0, cuBLAS GEMMs and both: compile s and step ms
#                (benchmarks/probes/fp8_compile.py; about 6 minutes)
#   launch       jaxserve launch, dummy Llama-3-8B: cold start on an empty compilation cache,
#                first-request TTFT, bench serve sweep at 2,4,8,16,inf req/s ($SERVE_PROMPTS
#                prompts per rate, 200 unless set: about 4 minutes), then warm start
#   startup      a real checkpoint (Llama-3-8B shape, bf16, 16 GB in 4 shards, written first and
#                read from the page cache): cold and warm start to the first served token, the
#                exit status after SIGTERM, the start-up lines (about 3 minutes) -> startup.jsonl
#   sweep        the launch stage's serving sweep alone on a started server, after its background
#                compile ends (no cold/warm starts; run it after `startup`, whose programs it shares)
#   background   a cold launch (dummy weights): the first token, then the background compile to
#                its end (every bucket, or the one that failed), and its out-of-memory retries
#   imports      ModelConfig and the tokenizer read through transformers, with torch hidden (as
#                launch does) and not: seconds, and whether torch was imported
#   throughput   offline throughput through jaxserve.LLM: 256 x 512/256 and 1000 x 1024/128
#   hf           offline throughput, Hugging Face generate_batch, 256 x 512/256
#   latency      offline latency of one batch (jaxserve bench latency) at batch 1, 8 and 64,
#                1000 in / 256 out: end to end (avg, p10-p99), TTFT, TPOT, tokens/s
#   roofline     decode MBU grid through the runner (scenario 1)
#   spec         speculative decoding (benchmarks/spec_decode.py): a verify step with k = 1..7
#                drafted tokens against a plain decode step at batch 1, 8, 64 (Llama-3-8B, dummy
#                bf16), the n-gram drafter's host time, the demo model's batch-1 n-gram speed-up,
#                and EAGLE-3 at the published Llama-3.1-8B head shape (random weights) on the
#                Llama-3-8B target: each propose call's ms and the step time, with the drafts
#                left on the device, made ahead of the host behind each verify step
#                (JAXSERVE_DRAFT_AHEAD), with the next verify step dispatched before the last is
#                read back too (JAXSERVE_ASYNC_VERIFY) and brought to the host first (about 6
#                minutes); $SPEC_PARTS picks parts, $SPEC_ARGS adds flags (e.g.
#                "--eagle3-quantization fp8"); EAGLE-3's traced batch-1 steps (verify steps
#                dispatched ahead): the kernels by program and
#                the host's events ->
#                $OUT/spec_eagle3_b1_{kernels,host}.txt
#   cublas       a few roofline cells with XLA's Triton GEMMs off (cuBLAS for every matmul)
#   quant        bf16 vs fp8 weights (W8A8) vs fp8 weights + fp8 KV cache (when the build has
#                EngineConfig.kv_cache_dtype; $QUANT_MODES picks, e.g. "bf16 fp8"): decode
#                grid, offline throughput 256 x 512/256 with its KV capacity line, greedy
#                agreement with bf16 on the dummy weights; about 20 minutes: quant:2400
#                ($QUANT_THROUGHPUT_ARGS adds throughput flags, e.g. "--num-prompts 1000
#                --input-len 1000 --output-len 1000" for TensorRT-LLM's published shape)
#   kvfp8        bf16 KV cache against fp8 (e4m3) KV cache: the fp8 kernel tests natively, the
#                decode MBU grid ($KV_BATCHES x $KV_CONTEXTS) and offline throughput (256 x
#                512/256) for each, their capacity lines, teacher-forced greedy agreement of
#                fp8 with bf16 (benchmarks/greedy_agreement.py), one table -> $OUT/kv_fp8.md
#   hostile      the seven findings of hostile input at full scale against a served Llama-3-8B
#                (benchmarks/hostile_full.py): neighbour latency, memory maps, compiles
#   hostile_demo round three of hostile input (grammars, schemas, tools, operator input:
#                hostile_full.py --only r3,g) against the demo model, whose tokenizer the grammar
#                engine reads (the Llama-3-8B config ships none: its stand-in refuses constraints)
#   reliability  the reliability suite: load scenarios at full scale (JAXSERVE_RELIABILITY_SCALE=full),
#                schema fuzzing, faults, and both rounds of hostile input
#   moe          Qwen3-30B-A3B (dummy bf16): decode at batch 1, 64, 256 against its roofline, one
#                layer's experts alone, its grouped matmuls (the Pallas Triton kernel, ragged_dot,
#                Mosaic GPU) at batch 1, 64, 256 and a 2,048-token prefill, and 256 x 512/256
#                offline throughput against Hugging Face generate_batch (benchmarks/moe.py; about
#                9 minutes: run it alone); HF gets what jaxserve leaves of $MOE_BUDGET seconds (540)
#   gmm          the grouped-matmul kernel's tests natively (pytest -m gpu), then the grouped
#                matmuls of one Qwen3-30B-A3B layer alone on an otherwise empty GPU: the Triton
#                kernel (default tiles and a sweep), XLA's ragged_dot, Mosaic GPU, at batch 1, 64,
#                256 and prefill steps of 2,048 and 8,192 tokens -> $OUT/gmm.json (a few minutes)
#   moe_hf       only the Hugging Face half of moe, for a call of its own when it did not fit
#   lora_kernel  the grouped LoRA kernel (pallas_kernels/lora): its native tests (pytest -m gpu),
#                then benchmarks/lora_kernel.py: rank 16 on Llama-3-8B's projection groups, 1/8/64
#                slots x 1/64/256 tokens, kernel vs the dense product vs the bytes floor, and one
#                model step's sum -> $OUT/lora_kernel.json (a few minutes)
#   gpt_oss      gpt-oss-20b (dummy bf16, shipped config): benchmarks/moe.py's decode, experts and
#                throughput for jaxserve only, attention sinks in the kernels, 2048-token steps
#   skinny       the skinny-matmul kernel: its native tests (pytest -m gpu), then against XLA and
#                the bytes floor at the Llama-3-8B projections, M = 1, 8, 16, 64, bf16 and fp8
#                (benchmarks/skinny_matmul.py, about 3 minutes) -> $OUT/skinny_matmul.{log,json}
#   skinny_sweep the same at M = 1 and 16 over more tile configs (--sweep, up to ~8 minutes), to
#                choose the plan's tiles -> $OUT/skinny_sweep.{log,json}
#   skinny_step  the decode step at batch 1 and 8 (context 1024), bf16 and fp8 weights, with
#                JAXSERVE_SKINNY_MATMUL=off and =auto side by side (decode_roofline.py)
#   deepseek_v3  DeepSeek-V3's shapes (dummy bf16, shipped config) cut to its first 5 layers (3
#                dense, 2 of 256 experts; all 61 do not fit one GPU): benchmarks/moe.py's decode,
#                experts and throughput for jaxserve only; latent attention on the reference,
#                1024-token steps, 2048-token context -> $OUT/deepseek_v3.json
#   mla          the paged MLA kernel: its native tests (pytest -m gpu tests/test_mla_kernel.py),
#                then one layer's latent attention at DeepSeek-V3's shapes (128 heads, 512 + 64,
#                bf16) on the reference and the Pallas Triton kernel: decode at batch 1, 64, 256
#                x context 4,096 and 32,768 against the byte floor (target >= 70% at 64 x 4,096),
#                2,048-token prefill steps against the compute floor, with a blocking sweep at
#                the decode cells (benchmarks/mla.py --sweep) -> $OUT/mla.{log,json}; then the
#                deepseek_v3 stage's 5-layer model with JAXSERVE_MLA=off and auto side by side
#                -> $OUT/deepseek_v3_mla_{off,auto}.{log,json}; about 10 minutes: mla:900
#   moe_fp8      fp8 routed experts: their native tests (pytest -m gpu tests/test_moe_fp8.py),
#                then the grouped matmul with fp8 experts against bf16 at the Qwen3-30B-A3B shape
#                and one device's slice of DeepSeek-V3's at -tp 8 (benchmarks/moe.py
#                --grouped-matmuls-only --fp8-experts) -> $OUT/moe_fp8_{qwen3,dsv3}.json
#   mla_mosaic   the Mosaic GPU MLA kernel (pallas_kernels/mla/mosaic_gpu.py, two consumer
#                warpgroups each holding half the [64, 512] accumulator): benchmarks/mla.py with the Triton and Mosaic GPU kernels side by side at their
#                default blockings ($MLA_KERNELS; MLA_SWEEP=1 adds the blocking sweeps, several
#                minutes more; $MLA_CELLS: --batches/--contexts flags) -> $OUT/mla_mosaic.{log,json}
#   mla_step     the deepseek_v3 stage's 5-layer model, decode at batch 1 and 64 x 4,096 context,
#                with its latent attention on the reference, the Triton and the Mosaic GPU kernel
#                (JAXSERVE_MLA=off, on, mosaic; each a process under $MLA_STEP_S seconds, default
#                170) -> $OUT/deepseek_v3_step_{off,on,mosaic}.{log,json}
#   mla_native   the MLA kernels' native test cases (tests/test_mla_{mosaic_gpu,kernel}.py), each
#                in a process of its own under $MLA_CASE_S seconds (default 45), $MLA_REPEATS
#                times on fresh inputs (default 2), with the phase a stalled case was in
#                (benchmarks/probes/native_cases.py; $MLA_NATIVE_KERNELS: mosaic,triton)
#                -> $OUT/mla_native_{mosaic,triton}.json; about 5 minutes: mla_native:330
#   load         loading a 15 GB safetensors checkpoint (Llama-3-8B shape, bf16, 4 shards) from the
#                page cache (benchmarks/load_speed.py): load_weights' GB/s (target >= 5) beside the
#                loader before it, read / read + device_put alone, threads and staging swept;
#                writes the checkpoint under /tmp first; about 2-3 minutes: load:210
#   so           structured outputs: batch 64 under a JSON schema against the same batch
#                unconstrained, with the host time of each engine call per step
#                (benchmarks/structured_outputs.py, about 2.5 minutes cold) -> $OUT/so.{log,json}
#   head256      Triton attention configs at the Gemma-2-9B shape's decode cells
#                (bench_attention.py --suite head256) -> $OUT/head256.{log,json}
#   gemma        decode at batch 64, contexts 1,024 and 4,096, for Llama-3-8B, Gemma-2-9B and
#                Gemma-3-12B side by side (dummy bf16 weights, decode_roofline.py; about 3 minutes)
#                -> $OUT/gemma_<model>.{log,json}: issue 19's "within 10 points of Llama" cells
#   fp8mm        the fp8-matmul kernel (pallas_kernels/fp8_matmul, #36): its native tests (pytest
#                -m gpu), then benchmarks/fp8_matmul.py (Llama-3-8B projections, M = 1/16/64/128:
#                bf16, XLA's fp8 paths, the kernel W8A8 and weight-only, a tile sweep at M = 1
#                and 16), then the fp8 decode step at batch 1, 8, 64 (context 1024) with
#                JAXSERVE_FP8_MATMUL=off and =auto -> $OUT/fp8_matmul.{log,json}, fp8mm_step_*
#   xla_flags    the decode step at batch 1 and 64 (context 1,024) under XLA's default options and
#                each line of $XLA_FLAG_SETS (default: command buffers off, graphs of any size,
#                more op kinds in graphs), device and wall ms -> $OUT/xla_flags_N.{log,json}
#                (#36 item 6; a model start per line, about 4 minutes)
#   host_launch  the host's time to launch a decode step: the model step alone at batch 1 with a
#                new input buffer, the same one and the previous step held
#                (benchmarks/probes/launch_reuse.py), under XLA's default options and each line
#                of $LAUNCH_XLA_FLAG_SETS (default: no custom calls in the command buffers, no
#                command buffers); then launch_ms (model step and sampler from an idle device) at
#                batch 1 and 64, context 1,024, with each attention path of $LAUNCH_ATTENTION
#                (default "auto triton reference": JAXSERVE_ATTENTION) ->
#                $OUT/launch_reuse_N.{log,json}, $OUT/host_launch_<path>.{log,json} (a model
#                start each, about 6 minutes; LAUNCH_ATTENTION="" leaves the paths out, $LAUNCH_ARGS
#                adds the probe's flags: --smoke on the CPU)
#   step_kernels what a compiled step launches (benchmarks/probes/step_kernels.py): the Llama-3-8B
#                decode step of 16 tokens in bf16, fp8 and with 8 LoRA slots (the kernel count
#                only for those two), and Qwen3-Embedding-0.6B's 16,384-token
#                pooling step: each kernel by kind, what it holds, its output and source op, and
#                the optimized HLO (gzip) -> $OUT/step_*.{kernels.json,hlo.txt.gz} (a minute or two)
#   fp8attn      fp8 KV attention that reads fp8 (#36 item 3): the native path's GPU tests, then
#                bench_attention.py --suite fp8 (the tiles' sweep with FP8ATTN_SWEEP=1): the Mosaic GPU kernel over a bf16 cache,
#                an fp8 cache converted to bf16 (JAXSERVE_FP8_ATTENTION=convert) and read by fp8
#                wgmmas (native, the default), batch 1/8/64/256 x context 1,024/4,096, tokens/s
#                and the ratio to bf16 (target: native >= 1.6x at 64 x 4,096)
#                -> $OUT/attention_fp8.{log,json}
#   highload     issue 36's profile of the full card: `jaxserve bench throughput` at 1000 x
#                1000 in / 1000 out with the engine's step log on (JAXSERVE_STEP_LOG), for each
#                of $HIGHLOAD_MODES (default "bf16 fp8kv") and $HIGHLOAD_SEQS (default "256
#                auto": the old fixed --max-num-seqs and the per-device default), then where the
#                time went by step kind (benchmarks/step_log_summary.py); then, per mode, its
#                main step alone (decode 480 x 1,536 in fp8, 384 in bf16; decode_roofline.py) against its
#                byte floor, 3 steps traced, the kernels by device time ($HIGHLOAD_TRACE=0: not;
#                HIGHLOAD_SEQS="" runs the traced step alone; $HIGHLOAD_ARGS adds throughput flags,
#                e.g. "--block-size 64")
#                -> $OUT/highload_<mode>_<seqs>.{log,json}, _steps.* (about 2-3 minutes a run)
#   splits       the 16-token bucket's attention split plan (#36 item 6): decode at batch 1, 4 and
#                16 (the bucket's fullest), contexts 256, 1,024 and 4,096, bf16, with
#                JAXSERVE_ATTENTION_SPLITS=bucket (every row live: 2 splits) and live (the default:
#                planned for 4 live rows, 8 splits) side by side -> $OUT/splits_{bucket,live}.*
#   issue        the attention kernel's KernelConfig.issue_next (a KV slot's next copies before
#                the softmax or after P, not after P.V) and lean_registers (P.V in place, QK^T
#                looped at head_dim 256; spills at 256 in benchmarks/probes/kernel_registers.py):
#                their GPU tests (pytest -m gpu -k issued_earlier), bench_attention --suite issue
#                (Llama-3-8B decode cells, bf16 and fp8; Gemma-2-9B b=64 x 4,096), then the fp8
#                decode step (64 and 480 x 1,536) with JAXSERVE_ATTENTION_ISSUE_NEXT /
#                _LEAN_REGISTERS at end/off (served), p/on and read/on -> $OUT/issue.*,
#                issue_step_*.* (about 6 minutes; ISSUE_TESTS=0 skips the tests, ISSUE_STEP_FORMS="" the
#                step, ISSUE_ARGS="--head-dims 256" times Gemma-2-9B's cell alone)
#   w8a8         the W8A8 dot's output (#36): the high-load run's main step (decode 480 x 1,536,
#                fp8 weights and fp8 KV) with JAXSERVE_W8A8_DOT_DTYPE=float32 (the dot before)
#                and auto (the activations' bf16) side by side, the second traced
#                -> $OUT/w8a8_{float32,auto}.{log,json}, w8a8_auto_kernels.txt (a few minutes)
#   invariant_probe  per set of XLA options (autotuned, autotune level 0, cuBLAS at level 0):
#                the batch-invariant scenarios' differing logit rows on the GPU test's model
#                (benchmarks/probes/batch_invariant_bits.py, about 2 minutes)
#   invariant    batch-invariant mode: its GPU test (logits bitwise equal alone, among 63 others
#                and chunked, on the Mosaic GPU kernel, pytest -m gpu), then its cost: decode at
#                batch 1/16/64 (context 1,024) and offline 256 x 512/128 with the mode off and on
#                (benchmarks/batch_invariant.py, Llama-3-8B shape; a few minutes; INVARIANT_BENCH=0: the test alone)
#                -> $OUT/batch_invariant.{log,json}, the test's log batch_invariant_test.log
#   occupied     a second jaxserve launch on the GPU a first server (demo model, default flags)
#                holds: seconds until it exits, its exit code and last lines -> $OUT/occupied.txt
#   responses    Responses API streaming against chat completions on the same request, one at
#                a time, dummy Llama-3-8B, 256 output tokens (benchmarks/responses_overhead.py)
#   weights      update_weights from device arrays and from host memory, sleep level 1 and 2
#                and wake times, device memory asleep (JAX's and the driver's view), with the
#                default allocator and with the platform allocator (benchmarks/weight_updates.py)
#   checkpoints  Llama-3-8B bf16 (dummy, 4 shards, page cache): a start's load and
#                update_weights_from_disk from safetensors and from the jaxserve convert output
#                (orbax) (benchmarks/checkpoint_load.py; about 32 GB under /tmp)
#   embeddings   LLM.embed of 10,000 texts of 256 random tokens, dummy bf16 weights: a
#                Qwen3-Embedding-0.6B-shaped decoder and a BGE-large-en-v1.5-shaped BERT, texts/s,
#                tokens/s and the share of the 989 TFLOP/s bf16 roofline (benchmarks/embeddings.py;
#                $EMBED_TOKENS the step budget, 16384 unless set; the decoder over whole
#                prompts and the encoder on packed sequences unless $EMBED_POOLING_ATTENTION /
#                $EMBED_ENCODER_ATTENTION say otherwise; each model's step log and 4 traced
#                steps; then the decoder over the paged KV cache, the same call's baseline;
#                about 6 minutes) -> $OUT/embeddings.{log,json}, embeddings_paged.{log,json}
#   pooling_xla  the embedding runs (Qwen3-0.6B shape, then BGE-large) under XLA's default
#                options and with cuBLAS for every GEMM (JAXSERVE_POOLING_XLA_OPTIONS=cublas:
#                residual adds inside the GEMMs, norms one pass each, in a deviceless compile),
#                untraced -> $OUT/emb_{qwen3,bge}_{default,cublas}.{log,json} (about 4-5 minutes)
#   epilogues    issue 40's open choices, untraced (about 9 minutes): the epilogue kernels' native
#                tests (the ping-pong form's included), then the embedding runs: BGE-large with
#                XLA's dot merger as before (q and k GEMMs joined) and off (the default), BGE-large
#                and Qwen3-0.6B under each JAXSERVE_EPILOGUE_SCHEDULE, then the GELU probe
#                (benchmarks/probes/gelu_pass.py) -> $OUT/emb_*.{log,json}, gelu_pass.json
#   kv_events    the cost of publishing KV-cache events: the launch stage's serving sweep (dummy
#                Llama-3-8B, every bucket compiled first) without and with --kv-events-config
#                (zmq, replay socket on), a subscriber draining the stream
#                (benchmarks/kv_events_subscriber.py); output tok/s of each rate side by side
#                (target: within 1%) -> $OUT/kv_events_{off,on}.log, kv_events_subscriber.json;
#                about 10 minutes: kv_events:900 ($KV_EVENTS_RATES picks the rates, 16,inf)
#   embed_flags  the embeddings benchmark ($EMBED_FLAGS_MODELS, qwen3 unless set; 4,000 texts,
#                whole prompts) under XLA option sets ($EMBED_FLAG_SETS, a line each; the first,
#                empty: the default): Triton GEMMs that take in their element-wise producers,
#                block-level fusions (issue 40; about 90 s a set)
#   lora         Llama-3-8B shape, dummy weights: offline throughput 256 x 512/256 with 0, 1, 8
#                and 64 distinct rank-16 adapters ($LORA_ADAPTERS picks, e.g. 0,1, or none; $LORA_ARGS adds
#                flags, e.g. "--num-prompts 64" for a short throughput run), and batch-1 TPOT with one (benchmarks/lora.py),
#                16 batch-1 steps traced with and without it; then 0 and 1 adapters again with the
#                kernel's forms in $LORA_FORMS (default split_k; JAXSERVE_LORA_FORM; "reference":
#                XLA's dense product, JAXSERVE_LORA_KERNEL=reference; "kernel": the two-launch
#                kernel at any slot count, JAXSERVE_LORA_KERNEL=triton; "gemm": the dense
#                product's GEMMs at decode too, JAXSERVE_LORA_DENSE=gemm)
#   lora_load    Llama-3-8B shape, dummy weights, served with LoRA on: 32 streamed neighbours'
#                ITL p50/p99 quiet and while 8 adapters load at run time (benchmarks/lora_load.py;
#                a server start and two runs: about 3 minutes)
# Uses the machine's own jax; carry .whl, the wheels the machine lacks (pip download --no-deps
# --only-binary=:all: -d .whl starlette uvicorn h11 "llguidance>=1.9" jsonschema
# jsonschema-specifications referencing rpds-py attrs pyzmq msgpack; jaxserve.engine imports
# pyzmq) and .whl/rel for reliability.
# $MODEL and $SHAPES (the served stages' model and launch flags) can be set: with the demo model
# a served stage's plumbing runs on the CPU, e.g. MODEL=jaxserve/assets/demo SHAPES="--max-model-len
# 1024 --max-num-batched-tokens 1024 --max-num-seqs 8" SERVE_PROMPTS=6 KV_EVENTS_RATES=inf.
#   bash benchmarks/run_h200.sh launch:330 throughput:200
set -uo pipefail
# The stages write under a work folder; $OUT (what comes back from the device machine) holds one
# archive of it, written again after every stage and every 45 s meanwhile, so a call cut off at
# its limit still brings back what ran. A second run of this script in the same call (its
# archive already there) adds to the work folder: the archive keeps both runs' files.
ARCHIVE_DIR=${OUT:-/tmp/out}
OUT=/tmp/bench_out
[ -e "$ARCHIVE_DIR/results.tgz" ] || rm -rf "$OUT"
mkdir -p "$OUT" "$ARCHIVE_DIR"
archive() {  # everything under $OUT but profiler traces (too large to come back; summarized)
  tar czf "$ARCHIVE_DIR/.results.tgz" --exclude='*.xplane.pb' --exclude='*.trace.json.gz' \
    --exclude='perfetto_trace.json.gz' -C "$OUT" . 2>/dev/null &&
    mv "$ARCHIVE_DIR/.results.tgz" "$ARCHIVE_DIR/results.tgz"
}
(while sleep 45; do archive; done) &
archiver=$!
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export JAXSERVE_COMPILATION_CACHE=/tmp/jaxserve-xla XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
  export PYTHONPATH=/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader |
  tee "$OUT/device.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/device.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/device.txt"
# The device's copy of the tree can carry a .git older than its files: then the commit above is
# not what ran. The tracked files' hash tells (`bash benchmarks/tree_hash.sh` here to compare).
echo "files: $(bash benchmarks/tree_hash.sh), $(git status --short 2>/dev/null | wc -l) differ from that commit" \
  | tee -a "$OUT/device.txt"

MODEL=${MODEL:-jaxserve/assets/configs/llama-3-8b}
SHAPES=${SHAPES:-"--max-model-len 4096 --max-num-batched-tokens 2048"}  # launch: vLLM's online default
SERVE_PROMPTS=${SERVE_PROMPTS:-200}

stage_kernel() {
  python3 -m pytest -q -m gpu tests/test_kernel_gpu.py tests/test_kernel_triton.py -x 2>&1 |
    tail -3
}

stage_attention() {
  python3 -m benchmarks.bench_attention --suite tiers --sweep --out "$OUT/attention_tiers.json" \
    > "$OUT/attention_tiers.log" 2>&1
  sed -n '/ | jax /,$p' "$OUT/attention_tiers.log"  # the final table and the target line
  grep -E "Error|error" "$OUT/attention_tiers.log" | head -5
}

stage_sinks() {
  python3 -m pytest -q -m gpu -k sinks tests/test_kernel_gpu.py tests/test_kernel_triton.py 2>&1 |
    tail -3
  python3 -m benchmarks.bench_attention --suite sinks --out "$OUT/attention_sinks.json" \
    > "$OUT/attention_sinks.log" 2>&1
  sed -n '/ | jax /,$p' "$OUT/attention_sinks.log"
  grep -E "Error|error" "$OUT/attention_sinks.log" | head -5
}

stage_fp8start() {  # issue 36 item 5: cold launches to every bucket, bf16 and fp8 per option set
  local mode log
  for mode in bf16 ${FP8_START_SETS:-default autotune0}; do
    log="$OUT/fp8start_$mode.log"
    rm -rf "$JAXSERVE_COMPILATION_CACHE"
    if [ "$mode" = bf16 ]; then
      start_server "$log" $MODEL --load-format dummy $SHAPES
    else
      JAXSERVE_FP8_XLA_OPTIONS=$mode start_server "$log" $MODEL --load-format dummy $SHAPES \
        --quantization fp8 --kv-cache-dtype fp8
    fi
    local first=$(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}")
    wait_every_bucket "$log"
    echo "-- $mode: healthy at $first s, every bucket at $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s"
    grep -E "fp8 programs' compile|Compiled every|failed" "$log" | cut -c1-150
    stop_server
  done
}

stage_fp8compile() {  # issue 36 item 5: bf16 and fp8 steps' compile time under XLA's options
  python3 -m benchmarks.probes.fp8_compile --output-json "$OUT/fp8_compile.json" 2>&1 |
    grep -E "^(bf16|fp8) |^\|"
}

stage_compile() {
  python3 -m benchmarks.probes.compile_time --output-json "$OUT/compile_time.json" 2>&1 |
    grep -E "^bucket|^all"
}

first_token() {  # $1: launch start time, $2: phase; prints one JSON line
  python3 - "$1" "$2" <<'PY' | tee -a "$OUT/startup.jsonl"
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
}

start_server() {  # $1: log file, then launch's arguments; sets $pid and $t0, waits for /health
  local log=$1
  shift
  t0=$(date +%s.%N)
  python3 -m jaxserve.cli launch "$@" --port 8011 > "$log" 2>&1 &
  pid=$!
  until curl -sf localhost:8011/health >/dev/null; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || break
  done
}

stop_server() {  # SIGTERM, then the exit status (a crash at exit shows here)
  kill -TERM $pid 2>/dev/null
  wait $pid
  echo "   exit status $?"
}

stage_launch() {
  rm -rf "$JAXSERVE_COMPILATION_CACHE"
  for phase in cold warm; do
    start_server "$OUT/launch_$phase.log" $MODEL --load-format dummy $SHAPES
    kill -0 $pid 2>/dev/null && first_token "$t0" $phase
    if [ $phase = cold ] && kill -0 $pid 2>/dev/null; then
      python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 \
        --request-rates 2,4,8,16,inf --num-prompts $SERVE_PROMPTS --random-input-len 512 \
        --random-output-len 128 --ignore-eos --result-dir "$OUT/serve" --disable-tqdm \
        > "$OUT/serve.log" 2>&1
      grep -E "Request rate|Successful|Output token|Median TTFT|P95 TTFT|Median ITL|P95 ITL" \
        "$OUT/serve.log"
    fi
    stop_server
    grep -E "KV cache size|Maximum concurrency|Compil|Error|error" "$OUT/launch_$phase.log" | head -20
  done
}

stage_startup() {  # a real 16 GB checkpoint from the page cache: start to the first token
  local dir=/tmp/jaxserve-startup
  python3 -m benchmarks.load_speed --dir $dir --write-only 2>&1 | tail -1
  cp jaxserve/assets/demo/tokenizer* $dir/  # a tokenizer to serve with (the demo model's)
  rm -rf "$JAXSERVE_COMPILATION_CACHE"
  for phase in real_cold real_warm; do
    start_server "$OUT/startup_$phase.log" $dir $SHAPES
    kill -0 $pid 2>/dev/null && first_token "$t0" $phase
    stop_server
    grep -E "Started the|Devices|Loaded weights|Weights ready|Serving steps|Compiled every|Error" \
      "$OUT/startup_$phase.log" | cut -c1-160
  done
  # where the warm start goes: the main thread's stack, sampled (compilation cache filled)
  if [ "${STARTUP_PROFILE:-1}" = 1 ]; then
    python3 -m benchmarks.startup_profile $dir $SHAPES --top 60 > "$OUT/startup_profile.txt" 2>&1
    grep -A7 "^phase" "$OUT/startup_profile.txt"
  fi
  rm -rf $dir
}

stage_sweep() {  # the launch stage's serving sweep alone, once every bucket has compiled
  start_server "$OUT/sweep.log" $MODEL --load-format dummy $SHAPES
  until grep -q "Compiled every bucket" "$OUT/sweep.log"; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || return 1
  done
  python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 \
    --request-rates 2,4,8,16,inf --num-prompts $SERVE_PROMPTS --random-input-len 512 \
    --random-output-len 128 --ignore-eos --result-dir "$OUT/serve" --disable-tqdm \
    > "$OUT/serve.log" 2>&1
  grep -E "Request rate|Output token|Median TTFT|P95 TTFT|Median ITL|P95 ITL" "$OUT/serve.log"
  stop_server
}

wait_every_bucket() {  # $1: a started server's log; until its background compile ends (or it does)
  until grep -q -E "Compiled every bucket|tokens failed" "$1"; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || break
  done
}

stage_background() {  # a cold launch: the first token, then the background compile to its end
  rm -rf "$JAXSERVE_COMPILATION_CACHE"
  start_server "$OUT/background.log" $MODEL --load-format dummy $SHAPES
  kill -0 $pid 2>/dev/null && first_token "$t0" cold
  wait_every_bucket "$OUT/background.log"
  echo "   at $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s:"
  grep -E "Serving steps|Steps of up|Compiled every|failed|Out of device memory" \
    "$OUT/background.log" | cut -c1-150
  echo "   RESOURCE_EXHAUSTED lines: $(grep -c RESOURCE_EXHAUSTED "$OUT/background.log")"
  stop_server
}

stage_imports() {  # a config and a tokenizer read through transformers, torch hidden or not
  local hide
  for hide in 0 1; do
    python3 - $hide <<'PY'
import sys, time
t0 = time.perf_counter()
if sys.argv[1] == "1":
    from jaxserve.cli import hide_torch
    hide_torch()
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.models.families.registry import load_model_config
load_model_config("jaxserve/assets/configs/llama-3-8b")
Tokenizer("jaxserve/assets/demo")
print(f"torch hidden: {sys.argv[1] == '1'}: config and tokenizer in {time.perf_counter() - t0:.1f} s,"
      f" torch imported: {sys.modules.get('torch') is not None}")
PY
  done
}

stage_throughput() {  # the CLI's default step budget (8192 tokens); see `launch` for 2048
  python3 -m jaxserve.bench.throughput --engine jaxserve --max-model-len 4096 \
    --output-json "$OUT/throughput_jaxserve.json" > "$OUT/throughput_jaxserve.log" 2>&1
  tail -1 "$OUT/throughput_jaxserve.log"
  python3 -m jaxserve.bench.throughput --engine jaxserve --max-model-len 4096 --num-prompts 1000 \
    --input-len 1024 --output-len 128 --output-json "$OUT/throughput_jaxserve_1000.json" \
    > "$OUT/throughput_jaxserve_1000.log" 2>&1
  tail -1 "$OUT/throughput_jaxserve_1000.log"
}

stage_hf() {
  python3 -m jaxserve.bench.throughput --engine hf --output-json "$OUT/throughput_hf.json" \
    > "$OUT/throughput_hf.log" 2>&1
  tail -1 "$OUT/throughput_hf.log"
}

stage_latency() {  # the throughput stage's shapes (context 4096, 8192-token step budget)
  # Every bucket is compiled at start-up, so 3 warm-up batches (not vLLM's 10) settle the rest.
  python3 -m jaxserve.cli bench latency --model $MODEL --load-format dummy --max-model-len 4096 \
    --batch-sizes 1,8,64 --input-len 1000 --output-len 256 --num-iters-warmup 3 --num-iters ${LATENCY_ITERS:-30} \
    --output-json "$OUT/latency.json" > "$OUT/latency.log" 2>&1
  grep -v -E "INFO|WARN" "$OUT/latency.log" | tail -6
}

stage_roofline() {
  python3 -m benchmarks.decode_roofline --iters 10 --output-json "$OUT/roofline.json" \
    --profile-dir "$OUT/profile" > "$OUT/roofline.log" 2>&1
  find "$OUT/profile" -name "*.xplane.pb" -delete
  grep -v -i warn "$OUT/roofline.log" | tail -20
}

stage_xla_flags() {  # the batch-1 and 64 decode step under XLA's command-buffer options
  # (#36 item 6: about 430 small kernels a batch-1 step; does graphing more of them pay?)
  local flags i=0
  while IFS= read -r flags; do
    i=$((i + 1))
    echo "-- XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" python3 -m benchmarks.decode_roofline --iters 20 --batches 1,64 \
      --contexts 1024 --output-json "$OUT/xla_flags_$i.json" > "$OUT/xla_flags_$i.log" 2>&1
    grep -E "^row " "$OUT/xla_flags_$i.log" || tail -3 "$OUT/xla_flags_$i.log"
  done <<< "${XLA_FLAG_SETS:-
--xla_gpu_enable_command_buffer=
--xla_gpu_graph_min_graph_size=1
--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL}"
}

stage_host_launch() {  # the host's time to launch a decode step, by buffer reuse and attention path
  # (a step's launch was 2.97 ms at batch 1 on an H100, 5.08 with command buffers off; a
  # verify step, which nothing overlaps, spends it in full. XLA records a command buffer again
  # when a buffer it uses moved: does a new input buffer each step cost the launch? Do the
  # kernels' custom calls in the graphs?)
  local flags i=0
  while IFS= read -r flags; do
    i=$((i + 1))
    XLA_FLAGS="$flags" python3 -m benchmarks.probes.launch_reuse ${LAUNCH_ARGS:-} \
      --out "$OUT/launch_reuse_$i.json" > "$OUT/launch_reuse_$i.log" 2>&1
    echo "-- XLA_FLAGS='$flags': $(grep fresh_ms "$OUT/launch_reuse_$i.log" || tail -1 "$OUT/launch_reuse_$i.log")"
  done <<< "${LAUNCH_XLA_FLAG_SETS:-
--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN
--xla_gpu_enable_command_buffer=}"
  local path
  for path in ${LAUNCH_ATTENTION-auto triton reference}; do
    echo "-- JAXSERVE_ATTENTION=$path"
    JAXSERVE_ATTENTION=$path python3 -m benchmarks.decode_roofline --iters 10 --batches 1,64 \
      --contexts 1024 --output-json "$OUT/host_launch_$path.json" > "$OUT/host_launch_$path.log" 2>&1
    grep -E "^row " "$OUT/host_launch_$path.log" || tail -3 "$OUT/host_launch_$path.log"
  done
}

stage_spec() {  # speculative decoding: verify cost k = 0..7 at batch 1/8/64, n-gram end to end
  rm -rf /tmp/spec_profile  # a warm machine keeps an earlier call's trace there
  python3 -m benchmarks.spec_decode --iters 20 --output-json "$OUT/spec_decode.json" \
    --profile-dir /tmp/spec_profile ${SPEC_PARTS:+--parts "$SPEC_PARTS"} --step-log-dir "$OUT" \
    ${SPEC_ARGS:-} > "$OUT/spec_decode.log" 2>&1
  grep -E "Compiled the drafter|Compiled [0-9]+ step shapes" "$OUT/spec_decode.log" | cut -c 30-
  grep -v -i warn "$OUT/spec_decode.log" | grep -v "^INFO" | tail -40
  local log  # EAGLE-3's timed runs: the host's spans per step (propose, dispatch, wait, ...)
  for log in "$OUT"/eagle3_b*_steps.jsonl; do
    [ -f "$log" ] || continue
    echo "-- $(basename "$log" _steps.jsonl), step log"
    python3 -m benchmarks.step_log_summary "$log" --skip 1 2>&1 | tail -4
  done
  if [ -d /tmp/spec_profile/eagle3_b1 ]; then  # EAGLE-3's batch-1 steps: where a step's time goes
    python3 -m benchmarks.trace_summary /tmp/spec_profile/eagle3_b1 --steps 17 --top 12 \
      --by-module > "$OUT/spec_eagle3_b1_kernels.txt" 2>&1  # the chain apart from the verify
    echo "-- EAGLE-3, batch 1"; head -48 "$OUT/spec_eagle3_b1_kernels.txt"
    # the host's side of the same steps: where a verify step's launch spends its time
    python3 -m benchmarks.trace_summary /tmp/spec_profile/eagle3_b1 --steps 17 --top 30 \
      --host > "$OUT/spec_eagle3_b1_host.txt" 2>&1
    echo "-- EAGLE-3, batch 1, host"; head -34 "$OUT/spec_eagle3_b1_host.txt"
  fi
}

stage_cublas() {  # the same decode cells with every GEMM on cuBLAS instead of Triton
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
    python3 -m benchmarks.decode_roofline --iters 10 --batches 1,8,64 --contexts 1024 \
    --output-json "$OUT/roofline_cublas.json" > "$OUT/roofline_cublas.log" 2>&1
  grep -v -i warn "$OUT/roofline_cublas.log" | tail -5
}

stage_quant() {
  local modes="bf16 fp8" flags mode
  if python3 -c 'import dataclasses, sys; from jaxserve.engine_config import EngineConfig as E
sys.exit("kv_cache_dtype" not in {f.name for f in dataclasses.fields(E)})'; then
    modes="$modes fp8kv"
  else
    echo "fp8 KV cache: not in this build (no EngineConfig.kv_cache_dtype); its rows are skipped"
  fi
  modes=${QUANT_MODES:-$modes}
  for mode in $modes; do
    case $mode in
      bf16) flags="" ;;
      fp8) flags="--quantization fp8" ;;
      fp8kv) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
      *) echo "unknown mode $mode" && return 1 ;;
    esac
    python3 -m benchmarks.decode_roofline --iters 10 --batches 1,8,64,256 --contexts 1024,4096 \
      $flags --output-json "$OUT/quant_roofline_$mode.json" > "$OUT/quant_roofline_$mode.log" 2>&1
    python3 -m jaxserve.bench.throughput --engine jaxserve --max-model-len 4096 $flags \
      ${QUANT_THROUGHPUT_ARGS:-} --output-json "$OUT/quant_throughput_$mode.json" \
      > "$OUT/quant_throughput_$mode.log" 2>&1
    echo "$mode: $(grep -m1 -o 'KV cache size: .*' "$OUT/quant_throughput_$mode.log")" \
      "$(grep -m1 -o 'Quantization: .*' "$OUT/quant_throughput_$mode.log")"
  done
  python3 -m benchmarks.quant_agreement --output-json "$OUT/quant_agreement.json" \
    > "$OUT/quant_agreement.log" 2>&1
  grep -E "^(fp8|int8) " "$OUT/quant_agreement.log"
  python3 - "$OUT" $modes <<'PY'
import json, sys
from pathlib import Path
out, modes = Path(sys.argv[1]), sys.argv[2:]
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None
grids = {m: load(f"quant_roofline_{m}.json") for m in modes}
print("decode grid, device ms per step (speed-up over bf16):")
print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{m:>16}" for m in modes))
base = {(r["batch"], r["context"]): r for r in (grids.get("bf16") or {"rows": []})["rows"]}
cells = sorted({(r["batch"], r["context"]) for g in grids.values() if g for r in g["rows"]})
for cell in cells:
    cols = []
    for m in modes:
        row = next((r for r in (grids[m] or {"rows": []})["rows"]
                    if (r["batch"], r["context"]) == cell), None)
        if row is None:
            cols.append(f"{'-':>16}")
            continue
        speedup = base[cell]["device_ms"] / row["device_ms"] if cell in base else float("nan")
        cols.append(f"{row['device_ms']:8.2f} ({speedup:4.2f}x)")
    print(f"{cell[0]:5d} {cell[1]:5d} " + " ".join(cols))
print("offline throughput (256 x 512 in / 256 out unless $QUANT_THROUGHPUT_ARGS):")
bf16 = load("quant_throughput_bf16.json")
for m in modes:
    r = load(f"quant_throughput_{m}.json")
    if r is None:
        print(f"  {m}: no result")
        continue
    ratio = r["output_tokens_per_s"] / bf16["output_tokens_per_s"] if bf16 else float("nan")
    print(f"  {m}: {r['output_tokens_per_s']:.1f} output tokens/s ({ratio:.2f}x bf16)")
PY
}

stage_kvfp8() {  # the fp8 KV cache against bf16, Llama-3-8B shape, dummy bf16 weights
  python3 -m pytest -q -m gpu tests/test_kernel_gpu.py -k fp8 2>&1 | tail -3
  for kv in auto fp8; do
    python3 -m benchmarks.decode_roofline --iters 10 --kv-cache-dtype $kv \
      --batches "${KV_BATCHES:-1,8,32,64,128,256}" --contexts "${KV_CONTEXTS:-1024,4096}" \
      --output-json "$OUT/roofline_kv_$kv.json" > "$OUT/roofline_kv_$kv.log" 2>&1
    grep -E "^device|Error" "$OUT/roofline_kv_$kv.log" | head -3
    python3 -m jaxserve.bench.throughput --engine jaxserve --max-model-len 4096 \
      --kv-cache-dtype $kv --output-json "$OUT/throughput_kv_$kv.json" \
      > "$OUT/throughput_kv_$kv.log" 2>&1
    grep -E "KV cache dtype|KV cache size|Maximum concurrency|Error" "$OUT/throughput_kv_$kv.log" |
      head -4
  done
  # Dummy weights: near-uniform logits, so few steps clear the margins (the count is printed).
  python3 -m benchmarks.greedy_agreement --kv-cache-dtype auto --save "$OUT/greedy_ref.npz" \
    > "$OUT/greedy_ref.log" 2>&1
  python3 -m benchmarks.greedy_agreement --kv-cache-dtype fp8 --reference "$OUT/greedy_ref.npz" \
    --output-json "$OUT/greedy_kv_fp8.json" > "$OUT/greedy_kv_fp8.log" 2>&1
  python3 -m benchmarks.kv_cache_dtype_compare --dir "$OUT" | tee "$OUT/kv_fp8.md"
}

stage_reliability() {  # carry .whl/rel too: openai, schemathesis and their dependencies
  python3 -m pip install -q --no-index --find-links .whl/rel --target /tmp/site-rel \
    openai schemathesis pytest-timeout
  # The load scenarios are the ones that scale (1,000 clients); the rest run as in CI.
  PYTHONPATH=/tmp/site-rel:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAXSERVE_RELIABILITY_SCALE=full python3 -m pytest -q -p no:cacheprovider -rA \
    tests/test_reliability_load.py tests/test_reliability_fuzz.py tests/test_reliability_faults.py \
    tests/test_reliability_hostile.py tests/test_reliability_hostile_server.py \
    > "$OUT/reliability.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E " "$OUT/reliability.log" | tail -30
}

stage_hostile() {  # the seven findings of hostile input, round two, at the attacker's scale
  JAX_LOG_COMPILES=1 python3 -m jaxserve.cli launch $MODEL --load-format dummy $SHAPES \
    --port 8011 --api-key hostile > "$OUT/hostile_launch.log" 2>&1 &
  local pid=$!
  until curl -sf localhost:8011/health >/dev/null; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || { tail -5 "$OUT/hostile_launch.log"; return 1; }
  done
  python3 -m benchmarks.hostile_full --base-url http://localhost:8011 --api-key hostile \
    --pid $pid --server-log "$OUT/hostile_launch.log" --output-json "$OUT/hostile.json" \
    > "$OUT/hostile.log" 2>&1
  tail -18 "$OUT/hostile.log"
  kill -0 $pid 2>/dev/null && echo "server alive after the attacks"
  kill -TERM $pid
  wait $pid
}

stage_hostile_demo() {  # round three (grammars, schemas, tools, operator input) on the demo model
  JAX_LOG_COMPILES=1 python3 -m jaxserve.cli serve --port 8012 --api-key hostile \
    > "$OUT/hostile_demo_launch.log" 2>&1 &
  local pid=$!
  until curl -sf localhost:8012/health >/dev/null; do
    sleep 0.5
    kill -0 $pid 2>/dev/null || { tail -5 "$OUT/hostile_demo_launch.log"; return 1; }
  done
  python3 -m benchmarks.hostile_full --base-url http://127.0.0.1:8012 --api-key hostile \
    --pid $pid --server-log "$OUT/hostile_demo_launch.log" --only r3,g \
    --output-json "$OUT/hostile_demo.json" > "$OUT/hostile_demo.log" 2>&1
  tail -14 "$OUT/hostile_demo.log"
  kill -0 $pid 2>/dev/null && echo "server alive after the attacks"
  kill -TERM $pid
  wait $pid
}

stage_moe() {  # HF gets the time jaxserve leaves of MOE_BUDGET seconds
  python3 -m benchmarks.moe --time-budget ${MOE_BUDGET:-540} --output-json "$OUT/moe.json" \
    > "$OUT/moe.log" 2>&1
  grep -v -E "INFO|WARN" "$OUT/moe.log" | tail -24
}

stage_gmm() {
  python3 -m pytest -q -m gpu tests/test_grouped_matmul.py 2>&1 | tail -3
  python3 -m benchmarks.moe --grouped-matmuls-only --prefill-tokens 2048,8192 \
    --output-json "$OUT/gmm.json" > "$OUT/gmm.log" 2>&1
  grep -v -E "INFO|WARN|^grouped matmuls" "$OUT/gmm.log" | tail -24
}

stage_moe_hf() {
  python3 -m benchmarks.moe --engine hf --time-budget ${MOE_BUDGET:-540} \
    --output-json "$OUT/moe_hf.json" > "$OUT/moe_hf.log" 2>&1
  tail -3 "$OUT/moe_hf.log"
  cat "$OUT/moe_hf.json"
}

stage_gpt_oss() {
  python3 -m benchmarks.moe --engine jaxserve --model jaxserve/assets/configs/gpt-oss-20b \
    --max-num-batched-tokens 2048 --output-json "$OUT/gpt_oss.json" > "$OUT/gpt_oss.log" 2>&1
  grep -v -E "INFO|WARN" "$OUT/gpt_oss.log" | tail -24
}

stage_lora_kernel() {  # the grouped LoRA kernel: native tests, then kernel vs dense vs floor
  python3 -m pytest -q -m gpu tests/test_lora_kernel.py -x 2>&1 | tail -3
  python3 -m benchmarks.lora_kernel --output-json "$OUT/lora_kernel.json" \
    > "$OUT/lora_kernel.log" 2>&1
  sed -n '/^| group/,$p' "$OUT/lora_kernel.log"
  grep "one launch, block_k" "$OUT/lora_kernel.log" | sed 's/  */ /g'  # the fused form's sweep
  grep -E "Error|error" "$OUT/lora_kernel.log" | head -5
}

stage_skinny() {
  python3 -m pytest -q -m gpu tests/test_skinny_matmul.py -x 2>&1 | tail -3
  python3 -m benchmarks.skinny_matmul --output-json "$OUT/skinny_matmul.json" \
    > "$OUT/skinny_matmul.log" 2>&1
  sed -n '/^| projection/,$p' "$OUT/skinny_matmul.log"
  grep -E "Error|error" "$OUT/skinny_matmul.log" | head -5
}

stage_skinny_sweep() {
  python3 -m benchmarks.skinny_matmul --sweep --batches 1,16 --budget-s 420 \
    --output-json "$OUT/skinny_sweep.json" > "$OUT/skinny_sweep.log" 2>&1
  sed -n '/^| projection/,$p' "$OUT/skinny_sweep.log"
}

stage_invariant_probe() {  # which XLA options keep batch-invariant bits on this GPU
  python3 -m benchmarks.probes.batch_invariant_bits 0 1 2 > "$OUT/invariant_probe.log" 2>&1
  grep -E '^\{|Error' "$OUT/invariant_probe.log" | cut -c1-300
}

stage_invariant() {
  # the GPU test's result is kept: the call's printed tail may not reach back to it
  python3 -m pytest -q -m gpu tests/test_batch_invariant.py > "$OUT/batch_invariant_test.log" 2>&1
  tail -3 "$OUT/batch_invariant_test.log" | tee -a "$OUT/batch_invariant_test_result.txt"
  [ "${INVARIANT_BENCH:-1}" = 0 ] && return  # the GPU test alone
  python3 -m benchmarks.batch_invariant --out "$OUT/batch_invariant.json" \
    > "$OUT/batch_invariant.log" 2>&1
  grep -v -i warn "$OUT/batch_invariant.log" | tail -6
}

stage_fp8mm() {  # the fp8-matmul kernel: native tests, against XLA and the floor, one step
  # the test grid's own cases natively first (a few compiles), the shipped shapes last (~200)
  python3 -m pytest -q -m gpu tests/test_fp8_matmul.py -k "test_native_matches_reference[" \
    2>&1 | tail -4
  python3 -m benchmarks.fp8_matmul --sweep --output-json "$OUT/fp8_matmul.json" \
    > "$OUT/fp8_matmul.log" 2>&1
  sed -n '/^| projection/,$p' "$OUT/fp8_matmul.log"
  grep -E "Error|error" "$OUT/fp8_matmul.log" | head -5
  local mode
  for mode in off auto; do
    JAXSERVE_FP8_MATMUL=$mode python3 -m benchmarks.decode_roofline --iters 10 \
      --batches 1,8,64 --contexts 1024 --quantization fp8 \
      --output-json "$OUT/fp8mm_step_$mode.json" > "$OUT/fp8mm_step_$mode.log" 2>&1
    echo "-- fp8 weights, JAXSERVE_FP8_MATMUL=$mode"
    grep -v -i warn "$OUT/fp8mm_step_$mode.log" | tail -5
  done
  python3 -m pytest -q -m gpu tests/test_fp8_matmul.py -x 2>&1 | tail -4
}

stage_step_kernels() {  # the kernels of the batch-1 decode step and of an embedding step
  python3 -m benchmarks.probes.step_kernels --bucket 16 --out-dir "$OUT" 2>&1 \
    | grep -v -E "INFO|WARN" | head -24
  python3 -m benchmarks.probes.step_kernels --bucket 16 --quantization fp8 --out-dir "$OUT" \
    2>&1 | grep -E "kernels$"
  python3 -m benchmarks.probes.step_kernels --bucket 16 --max-loras 8 --out-dir "$OUT" \
    2>&1 | grep -E "kernels$"
  python3 -m benchmarks.probes.step_kernels --runner pooling --bucket 16384 \
    --max-model-len 512 --max-num-batched-tokens 16384 \
    --model jaxserve/assets/configs/qwen3-embedding-0.6b --out-dir "$OUT" 2>&1 \
    | grep -v -E "INFO|WARN" | head -24
}

stage_fp8attn() {  # fp8 KV attention: converted to bf16 against read by fp8 wgmmas
  python3 -m pytest -q -m gpu tests/test_attention_fp8_native.py 2>&1 | tail -5
  # the native kernel's tile sweep (FP8ATTN_SWEEP=1) did not reach context 4,096 in 150 s on
  # an H100 (2026-12-05): the default tiles were best or within 7% in every case it reached
  python3 -m benchmarks.bench_attention --suite fp8 $([ "${FP8ATTN_SWEEP:-0}" = 1 ] && echo --sweep) \
    --out "$OUT/attention_fp8.json" > "$OUT/attention_fp8.log" 2>&1
  sed -n '/ | jax /,$p' "$OUT/attention_fp8.log"
  grep -E "Error|error" "$OUT/attention_fp8.log" | head -5
}

stage_highload() {  # the 1000 x 1000/1000 run with its step log: where the time goes
  local mode flags seqs run
  for mode in ${HIGHLOAD_MODES:-bf16 fp8kv}; do
    case $mode in
      bf16) flags="" ;;
      fp8kv) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
      *) echo "unknown mode $mode" && return 1 ;;
    esac
    # 256: the fixed --max-num-seqs of earlier trees; auto: the per-device default
    # (runner/batch_size.py: 427 bf16, 887 fp8 + fp8 KV on the H200 at 2,048 tokens)
    for seqs in ${HIGHLOAD_SEQS-256 auto}; do
      run=highload_${mode}_$seqs
      JAXSERVE_STEP_LOG="$OUT/${run}_steps.jsonl" python3 -m jaxserve.bench.throughput \
        --engine jaxserve --num-prompts 1000 --input-len 1000 --output-len 1000 \
        --max-model-len 2048 $flags $([ "$seqs" = auto ] || echo --max-num-seqs "$seqs") \
        ${HIGHLOAD_ARGS:-} --output-json "$OUT/$run.json" > "$OUT/$run.log" 2>&1
      echo "-- $mode, max_num_seqs $seqs: $(tail -1 "$OUT/$run.log")"
      python3 -m benchmarks.step_log_summary "$OUT/${run}_steps.jsonl" --skip 20 \
        --output-json "$OUT/${run}_steps_summary.json"
    done
    [ "${HIGHLOAD_TRACE:-1}" = 0 ] && continue
    # The run's main step alone (decode at 1,536 tokens, the mid-run mean; 480 sequences with
    # an fp8 cache, 384 in bf16, what decode_roofline's cache holds): device time against its
    # byte floor, and its kernels by device time (3 steps traced).
    run=highload_${mode}_step
    local batch=384
    [ $mode = fp8kv ] && batch=480
    python3 -m benchmarks.decode_roofline --batches $batch --contexts 1536 --iters 5 \
      --profile-dir "$OUT/${run}_profile" --profile-batches $batch --output-json "$OUT/$run.json" \
      $([ $mode = fp8kv ] && echo --quantization fp8 --kv-cache-dtype fp8) > "$OUT/$run.log" 2>&1
    echo "-- $mode, decode $batch x 1,536: $(grep '^row' "$OUT/$run.log" || tail -1 "$OUT/$run.log")"
    python3 -m benchmarks.trace_summary "$OUT/${run}_profile" --steps 3 --top 20 \
      > "$OUT/${run}_kernels.txt" 2>&1
    head -26 "$OUT/${run}_kernels.txt"
    find "$OUT/${run}_profile" -name "*.xplane.pb" -delete
  done
}

stage_issue() {  # the attention's issue orders and lean registers: GPU tests, kernels, the step
  [ "${ISSUE_TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -m gpu -k issued_earlier tests/test_kernel_gpu.py \
    tests/test_attention_fp8_native.py > "$OUT/issue_tests.log" 2>&1
  echo "-- GPU tests: $(tail -1 "$OUT/issue_tests.log")"
  # $ISSUE_ARGS narrows the suite, e.g. "--head-dims 256" (Gemma-2-9B's cell alone)
  python3 -m benchmarks.bench_attention --suite issue --slots 256 --reps 5 ${ISSUE_ARGS:-} \
    --out "$OUT/issue.json" > "$OUT/issue.log" 2>&1
  grep -E "^\| (32/8|16/8)" "$OUT/issue.log" | cut -d'|' -f3,4,5,8,10
  local form
  for form in ${ISSUE_STEP_FORMS-end/off p/on read/on}; do  # ISSUE_STEP_FORMS="": no step
    JAXSERVE_ATTENTION_ISSUE_NEXT=${form%/*} JAXSERVE_ATTENTION_LEAN_REGISTERS=${form#*/} \
      python3 -m benchmarks.decode_roofline --iters 10 --batches 64,480 --contexts 1536 \
      --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/issue_step_${form/\//_}.json" \
      > "$OUT/issue_step_${form/\//_}.log" 2>&1
    echo "-- step, issue_next/lean ${form}: $(grep '^row' "$OUT/issue_step_${form/\//_}.log" | tr '\n' ' ')"
  done
}

stage_splits() {  # the small bucket's KV splits, planned for every row live and for 4
  local plan
  for plan in bucket live; do
    JAXSERVE_ATTENTION_SPLITS=$plan python3 -m benchmarks.decode_roofline --iters 20 \
      --batches 1,4,16 --contexts 256,1024,4096 --output-json "$OUT/splits_$plan.json" \
      > "$OUT/splits_$plan.log" 2>&1
    echo "-- JAXSERVE_ATTENTION_SPLITS=$plan"
    grep '^row' "$OUT/splits_$plan.log" || tail -3 "$OUT/splits_$plan.log"
  done
}

stage_w8a8() {  # the W8A8 dot writing float32 (before) and bf16 (now), the same step
  local dtype run
  for dtype in float32 auto; do
    run=w8a8_$dtype
    JAXSERVE_W8A8_DOT_DTYPE=$dtype python3 -m benchmarks.decode_roofline --batches 480 \
      --contexts 1536 --iters 10 --quantization fp8 --kv-cache-dtype fp8 \
      $([ $dtype = auto ] && echo --profile-dir "$OUT/${run}_profile" --profile-batches 480) \
      --output-json "$OUT/$run.json" > "$OUT/$run.log" 2>&1
    echo "-- JAXSERVE_W8A8_DOT_DTYPE=$dtype: $(grep '^row' "$OUT/$run.log" || tail -1 "$OUT/$run.log")"
  done
  python3 -m benchmarks.trace_summary "$OUT/w8a8_auto_profile" --steps 3 --top 20 \
    > "$OUT/w8a8_auto_kernels.txt" 2>&1
  head -26 "$OUT/w8a8_auto_kernels.txt"
  find "$OUT/w8a8_auto_profile" -name "*.xplane.pb" -delete
}

stage_skinny_step() {
  local quant mode
  for quant in bf16 fp8; do
    for mode in off auto; do
      local run=skinny_step_${quant}_$mode
      JAXSERVE_SKINNY_MATMUL=$mode python3 -m benchmarks.decode_roofline --iters 10 \
        --batches 1,8 --contexts 1024 $([ $quant = fp8 ] && echo --quantization fp8) \
        --output-json "$OUT/$run.json" --profile-dir "$OUT/${run}_profile" \
        --profile-batches 1 > "$OUT/$run.log" 2>&1
      echo "-- $quant weights, JAXSERVE_SKINNY_MATMUL=$mode"
      JAXSERVE_SKINNY_MATMUL=$mode python3 -c \
        'from pallas_kernels.skinny_matmul import dispatch; print(dispatch.describe())' 2>/dev/null
      grep -v -i warn "$OUT/$run.log" | tail -4
      # Batch 1's kernels by device time (3 steps traced), beside the other mode's.
      python3 -m benchmarks.trace_summary "$OUT/${run}_profile" --steps 3 --top 10 \
        > "$OUT/${run}_kernels.txt" 2>&1
      head -16 "$OUT/${run}_kernels.txt"
      find "$OUT/${run}_profile" -name "*.xplane.pb" -delete
    done
  done
}

deepseek_v3_layers() {  # DIR N: the shipped DeepSeek-V3 config cut to its first N layers
  python3 -c 'import json, pathlib, sys
config = json.loads(pathlib.Path("jaxserve/assets/configs/deepseek-v3/config.json").read_text())
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": int(sys.argv[2])}))' \
    "$1" "$2"
}

stage_deepseek_v3() {
  deepseek_v3_layers "$OUT/deepseek-v3-5l" 5
  python3 -m benchmarks.moe --engine jaxserve --model "$OUT/deepseek-v3-5l" --mgpu-batches "" \
    --max-num-batched-tokens 1024 --max-model-len 2048 --output-json "$OUT/deepseek_v3.json" \
    > "$OUT/deepseek_v3.log" 2>&1
  grep -v -E "INFO|WARN" "$OUT/deepseek_v3.log" | tail -24
}

stage_mla() {
  python3 -m pytest -q -m gpu tests/test_mla_kernel.py 2>&1 | tail -3
  python3 -m benchmarks.mla --sweep --out "$OUT/mla.json" > "$OUT/mla.log" 2>&1
  sed -n '/^| step/,$p' "$OUT/mla.log"
  grep -E "Error|error" "$OUT/mla.log" | head -5
  deepseek_v3_layers "$OUT/deepseek-v3-5l" 5
  local mode
  for mode in off auto; do
    echo "-- the 5-layer model, JAXSERVE_MLA=$mode"
    JAXSERVE_MLA=$mode python3 -m benchmarks.moe --engine jaxserve --model "$OUT/deepseek-v3-5l" \
      --mgpu-batches "" --max-num-batched-tokens 1024 --max-model-len 2048 \
      --output-json "$OUT/deepseek_v3_mla_$mode.json" > "$OUT/deepseek_v3_mla_$mode.log" 2>&1
    grep -E "Attention:" "$OUT/deepseek_v3_mla_$mode.log" | head -1
    grep -v -E "INFO|WARN" "$OUT/deepseek_v3_mla_$mode.log" | tail -12
  done
}

stage_moe_fp8() {  # fp8 routed experts: native tests, the grouped matmul against bf16
  timeout 300 python3 -m pytest -q -m gpu tests/test_moe_fp8.py 2>&1 | tail -3
  python3 -m benchmarks.moe --grouped-matmuls-only --fp8-experts \
    --output-json "$OUT/moe_fp8_qwen3.json" 2>&1 | grep -v -E "INFO|WARN" | tail -12
  python3 -m benchmarks.moe --grouped-matmuls-only --fp8-experts \
    --model jaxserve/assets/configs/deepseek-v3 --expert-split 8 --mgpu-batches "" \
    --output-json "$OUT/moe_fp8_dsv3.json" 2>&1 | grep -v -E "INFO|WARN" | tail -12
}

stage_mla_mosaic() {  # the Mosaic GPU MLA kernel beside the Triton kernel
  # A line a compile and timing (benchmarks/mla.py): a run cut off at its limit still says
  # where it got to.
  python3 -m benchmarks.mla --kernels "${MLA_KERNELS:-triton,mosaic}" ${MLA_CELLS:-} \
    $([ "${MLA_SWEEP:-0}" = 1 ] && echo --sweep) --out "$OUT/mla_mosaic.json" \
    > "$OUT/mla_mosaic.log" 2>&1
  sed -n '/^| step/,$p' "$OUT/mla_mosaic.log"
  grep -E "Error|error" "$OUT/mla_mosaic.log" | head -5
}

stage_mla_native() {  # each native case in a process of its own: a stall names its case
  local kernel
  for kernel in $(echo "${MLA_NATIVE_KERNELS:-mosaic,triton}" | tr , ' '); do
    echo "-- $kernel"
    python3 -m benchmarks.probes.native_cases --kernel "$kernel" \
      --case-timeout "${MLA_CASE_S:-45}" --repeats "${MLA_REPEATS:-2}" \
      --out "$OUT/mla_native_$kernel.json" 2>&1 | sed -n '/^| case/,$p'
  done
}

stage_mla_step() {  # the 5-layer DeepSeek-V3 decode step on each latent attention path
  deepseek_v3_layers "$OUT/deepseek-v3-5l" 5
  local mode
  for mode in ${MLA_STEP_MODES:-off on mosaic}; do  # e.g. "auto on": auto's path against Triton's
    echo "-- the 5-layer model, JAXSERVE_MLA=$mode"
    JAXSERVE_MLA=$mode timeout "${MLA_STEP_S:-170}" python3 -m benchmarks.moe --engine jaxserve \
      --model "$OUT/deepseek-v3-5l" --batches 1,64 --context 4096 --max-model-len 8192 \
      --mgpu-batches "" --prefill-tokens "" --max-num-batched-tokens 1024 --num-prompts 64 \
      --output-json "$OUT/deepseek_v3_step_$mode.json" > "$OUT/deepseek_v3_step_$mode.log" 2>&1
    grep -E "Attention:" "$OUT/deepseek_v3_step_$mode.log" | head -1
    # the decode rows from the JSON, written after each part (the timeout cuts the experts'
    # and throughput parts that follow)
    python3 -c 'import json, sys
for r in json.load(open(sys.argv[1])).get("decode", []):
    print("batch %(batch)d x %(context)d: device %(device_ms).2f ms, wall %(wall_ms).2f ms" % r)' \
      "$OUT/deepseek_v3_step_$mode.json" 2>/dev/null || echo "   no decode rows"
  done
}

stage_load() {
  python3 -m benchmarks.load_speed --dir /tmp/jaxserve-load-speed --time-budget 150 \
    --output-json "$OUT/load_speed.json" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/load_speed.txt"
  rm -rf /tmp/jaxserve-load-speed
}

stage_so() {
  python3 -m benchmarks.structured_outputs --output-json "$OUT/so.json" > "$OUT/so.log" 2>&1
  tail -8 "$OUT/so.log"
}

stage_head256() {
  python3 -m benchmarks.bench_attention --suite head256 --out "$OUT/head256.json" \
    > "$OUT/head256.log" 2>&1
  sed -n '/ | jax /,$p' "$OUT/head256.log"
}

stage_gemma() {
  local model
  for model in llama-3-8b gemma-2-9b gemma-3-12b; do
    python3 -m benchmarks.decode_roofline --model jaxserve/assets/configs/$model --iters 5 \
      --batches ${GEMMA_BATCHES:-64} --contexts 1024,4096 --output-json "$OUT/gemma_$model.json" \
      > "$OUT/gemma_$model.log" 2>&1
    echo "-- $model"
    grep -v -i warn "$OUT/gemma_$model.log" | tail -4
  done
}

stage_responses() {  # Responses API streaming against chat completions, the same request
  # (the Llama-3-8B config ships no tokenizer files: its stand-in gets the demo's template)
  start_server "$OUT/responses_launch.log" $MODEL --load-format dummy --max-model-len 2048 \
    --max-num-batched-tokens 512 --max-num-seqs 8 \
    --chat-template jaxserve/assets/demo/chat_template.jinja
  python3 -m benchmarks.responses_overhead --out "$OUT/responses_overhead.json" 2>&1 | tail -4
  stop_server
}

stage_embed_flags() {  # issue 40: the embedding steps under XLA option sets
  # A third of a step is element-wise passes (SwiGLU's multiply, the norms) between cuBLAS
  # GEMMs; Triton GEMMs may take their producers (silu(gate) * up, the norm's scale) in.
  local flags i=0
  while IFS= read -r flags; do
    i=$((i + 1))
    echo "-- XLA_FLAGS='$flags'"
    XLA_FLAGS="$flags" JAXSERVE_ENCODER_ATTENTION=packed JAXSERVE_POOLING_ATTENTION=whole \
      python3 -m benchmarks.embeddings --out "$OUT/embed_flags_$i.json" \
      --models "${EMBED_FLAGS_MODELS:-qwen3}" --num-texts "${EMBED_FLAGS_TEXTS:-4000}" \
      > "$OUT/embed_flags_$i.log" 2>&1
    grep -E '^(qwen3|bge):' "$OUT/embed_flags_$i.log" || tail -4 "$OUT/embed_flags_$i.log"
  done <<< "${EMBED_FLAG_SETS:-
--xla_gpu_triton_gemm_any=true
--xla_gpu_unsupported_force_triton_gemm=true
--xla_gpu_experimental_enable_fusion_block_level_rewriter=true}"
}

stage_pooling_xla() {  # the pooling steps' XLA options: default against cuBLAS-only GEMMs
  local model opt
  for model in qwen3 bge; do
    for opt in default cublas; do
      JAXSERVE_POOLING_XLA_OPTIONS=$opt JAXSERVE_POOLING_ATTENTION=whole \
        JAXSERVE_ENCODER_ATTENTION=packed python3 -m benchmarks.embeddings --models "$model" \
        --out "$OUT/emb_${model}_$opt.json" --max-num-batched-tokens 16384 \
        > "$OUT/emb_${model}_$opt.log" 2>&1
      echo "$opt: $(grep -E "^$model:" "$OUT/emb_${model}_$opt.log" || tail -3 "$OUT/emb_${model}_$opt.log")"
    done
  done
}

embed_run() {  # label model merger(keep|off) schedule: one untraced embedding run
  local keep=""
  [ "$3" = keep ] && keep="import jaxserve.runner.programs as p; p.ENCODER_GPU_XLA_OPTIONS.clear()"
  JAXSERVE_EPILOGUE_SCHEDULE=$4 JAXSERVE_POOLING_ATTENTION=whole JAXSERVE_ENCODER_ATTENTION=packed \
    python3 -c "$keep
import runpy, sys
sys.argv = ['embeddings', '--models', '$2', '--out', '$OUT/emb_$1.json', '--max-num-batched-tokens', '16384']
runpy.run_module('benchmarks.embeddings', run_name='__main__')" > "$OUT/emb_$1.log" 2>&1
  echo "$1: $( (grep -E "^$2:" "$OUT/emb_$1.log" || tail -2 "$OUT/emb_$1.log") | cut -c1-110)"
}

stage_epilogues() {  # issue 40: the dot merger and the epilogue kernels' schedules, run by run
  python3 -m pytest -q -m gpu tests/test_swiglu_matmul.py 2>&1 | tail -2
  embed_run bge_merged bge keep cooperative
  embed_run bge bge off cooperative
  embed_run bge_pingpong bge off pingpong
  embed_run qwen3 qwen3 off cooperative
  embed_run qwen3_pingpong qwen3 off pingpong
  python3 -m benchmarks.probes.gelu_pass --out "$OUT/gelu_pass.json" 2>&1 | tail -8
}

stage_embeddings() {  # issue 40's table: texts/s and the share of the compute roofline
  # cuDNN's attention: the encoder's, and whole prompts of the decoder's pooling runner
  python3 -m pytest -q -m gpu tests/test_encoder.py tests/test_pooling_attention.py -k cudnn \
    2>&1 | grep -E "sequences differ|^FAILED|passed|failed" | cut -c 1-400 | tail -8
  JAXSERVE_ENCODER_ATTENTION=${EMBED_ENCODER_ATTENTION:-packed} \
    JAXSERVE_POOLING_ATTENTION=${EMBED_POOLING_ATTENTION:-whole} \
    python3 -m benchmarks.embeddings --out "$OUT/embeddings.json" \
    --max-num-batched-tokens "${EMBED_TOKENS:-16384}" --profile-dir /tmp/embeddings_profile \
    --step-log-dir "$OUT" > "$OUT/embeddings.log" 2>&1
  grep -E '^(qwen3|bge):' "$OUT/embeddings.log" || tail -20 "$OUT/embeddings.log"
  # the same call's baseline for the decoder: its prompts over the paged KV cache
  JAXSERVE_POOLING_ATTENTION=paged python3 -m benchmarks.embeddings --models qwen3 \
    --out "$OUT/embeddings_paged.json" --max-num-batched-tokens "${EMBED_TOKENS:-16384}" \
    > "$OUT/embeddings_paged.log" 2>&1
  if grep -q '^qwen3:' "$OUT/embeddings_paged.log"; then
    grep '^qwen3:' "$OUT/embeddings_paged.log" | sed 's/^qwen3:/qwen3 (paged KV cache):/'
  else
    tail -5 "$OUT/embeddings_paged.log"
  fi
  local model
  for model in qwen3 bge; do  # the host's spans per step against its wait for the device
    [ -f "$OUT/${model}_steps.jsonl" ] || continue
    echo "-- $model, step log"
    python3 -m benchmarks.step_log_summary "$OUT/${model}_steps.jsonl" --skip 2 2>&1 | tail -6
  done
  for model in qwen3 bge; do  # 4 traced steps each: kernels by device time, and the idle gaps
    [ -d "/tmp/embeddings_profile/$model" ] || continue
    python3 -m benchmarks.trace_summary "/tmp/embeddings_profile/$model" --steps 4 --top 12 \
      > "$OUT/embeddings_${model}_kernels.txt" 2>&1
    echo "-- $model"; head -18 "$OUT/embeddings_${model}_kernels.txt"
  done
  # NOTE: the traces stay out of $OUT: an archive holding them was too large to come back,
  # and lost the other stages' files with it (2026-12-05, the first H100 call)
  rm -rf /tmp/embeddings_profile
}

stage_weights() {  # a training loop's hooks: update_weights, sleep and wake, memory asleep
  # the pool is most of the device (the copies sit beside the engine's share, as a trainer's);
  # each run is cut at 150 s: an allocation that cannot be met retries for minutes
  local allocator
  for allocator in bfc platform; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_PYTHON_CLIENT_ALLOCATOR=$allocator timeout 150 \
      python3 -m benchmarks.weight_updates --out "$OUT/weight_updates_$allocator.json" \
      > "$OUT/weight_updates_$allocator.log" 2>&1
    grep -E "_s |^level|same tokens|^allocator|Error" "$OUT/weight_updates_$allocator.log" | tail -13
    grep -E "Asleep|Awake" "$OUT/weight_updates_$allocator.log" | cut -c 30-  # where the time went
  done
}

stage_checkpoints() {  # start-up load and update from disk: safetensors against converted orbax
  python3 -m benchmarks.checkpoint_load --out "$OUT/checkpoint_load.json" 2>&1 | tail -8
}

stage_lora() {  # offline throughput with 0, 1, 8 and 64 rank-16 adapters; batch-1 TPOT with one
  if [ "${LORA_ADAPTERS:-}" != none ]; then  # none: the forms' runs alone
    python3 -m benchmarks.lora --adapters "${LORA_ADAPTERS:-0,1,8,64}" --out "$OUT/lora.json" \
      --profile-dir /tmp/lora_profile $LORA_ARGS > "$OUT/lora.log" 2>&1
    grep -E "adapters|TPOT" "$OUT/lora.log" || tail -8 "$OUT/lora.log"
  fi
  local form choice  # the kernel's other forms end to end: batch-1 TPOT and offline, one adapter
  for form in ${LORA_FORMS:-split_k}; do  # reference: XLA's dense product; kernel: the kernel
    choice=JAXSERVE_LORA_FORM=$form  # at any slot count (auto: dense up to 8 slots)
    [ "$form" = reference ] && choice=JAXSERVE_LORA_KERNEL=reference
    [ "$form" = kernel ] && choice=JAXSERVE_LORA_KERNEL=triton
    [ "$form" = gemm ] && choice=JAXSERVE_LORA_DENSE=gemm  # the dense product's GEMMs at decode
    env "$choice" python3 -m benchmarks.lora --adapters 0,1 $LORA_ARGS \
      --out "$OUT/lora_$form.json" > "$OUT/lora_$form.log" 2>&1
    grep -E "TPOT" "$OUT/lora_$form.log" | sed "s/^/$form: /" || tail -4 "$OUT/lora_$form.log"
  done
  local run  # a batch-1 decode step's kernels, without and with one adapter (17 steps traced)
  for run in base adapter; do
    [ -d "/tmp/lora_profile/$run" ] || continue
    python3 -m benchmarks.trace_summary "/tmp/lora_profile/$run" --steps 17 --top 16 \
      > "$OUT/lora_${run}_kernels.txt" 2>&1
    echo "-- batch 1, $run"; head -20 "$OUT/lora_${run}_kernels.txt"
  done
}

stage_lora_load() {  # the neighbours' p99 ITL while adapters load (target: at most 1.2x quiet)
  python3 -m benchmarks.lora_load --out "$OUT/lora_load.json" --work-dir /tmp/lora_load \
    > "$OUT/lora_load.log" 2>&1
  cp /tmp/lora_load/server.log "$OUT/lora_load_server.log" 2>/dev/null
  sed -n '/^neighbours/,$p' "$OUT/lora_load.log" || tail -8 "$OUT/lora_load.log"
}

stage_occupied() {  # the second start must end in seconds with the fix, not retry allocations
  python3 -m jaxserve.cli launch --port 8011 > "$OUT/occupied_first.log" 2>&1 &
  local first=$!
  until curl -sf localhost:8011/health >/dev/null; do
    sleep 0.5
    if ! kill -0 $first 2>/dev/null; then
      echo "   the first server exited:" && tail -5 "$OUT/occupied_first.log"
      return 1
    fi
  done
  nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader |
    sed 's/^/held by the first server (total, used, free): /' > "$OUT/occupied.txt"
  local t0 rc
  t0=$(date +%s.%N)
  timeout --kill-after=10 180 python3 -m jaxserve.cli launch --port 8012 \
    > "$OUT/occupied_second.log" 2>&1
  rc=$?
  {
    echo "second launch: exit code $rc after $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s"
    [ $rc = 124 ] && echo "(124: still running at the 180 s limit, so it was killed)"
    echo "CUDA_ERROR_OUT_OF_MEMORY lines: $(grep -c CUDA_ERROR_OUT_OF_MEMORY "$OUT/occupied_second.log")"
    echo "last lines:"
    tail -5 "$OUT/occupied_second.log"
  } >> "$OUT/occupied.txt"
  cat "$OUT/occupied.txt"
  kill -TERM $first 2>/dev/null
  wait $first
}

stage_kv_events() {  # the serving sweep without and with KV-event publishing, one table
  local config='{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
  local mode sub
  for mode in off on; do
    # each step's host spans: publishing is host work, and a sweep cannot resolve 1%
    export JAXSERVE_STEP_LOG="$OUT/kv_events_${mode}_steps.jsonl"
    if [ $mode = on ]; then
      start_server "$OUT/kv_events_${mode}_launch.log" $MODEL --load-format dummy $SHAPES \
        --kv-events-config "$config"
      python3 -m benchmarks.kv_events_subscriber --endpoint tcp://localhost:5557 \
        --out "$OUT/kv_events_subscriber.json" > /dev/null &
      sub=$!
    else
      start_server "$OUT/kv_events_${mode}_launch.log" $MODEL --load-format dummy $SHAPES
    fi
    until grep -q "Compiled every bucket" "$OUT/kv_events_${mode}_launch.log"; do
      sleep 0.5
      kill -0 $pid 2>/dev/null || return 1
    done
    python3 -m jaxserve.cli bench serve --base-url http://localhost:8011 \
      --request-rates "${KV_EVENTS_RATES:-16,inf}" --num-prompts $SERVE_PROMPTS \
      --random-input-len 512 --random-output-len 128 --ignore-eos \
      --result-dir "$OUT/kv_events_$mode" --disable-tqdm > "$OUT/kv_events_$mode.log" 2>&1
    [ $mode = on ] && kill -TERM $sub && wait $sub
    stop_server
    unset JAXSERVE_STEP_LOG
  done
  for mode in off on; do  # the server's steps, warm-up's left out: host ms per step by kind
    echo "   step log, events $mode:"
    python3 -m benchmarks.step_log_summary "$OUT/kv_events_${mode}_steps.jsonl" --skip 50 \
      2>&1 | tail -5 | sed 's/^/   /'
  done
  echo "   output token throughput (tok/s) by request rate, events off | on:"
  paste <(grep -E "Request rate configured|Output token throughput" "$OUT/kv_events_off.log") \
    <(grep -E "Output token throughput|Request rate configured" "$OUT/kv_events_on.log" |
      awk '{print $NF}') | sed 's/^/   /'
  echo "   subscriber: $(cat "$OUT/kv_events_subscriber.json")"
}

start=$(date +%s)
for arg in "$@"; do
  stage=${arg%%:*}
  limit=${arg#*:}
  [ "$limit" = "$arg" ] && limit=600
  echo "== $stage (limit ${limit} s, at $(( $(date +%s) - start )) s)"
  export -f "stage_$stage" first_token start_server stop_server wait_every_bucket deepseek_v3_layers \
    embed_run
  export OUT MODEL SHAPES SERVE_PROMPTS STARTUP_PROFILE KV_EVENTS_RATES
  timeout --kill-after=10 "$limit" bash -c "stage_$stage"
  rc=$?
  [ $rc = 124 ] && echo "   $stage: stopped at its limit"
  pkill -f "jaxserve.cli launch" 2>/dev/null
  archive
done
echo "== done in $(( $(date +%s) - start )) s"
kill $archiver 2>/dev/null
archive  # everything in one archive: only a few files come back from the device machine
