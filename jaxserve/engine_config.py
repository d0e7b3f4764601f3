"""EngineConfig: every knob of the engine, frozen and validated where it is made.

Built by ``jaxserve launch`` (from flags) and by ``jaxserve.LLM`` (from keyword arguments), and
passed down to the scheduler, the KV-cache manager and the runner (so it lives below all three).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.hf_cache import resolve_model_dir
from jaxserve.sampling_params import DEFAULT_MAX_GRAMMAR_BYTES

_LOG = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# vLLM's other names for the same dtypes (--dtype half).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_name(text: str) -> str:
    """A ``--dtype`` value in jaxserve's spelling (``half`` -> ``float16``)."""
    return DTYPE_ALIASES.get(text, text)


SCHEDULING_POLICIES = ("fcfs", "priority")
# max_num_seqs where no device sets it (runner/batch_size.py: vLLM's default on most devices)
BASE_MAX_NUM_SEQS = 256
# --quantization: fp8 / int8 quantize bf16 weights on load; the others name a pre-quantized
# checkpoint's method (which is detected from its config.json without the flag).
QUANTIZATIONS = ("fp8", "int8", "compressed-tensors", "awq", "gptq")
# Those that quantize a checkpoint stored in bf16 while it loads (per output channel).
ON_LOAD_QUANTIZATIONS = ("fp8", "int8")
# --kv-cache-dtype, in vLLM's spelling: auto stores the weight dtype; fp8 is fp8_e4m3, as in
# vLLM on CUDA.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Bytes per element of what a cache stores (the names kv_cache_dtype_name returns).
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def weight_dtype(dtype: str, on_cpu: bool) -> str:
    """The dtype ``--dtype`` means on a device: ``auto`` is bfloat16 on accelerators and
    float32 on the CPU (exact parity with the reference there). ``launch`` and ``capacity``
    both ask this, so they plan with the same weight bytes."""
    if dtype != "auto":
        return dtype
    return "float32" if on_cpu else "bfloat16"


def kv_cache_dtype_name(kv_cache_dtype: str, weight_dtype: str) -> str:
    """What the KV cache stores: ``auto`` the weights' dtype (as ``weight_dtype`` resolves it),
    ``fp8`` ``fp8_e4m3``; ``launch`` and ``capacity`` both ask this."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "auto":
        return weight_dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


# --kv-events-config (vLLM's KVEventsConfig): its publishers, and how each event is encoded.
KV_EVENT_PUBLISHERS = ("null", "zmq")
# "map": each event a msgpack map tagged by "type", as vLLM publishes since its events dropped
# array_like (vllm#42892); "array": the earlier positional layout, tag first, that subscribers
# older than that decode (docs/kv_events.md).
KV_EVENT_ENCODINGS = ("map", "array")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: the same fields, defaults and meaning, plus ``event_encoding``.

    Read by the engine (``engine/kv_events.py`` collects the block pool's events, and
    ``engine/kv_event_publisher.py`` sends them) from ``EngineConfig.kv_events_config``."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has * or ::, else connected
    replay_endpoint: str | None = None  # ROUTER socket replaying buffered batches
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; then dropped
    topic: str = ""
    event_encoding: str = "map"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(
                f"kv_events_config publisher={self.publisher!r} must be one of "
                f"{', '.join(KV_EVENT_PUBLISHERS)}"
            )
        if self.event_encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(
                f"kv_events_config event_encoding={self.event_encoding!r} must be one of "
                f"{', '.join(KV_EVENT_ENCODINGS)}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config {name}={getattr(self, name)} must be >= 1")
        if not self.endpoint:
            raise ValueError("kv_events_config endpoint must not be empty")

    @property
    def is_publishing(self) -> bool:
        """Events are collected and sent: enabled, with a publisher other than null."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """``--kv-events-config``'s JSON object; ``ValueError`` naming a key it does not know
        or a value of the wrong type."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_events_config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in fields:
                raise ValueError(
                    f"kv_events_config has no field {key!r} (fields: {', '.join(fields)})"
                )
            kinds = _KV_EVENT_FIELD_TYPES[key]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ValueError(f"kv_events_config {key}={value!r} has the wrong type")
        return cls(**data)


_KV_EVENT_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
    "event_encoding": (str,),
}


# --speculative-config (vLLM's): the drafting methods a config may name; those of
# SPECULATIVE_METHODS_BUILT run, the others are refused at start-up until they land.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
SPECULATIVE_METHODS_BUILT = ("ngram", "draft_model", "eagle3", "mtp")
# The most tokens drafted per sequence and step.
MAX_SPECULATIVE_TOKENS = 15


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: how tokens are drafted, and how many per step.

    Read by the engine (``engine/spec_decode.py`` drafts and verifies) from
    ``EngineConfig.speculative_config``; docs/speculative_decoding.md."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest suffix of prompt + output of a length in [min, max] found earlier in
    # them proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # draft_model, eagle3: the drafter's directory or model id; mtp: None (the target's own).
    model: str | None = None
    # No token is drafted in a step whose running sequences exceed this (vLLM's name): at a
    # large batch the step is bound by compute, and a verify's extra tokens cost more than
    # they save. None: DEFAULT_DISABLE_BY_BATCH_SIZE.
    disable_by_batch_size: int | None = None
    # jaxserve's own: drafting pauses for a while when it has not paid over its last steps
    # (few drafted tokens accepted; ``spec_decode.DraftPayoff``), so speculation does not make
    # a workload it cannot help slower. False: every step that may draft does.
    pause_when_unpaid: bool = True
    # draft_model, eagle3 (vLLM's field): the drafter's weights in fewer bits, as the target's
    # --quantization: fp8 or int8 quantized on load (per output channel; its projections and
    # an EAGLE-3 head's fc and lm_head), or the method of a draft checkpoint quantized so.
    # None: a quantized draft checkpoint as it is stored, any other in the serving dtype.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method={self.method!r} must be one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k} must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if self.prompt_lookup_min < 1:
            raise ValueError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be >= 1"
            )
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config prompt_lookup_max={self.prompt_lookup_max} must be >= "
                f"prompt_lookup_min={self.prompt_lookup_min}"
            )
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config method={self.method!r} needs model (a directory)")
        size = self.disable_by_batch_size
        if size is not None and size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size={size} must be >= 1")
        self._check_quantization()

    def _check_quantization(self) -> None:
        quantization = self.quantization
        if quantization is None:
            return
        if self.method not in ("draft_model", "eagle3"):
            raise ValueError(
                f"speculative_config quantization={quantization!r} applies to a drafter's own "
                f"weights (method draft_model or eagle3); method={self.method!r} has none"
            )
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config quantization={quantization!r} must be one of "
                f"{', '.join(QUANTIZATIONS)}"
            )
        if self.method == "eagle3" and quantization not in ON_LOAD_QUANTIZATIONS:
            raise ValueError(
                f"speculative_config quantization={quantization!r} for an EAGLE-3 head must be "
                f"one of {', '.join(ON_LOAD_QUANTIZATIONS)} (quantized on load; heads are "
                "published in bf16)"
            )

    @property
    def max_batch_size(self) -> int:
        """The most running sequences a step drafts for (``disable_by_batch_size``)."""
        size = self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE if size is None else size

    def check_built(self) -> None:
        """Start-up: ``NotImplementedError`` naming a method that does not run yet."""
        if self.method not in SPECULATIVE_METHODS_BUILT:
            raise NotImplementedError(
                f"speculative_config method={self.method!r} is not built yet (built: "
                f"{', '.join(SPECULATIVE_METHODS_BUILT)}); docs/speculative_decoding.md"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str) -> SpeculativeConfig:
        """A config from itself, a dict (``LLM(speculative_config={...})``) or JSON text
        (``--speculative-config``); ``ValueError`` naming an unknown key or a wrong type."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object (a dict)")
        for key, item in value.items():
            if key not in _SPECULATIVE_FIELD_TYPES:
                fields = ", ".join(_SPECULATIVE_FIELD_TYPES)
                raise ValueError(f"speculative_config has no field {key!r} (fields: {fields})")
            kinds = _SPECULATIVE_FIELD_TYPES[key]
            if not isinstance(item, kinds) or (isinstance(item, bool) and bool not in kinds):
                raise ValueError(f"speculative_config {key}={item!r} has the wrong type")
        return cls(**value)

    @property
    def drafter(self) -> str:
        """The drafter, as the capacity lines name it: ``eagle3 /models/head``."""
        return f"{self.method} {self.model or ''}".strip()

    def describe(self) -> str:
        text = f"{self.method}, {self.num_speculative_tokens} tokens per step"
        if self.method == "ngram":
            text += f", n-grams of {self.prompt_lookup_min} to {self.prompt_lookup_max} tokens"
        elif self.model:
            text += f", drafter {self.model}"
        if self.quantization is not None:
            text += f" ({self.quantization})"
        return text


# A step with more running sequences than this drafts nothing: at batch 32 a decode step of an
# 8B model on an H100-class GPU still reads the weights far longer than it computes, so k more
# tokens per sequence cost little; the measured crossover on the H200 replaces it
# (benchmarks/spec_decode.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32

_SPECULATIVE_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "num_speculative_tokens": (int,),
    "prompt_lookup_min": (int,),
    "prompt_lookup_max": (int,),
    "model": (str, type(None)),
    "disable_by_batch_size": (int, type(None)),
    "pause_when_unpaid": (bool,),
    "quantization": (str, type(None)),
}


def default_model_dir() -> Path:
    """The model served when none is named: the demo model shipped inside the package."""
    return Path(__file__).resolve().parent / "assets" / "demo"


SAMPLER_VARIANTS = ("auto", "all", "compact")
# How a data-parallel server picks the replica of a request (engine/balancer.py).
DATA_PARALLEL_BALANCERS = ("prefix", "least-loaded", "round-robin")
# --runner, vLLM's: generate (completions and chat), pooling (embeddings: docs/embeddings.md);
# auto pools a checkpoint whose config.json names only base models (Qwen3Model, MistralModel).
RUNNERS = ("auto", "generate", "pooling")

# Either lets max_model_len exceed what the model was made for (vLLM's name is the second).
ALLOW_LONG_MAX_MODEL_LEN = ("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def is_long_max_model_len_allowed() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
        for name in ALLOW_LONG_MAX_MODEL_LEN
    )


def _limit_source(model_config: ModelConfig) -> str:
    text = f"max_position_embeddings={model_config.max_position_embeddings}"
    scaling = model_config.rope_scaling
    if model_config.derived_max_model_len != model_config.max_position_embeddings and scaling:
        text += f", rope {scaling.rope_type} factor {scaling.factor:g}"
        if scaling.rope_type == "yarn":
            original = scaling.original_max_position_embeddings
            text += f" over original_max_position_embeddings={original}"
    return text


def sample_rows(max_num_seqs: int, spec: SpeculativeConfig | None) -> int:
    """The most sampler rows a step of ``max_num_seqs`` sequences takes (``EngineConfig
    .max_sample_rows``): with ``spec``, the drafting sequences' drafts too."""
    if spec is None:
        return max_num_seqs
    drafting = min(max_num_seqs, spec.max_batch_size)
    return max(max_num_seqs, drafting * (1 + spec.num_speculative_tokens))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # A local Hugging Face directory, or a model id (org/name) in the Hugging Face cache; ""
    # means the embedded demo model.
    model: str = ""
    served_model_name: str | None = None
    tokenizer: str | None = None  # a directory or a cached model id; None: the model's
    revision: str | None = None  # of a model id: a branch, tag or commit; None: main
    tokenizer_revision: str | None = None  # of a tokenizer id; None: main
    download_dir: str | None = None  # the Hugging Face cache to look in; None: HF's default
    chat_template: str | None = None  # a Jinja file, or the template itself; None: the model's
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; fp8 halves the cache's bytes per token
    load_format: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS; None: the checkpoint's, if any
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # None: per device, sized from the KV cache at engine start (runner/batch_size.py): 1,024 at
    # most on GPUs of 70 GiB or more, 256 elsewhere; read it through resolved_max_num_seqs.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    tensor_parallel_size: int = 1
    # A mixture of experts split by whole experts over the tensor-parallel devices (tokens
    # exchanged by all-to-all), attention staying tensor parallel; off: each expert is split.
    enable_expert_parallel: bool = False
    # Data parallel on one host: data_parallel_size engines behind one server, each on its own
    # tensor_parallel_size devices; this engine is replica data_parallel_rank and runs on the
    # devices [rank * tensor_parallel_size, (rank + 1) * tensor_parallel_size).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_balancer: str = "prefix"  # DATA_PARALLEL_BALANCERS (engine/balancer.py)
    compilation_cache_dir: str | None = None
    warmup: bool = True  # compile every shape bucket at start-up
    # Take requests once the smallest bucket has compiled; the others compile meanwhile
    # (those of up to max_num_seqs tokens first) and each step's token budget rises as they
    # finish.
    serve_while_compiling: bool = False
    # Schedule and dispatch step n + 1 before reading step n's tokens back (host work
    # overlaps the device); off: every step is read back before the next is scheduled.
    async_scheduling: bool = True
    # The model may sleep (give its device memory up) and wake: LLM.sleep / wake_up and the
    # server's /sleep, /wake_up and /is_sleeping, as vLLM's --enable-sleep-mode.
    enable_sleep_mode: bool = False
    # The longest a request's structured-output grammar may take to compile (then a 400).
    grammar_compile_timeout_s: float = 10.0
    # The largest structured-output source (schema, regex, choices, grammar) compiled, in bytes
    # (docs/security.md: what bounds the grammar compiler's stack).
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    # Native memory the compiled grammars kept for reuse may hold (least recently used first out).
    grammar_cache_bytes: int = 1 << 30
    # Sampler programs per sequence bucket: "all" 20 variants, each doing only what its batch
    # needs; "compact" 3 (greedy, plain sampling, everything), far less to compile for a
    # little more work per step; "auto": compact on the CPU, all on accelerators.
    sampler_variants: str = "auto"
    # Memory the KV budget is a fraction of; None: what the device reports (CPU: 2 GiB).
    device_memory_bytes: int | None = None
    # A sequence's logits bitwise the same whatever else is in its step and however its prompt
    # is chunked (vLLM's VLLM_BATCH_INVARIANT): GEMMs in fixed row tiles, attention unsplit
    # (docs/determinism.md). Dense decoders on one device.
    batch_invariant: bool = False
    # What the model serves (RUNNERS): "pooling" runs prompts only and returns embeddings.
    runner: str = "auto"
    # vLLM's --hf-overrides: config.json keys set on top of the file's. Served: a decoder
    # reranker's (architectures, classifier_from_token, is_original_qwen3_reranker).
    hf_overrides: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    # KV-cache events (vLLM's --kv-events-config): BlockStored / BlockRemoved / AllBlocksCleared
    # published over ZeroMQ for prefix-aware routers (docs/kv_events.md); None: none.
    kv_events_config: KVEventsConfig | None = None
    # LoRA adapters (docs/lora.md): device slots, their rank, adapters kept in host memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # Speculative decoding (vLLM's --speculative-config; docs/speculative_decoding.md): a
    # SpeculativeConfig, or its dict / JSON text; None: off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            spec = SpeculativeConfig.of(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} must be one of {LOAD_FORMATS}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} must be one of {', '.join(QUANTIZATIONS)}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} must be one of {SCHEDULING_POLICIES}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be at least 2")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 16:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 16"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be at least 2"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s={self.grammar_compile_timeout_s} must be positive"
            )
        if self.sampler_variants not in SAMPLER_VARIANTS:
            raise ValueError(
                f"sampler_variants={self.sampler_variants!r} must be one of "
                f"{', '.join(SAMPLER_VARIANTS)}"
            )
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides={self.hf_overrides!r} must be a JSON object")
        if self.max_grammar_bytes < 1:
            raise ValueError(f"max_grammar_bytes={self.max_grammar_bytes} must be positive")
        if self.grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes={self.grammar_cache_bytes} must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_rank} must be in "
                f"[0, data_parallel_size={self.data_parallel_size})"
            )
        if self.data_parallel_balancer not in DATA_PARALLEL_BALANCERS:
            raise ValueError(
                f"data_parallel_balancer={self.data_parallel_balancer!r} must be one of "
                f"{', '.join(DATA_PARALLEL_BALANCERS)}"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} must be one of {', '.join(RUNNERS)}")
        self._check_lora()
        self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"batch_invariant=True needs tensor_parallel_size=1, not "
                f"{self.tensor_parallel_size}: the all-reduces of a tensor-parallel step are "
                "not batch-invariant"
            )
        if self.enable_lora:
            raise ValueError(
                "batch_invariant=True with enable_lora: the adapters' GEMMs are not in fixed row "
                "tiles; serve one or the other"
            )

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}"
            )

    @property
    def resolved_max_num_seqs(self) -> int:
        """``max_num_seqs`` once the engine has set it (``runner/batch_size.py``: the user's,
        or the device's default); before that, ``BASE_MAX_NUM_SEQS`` (256), for code that only
        sizes something by it."""
        return self.max_num_seqs if self.max_num_seqs is not None else BASE_MAX_NUM_SEQS

    @property
    def max_sample_rows(self) -> int:
        """The most sampler rows a step takes: one per running sequence, and with speculative
        decoding one more per drafted token of the sequences that draft (at most
        ``disable_by_batch_size`` of them, ``num_speculative_tokens`` each). The steps' sequence
        rows, the sampler and the pending-token feed are sized by it, so that with few
        sequences (``--max-num-seqs 1``, say) every draft still has a row to be verified in."""
        return sample_rows(self.resolved_max_num_seqs, self.speculative_config)

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def resolved_max_model_len(self, model_config: ModelConfig, warn: bool = False) -> int:
        """The context length served: ``max_model_len`` or the model's own. One longer than
        the model was made for is a ``ValueError`` unless ``$JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN``
        (or vLLM's ``$VLLM_ALLOW_LONG_MAX_MODEL_LEN``) is 1, as vLLM refuses it; ``warn``
        logs a warning when it is allowed (the engine's one call does)."""
        limit = model_config.derived_max_model_len
        if self.max_model_len is None or self.max_model_len <= limit:
            return self.max_model_len or model_config.max_position_embeddings
        if is_long_max_model_len_allowed():
            if warn:
                _LOG.warning(
                    "max_model_len=%d is longer than the %d tokens the model was made for "
                    "(allowed by $%s or $%s): outputs past them may be garbage",
                    self.max_model_len,
                    limit,
                    *ALLOW_LONG_MAX_MODEL_LEN,
                )
            return self.max_model_len
        raise ValueError(
            f"max_model_len={self.max_model_len} is longer than the {limit} tokens the model "
            f"was made for ({_limit_source(model_config)} in its config.json): past them its "
            f"positions are untrained and the output is garbage. Lower --max-model-len to "
            f"{limit} or less, or set {ALLOW_LONG_MAX_MODEL_LEN[0]}=1 to serve it anyway"
        )

    @property
    def model_dir(self) -> Path:
        """The model's directory: ``model`` itself, or its snapshot in the Hugging Face cache
        (hf_cache.py; raises ModelNotFoundError when neither exists)."""
        if not self.model:
            return default_model_dir()
        return resolve_model_dir(self.model, self.revision, self.download_dir)

    @property
    def tokenizer_dir(self) -> Path:
        if not self.tokenizer:
            return self.model_dir
        return resolve_model_dir(self.tokenizer, self.tokenizer_revision, self.download_dir)

    @property
    def model_name(self) -> str:
        """The id clients send as ``model`` (and the metrics label)."""
        if self.served_model_name:
            return self.served_model_name
        return self.model or "jaxserve-demo"

    @property
    def cache_dir(self) -> str:
        """--compilation-cache-dir, else $JAXSERVE_COMPILATION_CACHE, else jaxserve/xla in the
        user's cache directory ($XDG_CACHE_HOME, else ~/.cache, as the XDG spec says)."""
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        if os.environ.get("JAXSERVE_COMPILATION_CACHE"):
            return os.environ["JAXSERVE_COMPILATION_CACHE"]
        user_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return str(Path(user_cache) / "jaxserve" / "xla")
