"""The default sequences per step (``--max-num-seqs``): per device, sized from the KV cache.

vLLM sets its batch defaults per device (``EngineArgs.get_batch_defaults``): 1,024 sequences a
step on GPUs of 70 GiB or more other than A100s, 256 elsewhere. jaxserve takes the same
ceiling and, below it, as many sequences as the KV cache holds at ``min(max_model_len, 2,048)``
tokens each, never fewer than 256 (the fixed default of earlier releases) and never more than
the step's token budget (a decode step takes one token of it per sequence)::

    max_num_seqs = min(ceiling, max_num_batched_tokens,
                       max(256, KV tokens // min(max_model_len, 2048)))

Why: at full load a step's weights are read once for all its sequences, so the batch is where
throughput comes from, and a fixed 256 left most of a large card's cache idle (Llama-3-8B at
1000 prompts x 1,000 in / 1,000 out on one H200: the cache holds 437 sequences of 2,048 tokens
in bf16 and 926 with an fp8 cache). Counting whole sequences of up to 2,048 tokens, rather than
admitting 1,024 whatever their length, keeps a long-context load from preempting half its
batch; a card whose cache holds few sequences keeps 256 rather than compiling and reserving
sampler rows for 1,024. The token budget (``--max-num-batched-tokens``, 2,048) is left as it
is: each larger prefill bucket is one more program to compile at start-up.

An explicit ``max_num_seqs`` is always kept. The start-up log names the value and its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.engine_config import BASE_MAX_NUM_SEQS, EngineConfig
from jaxserve.runner.buckets import next_power_of_2

_LOG = logging.getLogger(__name__)

LARGE_GPU_MAX_NUM_SEQS = 1024  # vLLM's default on GPUs of LARGE_GPU_BYTES or more (not A100)
LARGE_GPU_BYTES = 70 * 1024**3
SEQUENCE_TOKENS = 2048  # the length a sequence is counted at (or max_model_len, if shorter)


def ceiling_for(platform: str, device_kind: str, memory_bytes: int) -> int:
    """vLLM's per-device ``max_num_seqs``: 1,024 on GPUs of at least 70 GiB other than A100s
    (H100, H200, B200, MI300X, ...), 256 on the others, on TPUs and on the CPU."""
    large = memory_bytes >= LARGE_GPU_BYTES and "A100" not in device_kind.upper()
    return LARGE_GPU_MAX_NUM_SEQS if platform == "gpu" and large else BASE_MAX_NUM_SEQS


@dataclasses.dataclass(frozen=True)
class BatchSize:
    """The chosen ``max_num_seqs`` and what it came from, for the start-up log."""

    max_num_seqs: int
    ceiling: int  # the device's (ceiling_for)
    kv_sequences: int | None  # sequences of sequence_tokens the KV cache holds; None: not sized
    sequence_tokens: int
    max_num_batched_tokens: int

    @property
    def reason(self) -> str:
        if self.max_num_seqs == self.max_num_batched_tokens < self.ceiling:
            return f"the token budget, --max-num-batched-tokens {self.max_num_batched_tokens:,}"
        if self.kv_sequences is None or self.max_num_seqs == self.ceiling:
            return f"this device's ceiling, {self.ceiling:,} (vLLM's default for it)"
        if self.max_num_seqs == BASE_MAX_NUM_SEQS:
            return (
                f"at least {BASE_MAX_NUM_SEQS}; the KV cache holds "
                f"{self.kv_sequences:,} sequences of {self.sequence_tokens:,} tokens"
            )
        return (
            f"the KV cache holds {self.kv_sequences:,} sequences of {self.sequence_tokens:,} "
            f"tokens; this device's ceiling is {self.ceiling:,}"
        )

    def line(self) -> str:
        return (
            f"Sequences per step: --max-num-seqs {self.max_num_seqs:,} by default ({self.reason}; "
            "set --max-num-seqs to choose)"
        )


def default_batch_size(
    *,
    ceiling: int,
    kv_tokens: int | None,  # the KV cache's tokens planned with ``ceiling`` rows; None: unsized
    max_model_len: int,
    max_num_batched_tokens: int,
) -> BatchSize:
    """The rule of the module docstring, as a ``BatchSize``."""
    sequence_tokens = max(1, min(max_model_len, SEQUENCE_TOKENS))
    kv_sequences = None if kv_tokens is None else kv_tokens // sequence_tokens
    seqs = ceiling
    if kv_sequences is not None:
        seqs = min(ceiling, max(min(BASE_MAX_NUM_SEQS, ceiling), kv_sequences))
    seqs = max(1, min(seqs, max_num_batched_tokens))
    return BatchSize(seqs, ceiling, kv_sequences, sequence_tokens, max_num_batched_tokens)


def planned_batch_size(
    kv_tokens_with: Callable[[int], int | None],
    *,
    ceiling: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> BatchSize:
    """``default_batch_size`` from a plan: ``kv_tokens_with(n)`` is the KV cache's tokens with
    ``n`` sequences a step (their sampler rows come out of the same memory). Planned first with
    the ceiling's rows, then again with the count that gives, which frees the rows it does not
    take; the second count stands when it needs no more sampler rows than the first."""
    size = functools.partial(
        default_batch_size,
        ceiling=ceiling,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    first = size(kv_tokens=kv_tokens_with(ceiling))
    if first.kv_sequences is None or first.max_num_seqs == ceiling:
        return first
    second = size(kv_tokens=kv_tokens_with(first.max_num_seqs))
    rows = next_power_of_2(first.max_num_seqs)
    return second if next_power_of_2(second.max_num_seqs) <= rows else first


def resolve_batch_size(
    config: EngineConfig, model_config: ModelConfig | None, max_model_len: int
) -> EngineConfig:
    """``config`` with ``max_num_seqs`` set: its own, or the default for the first device and
    this model's KV cache (``model_config`` None: an encoder, which has no cache to size from:
    the device's ceiling). Starts the backend: call where the runner would."""
    if config.max_num_seqs is not None:
        return config
    from jaxserve.runner.capacity import reserve_device_memory

    reserve_device_memory(config.gpu_memory_utilization)  # before the backend starts
    import jax

    device = jax.devices()[0]
    memory = config.device_memory_bytes or _device_memory()
    ceiling = ceiling_for(device.platform, device.device_kind, memory)

    def kv_tokens_with(max_num_seqs: int) -> int | None:
        if model_config is None:
            return None
        return _kv_tokens(dataclasses.replace(config, max_num_seqs=max_num_seqs), model_config)

    size = planned_batch_size(
        kv_tokens_with,
        ceiling=ceiling,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    _LOG.info(size.line())
    return dataclasses.replace(config, max_num_seqs=size.max_num_seqs)


def _device_memory() -> int:
    from jaxserve.runner.capacity import detect_device_memory

    return detect_device_memory()


def _kv_tokens(config: EngineConfig, model_config: ModelConfig) -> int | None:
    """The KV cache's tokens with ``config``'s settings, or None where the plan fails (the
    runner raises the plan's own error a moment later)."""
    from jaxserve.models.kv_scales import kv_dtype_label
    from jaxserve.runner.capacity import CapacityError, engine_capacity
    from jaxserve.runner.devices import resolve_dtype, resolve_kv_dtype, resolve_quantization

    dtype: Any = resolve_dtype(config)
    kv_dtype = resolve_kv_dtype(config, dtype)
    try:
        capacity = engine_capacity(
            model_config,
            config,
            dtype,
            resolve_quantization(config),
            kv_dtype_label(kv_dtype),
            kv_dtype,
        )
    except CapacityError:
        return None
    return capacity.num_tokens
