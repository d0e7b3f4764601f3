"""``jaxserve serve``'s flags (vLLM's spelling) and what they become: ``EngineConfig`` (the
engine's knobs) and ``ServerSettings`` (the HTTP side's).

``add_launch_arguments`` is the flag table (``cli.py`` builds the ``serve`` parser from it, and
adds vLLM's inapplicable flags from ``vllm_flags.py``); ``serve.run_launch`` reads the parsed
arguments through ``engine_config_from_args`` and ``settings_from_args``. Flag defaults are
``EngineConfig``'s and ``settings.py``'s, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from jaxserve.engine_config import (
    DATA_PARALLEL_BALANCERS,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    RUNNERS,
    SAMPLER_VARIANTS,
    SCHEDULING_POLICIES,
    EngineConfig,
    KVEventsConfig,
    SpeculativeConfig,
    dtype_name,
)
from jaxserve.flag_names import command_flags, in_flag_terms
from jaxserve.lora_request import LoRARequest
from jaxserve.server.chat.reasoning import REASONING_PARSERS
from jaxserve.server.chat.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.server.launch.vllm_flags import add_vllm_flags
from jaxserve.server.lora import parse_lora_module
from jaxserve.server.settings import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_RESPONSE_ENTRIES,
    DEFAULT_MAX_SEQS_PER_REQUEST,
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_MAX_TOKENS_PER_REQUEST,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_SEND_TIMEOUT_S,
    METRICS_PREFIXES,
    ServerSettings,
)
from jaxserve.units import COUNT_RULE, human_bytes, human_int

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
API_KEY_ENV = "JAXSERVE_API_KEY"
# --task (vLLM's older flag) -> the --runner it means.
TASKS = {"generate": "generate", "embed": "pooling", "score": "pooling"}
# Flag defaults are EngineConfig's, so the two cannot drift apart.
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local Hugging Face model directory, or a model id (org/name) already in the "
        "local Hugging Face cache (nothing is downloaded); omitted: the embedded demo model",
    )
    add(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the model, as a flag (vLLM's older spelling of the positional MODEL)",
    )
    add(
        "--revision",
        default=None,
        help="of a model id: the branch, tag or commit to serve from the cache; default: main",
    )
    add(
        "--tokenizer",
        default=None,
        help="the tokenizer's directory or cached model id; default: the model's",
    )
    add(
        "--tokenizer-revision",
        default=None,
        help="of a tokenizer id: the branch, tag or commit; default: main",
    )
    add(
        "--download-dir",
        default=None,
        help="the Hugging Face cache to find model ids in (vLLM downloads into it; jaxserve "
        "only reads it); default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub",
    )
    add(
        "--host",
        default="0.0.0.0",
        help="address to bind; the default, all interfaces, suits containers: without "
        "--api-key anyone who reaches the port can use the model (a warning says so); "
        "127.0.0.1 serves this machine only",
    )
    add("--port", type=port_number, default=8000, help="port to bind (0-65535)")
    add(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients send as `model` (the first is the metrics label); "
        "default: MODEL as given, or jaxserve-demo",
    )
    add(
        "--runner",
        choices=RUNNERS,
        default=None,
        help="what the model serves: generate (completions, chat, responses) or pooling "
        "(POST /v1/embeddings, with the pooling and normalization of the model's "
        "sentence-transformers config: docs/embeddings.md); auto (the default): pooling for a "
        "checkpoint whose config.json names only base models (Qwen3Model, MistralModel)",
    )
    add(
        "--task",
        choices=TASKS,
        default=None,
        help="vLLM's older spelling of --runner: embed and score are --runner pooling, "
        "generate is --runner generate",
    )
    add(
        "--hf-overrides",
        type=hf_overrides_json,
        default=None,
        metavar="JSON",
        help="config.json keys to set on top of the model's, as vLLM's: served for a "
        "Qwen3-Reranker-style decoder reranker (POST /v1/rerank, /v1/score), e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' (docs/embeddings.md)',
    )
    add(
        "--max-model-len",
        type=human_int,
        default=None,
        help=f"context length in tokens ({COUNT_RULE}: lowercase k is 1,000 and uppercase "
        "K is 1,024, as in vLLM); default: the model's",
    )
    add(
        "--gpu-memory-utilization",
        "--memory-utilization",
        dest="gpu_memory_utilization",
        type=float,
        default=_ENGINE_DEFAULTS["gpu_memory_utilization"],
        help="fraction of device memory for weights + KV cache, taken at start from every "
        "visible GPU; serve exits at once if another process holds more than the rest",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=_ENGINE_DEFAULTS["max_num_seqs"],
        help="sequences in one step at most; default: per device, as vLLM: up to 1,024 on GPUs "
        "of 70 GiB or more (not A100), as many as the KV cache holds at 2,048 tokens each (or "
        "--max-model-len if shorter), never fewer than 256 nor more than "
        "--max-num-batched-tokens; 256 on other devices (the start-up log says which)",
    )
    add(
        "--max-num-batched-tokens",
        type=human_int,
        default=_ENGINE_DEFAULTS["max_num_batched_tokens"],
        help="tokens in one step at most",
    )
    add(
        "--block-size",
        type=int,
        default=_ENGINE_DEFAULTS["block_size"],
        help="tokens per KV-cache block",
    )
    add(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV-cache blocks to allocate, ignoring the memory budget (testing)",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS["enable_prefix_caching"],
        help="reuse KV blocks of shared prompt prefixes",
    )
    add(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS["enable_chunked_prefill"],
        help="split long prompts over several steps",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS["async_scheduling"],
        help="schedule and dispatch the next step before the current one's tokens are read "
        "back, so host work overlaps the device (off while a request uses penalties)",
    )
    add(
        "--batch-invariant",
        action="store_true",
        help="a sequence's logits and logprobs are bitwise the same whatever else is in its "
        "batch and however its prompt is chunked (vLLM's VLLM_BATCH_INVARIANT), so an RL "
        "rollout replays exactly: every matmul runs on 128-row tiles and attention unsplit. "
        "Costs little at decode, more on long prefills (docs/determinism.md); dense models "
        "on one device only",
    )
    add(
        "--serve-while-compiling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take requests as soon as the smallest step has compiled, while the others "
        "compile (those of up to --max-num-seqs tokens first; meanwhile prompts run in "
        "smaller chunks and fewer sequences share a step); off: every step compiles before "
        "the server starts",
    )
    add(
        "--grammar-compile-timeout",
        type=float,
        metavar="SECONDS",
        default=_ENGINE_DEFAULTS["grammar_compile_timeout_s"],
        help="the longest a request's structured-output constraint (JSON schema, regex, "
        "grammar) may take to compile; a slower one is refused with a 400",
    )
    add(
        "--sampler-variants",
        choices=SAMPLER_VARIANTS,
        default=_ENGINE_DEFAULTS["sampler_variants"],
        help="sampler programs compiled per sequence bucket: all 20 variants, each doing only "
        "what its batch needs, or a compact 3 (greedy, plain sampling, everything), far "
        "quicker to compile for a little more work per step; auto: compact on the CPU",
    )
    add(
        "--max-grammar-bytes",
        type=int,
        metavar="BYTES",
        default=_ENGINE_DEFAULTS["max_grammar_bytes"],
        help="the largest structured-output constraint (a schema, regex, choice list or "
        "grammar, or a GBNF grammar's Lark form) compiled; a larger one is refused with a 400 "
        "(docs/security.md)",
    )
    add(
        "--grammar-cache-bytes",
        type=int,
        metavar="BYTES",
        default=_ENGINE_DEFAULTS["grammar_cache_bytes"],
        help="memory the compiled grammars kept for reuse may hold; the least recently used "
        "is dropped first",
    )
    add(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=_ENGINE_DEFAULTS["scheduling_policy"],
        help="waiting-queue order",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_ENGINE_DEFAULTS["tensor_parallel_size"],
        help="devices per model replica",
    )
    add(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=_ENGINE_DEFAULTS["data_parallel_size"],
        help="model replicas (engines) behind this one server, each on its own "
        "--tensor-parallel-size devices; data parallel size x tensor parallel size must fit "
        "the visible devices (docs/scaling.md)",
    )
    add(
        "--data-parallel-balancer",
        choices=DATA_PARALLEL_BALANCERS,
        default=_ENGINE_DEFAULTS["data_parallel_balancer"],
        help="how a request's replica is picked when --data-parallel-size > 1: prefix (the "
        "replica that took the prompt's prefix, unless it is much busier than the least "
        "loaded one), least-loaded or round-robin",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts: whole experts per device (tokens exchanged by all-to-all) "
        "instead of a slice of every expert; attention stays tensor parallel",
    )
    add(
        "--coordinator-address",
        default=None,
        help="multi-host replica: host:port of process 0 ('auto': detect on TPU pods, Slurm); "
        "also $JAXSERVE_COORDINATOR_ADDRESS",
    )
    add(
        "--num-processes",
        type=int,
        default=None,
        help="multi-host replica: number of processes, one per host (also $JAXSERVE_NUM_PROCESSES)",
    )
    add(
        "--process-id",
        type=int,
        default=None,
        help="multi-host replica: this process's index; 0 serves HTTP, the others follow "
        "(also $JAXSERVE_PROCESS_ID)",
    )
    add(
        "--dtype",
        type=dtype_name,
        choices=DTYPES,
        default=_ENGINE_DEFAULTS["dtype"],
        help="weights and activations dtype (also vLLM's half = float16, float = float32); "
        "auto: bfloat16 on accelerators, float32 on the CPU",
    )
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=_ENGINE_DEFAULTS["kv_cache_dtype"],
        help="KV cache dtype: auto stores the weights' dtype; fp8 (= fp8_e4m3) and fp8_e5m2 "
        "store one byte per element, twice the tokens, with the checkpoint's k_scale / v_scale "
        "or 1.0 (needs fp8 support: compute capability 8.9+ on NVIDIA GPUs)",
    )
    add(
        "--load-format",
        type=load_format_name,
        choices=LOAD_FORMATS,
        default=_ENGINE_DEFAULTS["load_format"],
        help="auto (or safetensors): the model's safetensors; dummy: random weights (benchmarks)",
    )
    add(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8 or int8: quantize the Linear weights on load (per-channel scales; fp8 runs "
        "W8A8 on fp8 GPUs, weight-only elsewhere); default: the checkpoint's "
        "quantization_config (fp8, compressed-tensors, awq, gptq), else none",
    )
    add(
        "--seed",
        type=int,
        default=_ENGINE_DEFAULTS["seed"],
        help="seed for requests that send none",
    )
    add(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' (also read from ${API_KEY_ENV})",
    )
    add(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests (n>1 counts n) before new ones get 429; default: unbounded",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    add("--ssl-keyfile", default=None, help="TLS private key (with --ssl-certfile)")
    add("--ssl-certfile", default=None, help="TLS certificate (with --ssl-keyfile)")
    add(
        "--compilation-cache-dir",
        default=None,
        help="persistent XLA compilation cache; default: $JAXSERVE_COMPILATION_CACHE, else "
        "$XDG_CACHE_HOME/jaxserve/xla (~/.cache/jaxserve/xla without it)",
    )
    add("--log-level", choices=LOG_LEVELS, default="info", help="log level")
    add(
        "--uvicorn-log-level",
        choices=(*LOG_LEVELS, "trace"),
        default=None,
        help="log level of the HTTP server's own loggers; default: --log-level",
    )
    add(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, running and waiting requests, KV cache use)",
    )
    add(
        "--metrics-prefix",
        choices=METRICS_PREFIXES,
        default="both",
        help="the names /metrics uses: both (every series under vllm: as vLLM names and labels "
        'it, with engine="0", and under jaxserve:), vllm (only vLLM\'s series, as a vLLM '
        "server exports them; jaxserve's own, such as rate_limited_requests, are left out), or "
        "jaxserve (only jaxserve:, as before)",
    )
    add(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help=SPECULATIVE_CONFIG_HELP,
    )
    add(
        "--kv-events-config",
        type=kv_events_config,
        default=None,
        metavar="JSON",
        help="publish KV-cache events as vLLM does, for prefix-aware routers (llm-d): a JSON "
        "object of vLLM's KVEventsConfig, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
        '"topic": "kv-events"}\' (also buffer_steps, hwm, max_queue_size, and event_encoding: '
        "map as vLLM now sends, or array for older subscribers; docs/kv_events.md)",
    )
    add(
        "--metrics-require-key",
        action="store_true",
        help="guard /metrics with the API key too; without it /metrics is public",
    )
    add(
        "--enable-sleep-mode",
        action="store_true",
        help="serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's): the "
        "model gives its device memory up between a training loop's rollouts",
    )
    add(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (docs/lora.md): a request picks one by its model name",
    )
    add(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters served at start: name=path (a PEFT adapter directory), or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; needs --enable-lora',
    )
    add(
        "--max-loras",
        type=int,
        default=1,
        help="adapters on the device at once, each in a slot; one step mixes them freely",
    )
    add(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest adapter rank served; smaller ranks are padded to it",
    )
    add(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory, least recently used out first (default: --max-loras)",
    )
    add(
        "--enable-weight-updates",
        action="store_true",
        help="serve POST /update_weights_from_disk (SGLang's route): a client with the API key "
        "may load a safetensors checkpoint of this model from the server's disk",
    )
    add(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, sizes, timings and finish reason (no text), and an "
        "access line per HTTP request",
    )
    add(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        default=argparse.SUPPRESS,  # --enable-log-requests' default stands
        help="log no requests (the default; vLLM's older flag)",
    )
    add(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access line per HTTP request, even with --enable-log-requests",
    )
    add(
        "--log-prompts",
        action="store_true",
        help="also log prompt and output text (implies --enable-log-requests)",
    )
    add(
        "--max-request-body-bytes",
        type=human_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger bodies get 413 before they are read (2M = 2 MiB, 2MB = 2,000,000)",
    )
    add(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds from the headers to the end of the body; a slower body gets 408",
    )
    add(
        "--send-timeout",
        type=float,
        default=DEFAULT_SEND_TIMEOUT_S,
        help="seconds a response may wait for a client that stopped reading; then the "
        "response ends and its request is aborted",
    )
    add(
        "--rate-limit-rpm",
        type=int,
        default=None,
        help="requests per minute per API key (per client address without --api-key); "
        "past it: 429 with Retry-After; default: unlimited",
    )
    add(
        "--rate-limit-tpm",
        type=human_int,
        default=None,
        help="tokens per minute per API key or address, counted as prompt + n * max_tokens "
        "when a request is admitted; default: unlimited",
    )
    add(
        "--max-seqs-per-request",
        type=int,
        default=DEFAULT_MAX_SEQS_PER_REQUEST,
        help="sequences one request may start: prompts x n (x best_of when larger); past it: 400",
    )
    add(
        "--max-tokens-per-request",
        type=human_int,
        default=DEFAULT_MAX_TOKENS_PER_REQUEST,
        help="tokens one request may ask for: n (or best_of) x max_tokens, summed over its "
        "prompts (1M = 1,048,576); past it: 400",
    )
    add(
        "--max-response-entries",
        type=human_int,
        default=DEFAULT_MAX_RESPONSE_ENTRIES,
        help="how large a response one request may ask for, estimated before it runs: each "
        "token of text (generated or echoed) counts 1, plus 1 per top logprob; the default is "
        "about 25 MB of JSON; past it: 400",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests send tool_choice "auto" (the default when they send tools): the '
        "model decides whether to call tools, and its output is parsed with --tool-call-parser "
        '("required" and named choices work without it: a grammar makes the calls)',
    )
    add(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's tool-call format, for --enable-auto-tool-choice: hermes (Qwen2.5, "
        "Qwen3: <tool_call>{...}</tool_call>), llama3_json (Llama 3.1+: JSON objects), "
        "mistral ([TOOL_CALLS][...], or [TOOL_CALLS]name[ARGS]{...} from tokenizer v11)",
    )
    add(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template, a Jinja file or the template itself, for models that ship "
        "none or to replace theirs; default: the model's (tokenizer_config.json or "
        "chat_template.jinja)",
    )
    add(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the model's <think>...</think> section into message.reasoning_content: "
        "qwen3 (reasoning when the output opens <think>), deepseek_r1 (the output starts in "
        "reasoning); structured outputs and forced tool calls then apply after </think>",
    )
    add(
        "--max-stored-responses",
        type=human_int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help="responses of /v1/responses kept in memory (store: true) for GET and "
        "previous_response_id; past it the least recently used one is dropped (404 after)",
    )
    add_vllm_flags(parser)


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


SPECULATIVE_CONFIG_HELP = (
    'speculative decoding as vLLM configures it: a JSON object, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
    "(also disable_by_batch_size: no drafts in a step with more running sequences, default "
    "32). Methods: ngram, draft_model (model: a small model of the same tokenizer), eagle3 "
    "(model: an EAGLE-3 head directory), mtp (DeepSeek-V3's own MTP layers). Lossless: "
    "greedy output is unchanged (docs/speculative_decoding.md)"
)


def speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``: vLLM's JSON object (a bad field is a usage error naming it)."""
    try:
        return SpeculativeConfig.of(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``: vLLM's JSON object (a bad field is a usage error naming it)."""
    try:
        return KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_format_name(text: str) -> str:
    """``--load-format``: vLLM's ``safetensors`` is what ``auto`` loads."""
    return "auto" if text == "safetensors" else text


def model_from_args(args: argparse.Namespace) -> str:
    """MODEL or --model (vLLM takes both); "" for the demo model."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(
            f"MODEL {args.model!r} and --model {args.model_flag!r} differ: give the model once"
        )
    return args.model or args.model_flag or ""


def hf_overrides_json(text: str) -> dict:
    """``--hf-overrides``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object of config.json keys is expected")
    return value


def runner_from_args(args: argparse.Namespace) -> str:
    """--runner, or what --task means (they must agree when both are given)."""
    runner, task = getattr(args, "runner", None), getattr(args, "task", None)
    if task is not None:
        if runner is not None and runner != TASKS[task]:
            raise ValueError(f"--task {task} means --runner {TASKS[task]}, not --runner {runner}")
        runner = TASKS[task]
    return str(runner or _ENGINE_DEFAULTS["runner"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        runner=runner_from_args(args),
        hf_overrides=getattr(args, "hf_overrides", None),
        model=model_from_args(args),
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        tokenizer=args.tokenizer,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        download_dir=args.download_dir,
        chat_template=args.chat_template,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        async_scheduling=args.async_scheduling,
        enable_sleep_mode=args.enable_sleep_mode,
        batch_invariant=args.batch_invariant,
        serve_while_compiling=args.serve_while_compiling,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        max_grammar_bytes=args.max_grammar_bytes,
        sampler_variants=args.sampler_variants,
        grammar_cache_bytes=args.grammar_cache_bytes,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        data_parallel_balancer=args.data_parallel_balancer,
        enable_expert_parallel=args.enable_expert_parallel,
        compilation_cache_dir=args.compilation_cache_dir,
        kv_events_config=args.kv_events_config,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def settings_from_args(args: argparse.Namespace, model_name: str) -> ServerSettings:
    if args.api_key == "":
        raise ValueError("--api-key is empty: give a key, or leave the flag out (no auth)")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return ServerSettings(
        served_model_names=tuple(args.served_model_name or [model_name]),
        api_key=api_key,
        metrics_require_key=args.metrics_require_key,
        metrics_prefix=args.metrics_prefix,
        enable_log_requests=args.enable_log_requests or args.log_prompts,
        log_stats=not args.disable_log_stats,
        log_prompts=args.log_prompts,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        request_body_timeout_s=args.request_body_timeout,
        send_timeout_s=args.send_timeout,
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm,
        max_seqs_per_request=args.max_seqs_per_request,
        max_tokens_per_request=args.max_tokens_per_request,
        max_response_entries=args.max_response_entries,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_weight_updates=args.enable_weight_updates,
        max_stored_responses=args.max_stored_responses,
        lora_modules=lora_modules_from_args(args),
    )


def lora_modules_from_args(args: argparse.Namespace) -> tuple[LoRARequest, ...]:
    """``--lora-modules``, ids from 1 in the order given; a name twice is an error."""
    specs = args.lora_modules or []
    if specs and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    modules = tuple(parse_lora_module(text, i + 1) for i, text in enumerate(specs))
    names = [m.lora_name for m in modules]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"--lora-modules names {name!r} twice")
    return modules


def flag_terms(exc: Exception) -> str:
    """The error's message naming flags, not the Python fields they set (flag_names.py)."""
    return in_flag_terms(str(exc), command_flags(add_launch_arguments))


def add_launch_arguments_named(parser: argparse.ArgumentParser, dests: tuple[str, ...]) -> None:
    """The launch flags that set ``dests`` (``"dtype"``, ``"quantization"``...), exactly as
    ``serve`` defines them: another command that takes them (``convert``) reads them the same."""
    launch = argparse.ArgumentParser(add_help=False)
    add_launch_arguments(launch)
    for action in launch._actions:
        if action.dest in dests:
            # NOTE: argparse's own way to share an action (``parents=`` adds them so too).
            parser._add_action(action)
