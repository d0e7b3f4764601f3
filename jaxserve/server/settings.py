"""ServerSettings: the HTTP side's knobs, frozen and validated (the engine's are in EngineConfig).

Built by ``launch/flags.py`` from the command line (or by tests directly) and read by ``app.py``.
"""

from __future__ import annotations

import dataclasses

from jaxserve.lora_request import LoRARequest
from jaxserve.server.chat.reasoning import REASONING_PARSERS
from jaxserve.server.chat.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_HEADER_COUNT = 100
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
DEFAULT_SEND_TIMEOUT_S = 30.0
# Per-request cost limits (cost.py has the reasoning behind each default).
DEFAULT_MAX_SEQS_PER_REQUEST = 256
DEFAULT_MAX_TOKENS_PER_REQUEST = 2**20
DEFAULT_MAX_RESPONSE_ENTRIES = 2**20
# Responses kept for GET /v1/responses/{id} and previous_response_id (responses/store.py).
DEFAULT_MAX_STORED_RESPONSES = 1000
# --metrics-prefix: the names /metrics uses (metrics.py).
METRICS_PREFIXES = ("both", "vllm", "jaxserve")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]  # the first is the metrics label
    api_key: str | None = None
    metrics_require_key: bool = False
    # The names /metrics uses: "both" (vllm: and jaxserve:), "vllm" or "jaxserve" (metrics.py).
    metrics_prefix: str = "both"
    enable_log_requests: bool = False
    log_prompts: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # names + values, all headers
    shutdown_timeout_s: float = 30.0
    log_stats: bool = True  # the periodic stats line, every stats_log_interval_s
    stats_log_interval_s: float = 10.0
    watchdog_interval_s: float = 0.5
    # The whole body must arrive within this many seconds of the headers (else 408).
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    # A response write blocked this long by a client that stopped reading ends the response.
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    rate_limit_rpm: int | None = None  # requests per minute per client; None: unlimited
    rate_limit_tpm: int | None = None  # prompt + n * max_tokens per minute per client
    # Sequences one request may start: prompts x n (x best_of when larger).
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    # Tokens one request may ask for: n (or best_of) x max_tokens, summed over its prompts.
    max_tokens_per_request: int = DEFAULT_MAX_TOKENS_PER_REQUEST
    # Tokens and logprobs one response may hold (each token 1, plus 1 per top logprob).
    max_response_entries: int = DEFAULT_MAX_RESPONSE_ENTRIES
    # Tool calling (vLLM's flags): the model's tool-call format, parsed when tool_choice is
    # "auto", which needs enable_auto_tool_choice. Required and named choices need neither.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Splits <think>...</think> into reasoning_content; None: the output is all content.
    reasoning_parser: str | None = None
    # Responses kept in memory (store: true); past it the least recently used is dropped.
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    # POST /update_weights_from_disk: a client may load other weights from the server's disk.
    enable_weight_updates: bool = False
    # LoRA adapters served by name (--lora-modules; docs/lora.md), each a LoRARequest.
    lora_modules: tuple[LoRARequest, ...] = ()

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError(f"served_model_names={self.served_model_names!r} must be non-empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None (no auth) or a non-empty string")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(
                f"metrics_prefix={self.metrics_prefix!r} must be one of "
                f"{', '.join(METRICS_PREFIXES)}"
            )
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes={self.max_request_body_bytes} must be at least 1024"
            )
        if self.max_header_count < 8:
            raise ValueError(f"max_header_count={self.max_header_count} must be at least 8")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes={self.max_header_bytes} must be at least 1024")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s} must be >= 0")
        if self.stats_log_interval_s <= 0:
            raise ValueError(f"stats_log_interval_s={self.stats_log_interval_s} must be > 0")
        if self.watchdog_interval_s <= 0:
            raise ValueError(f"watchdog_interval_s={self.watchdog_interval_s} must be > 0")
        if self.request_body_timeout_s <= 0:
            raise ValueError(f"request_body_timeout_s={self.request_body_timeout_s} must be > 0")
        if self.send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s={self.send_timeout_s} must be > 0")
        for name in (
            "max_seqs_per_request",
            "max_tokens_per_request",
            "max_response_entries",
            "max_stored_responses",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("rate_limit_rpm", "rate_limit_tpm"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name}={value!r} must be None (no limit) or an integer >= 1")

        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser={self.tool_call_parser!r} must be one of "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice requires tool_call_parser (the model's tool-call "
                f"format: {', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser={self.reasoning_parser!r} must be one of "
                f"{', '.join(REASONING_PARSERS)}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def public_paths(self) -> frozenset[str]:
        """Paths served without the API key; everything else is guarded."""
        if self.metrics_require_key:
            return frozenset({"/health"})
        return frozenset({"/health", "/metrics"})
