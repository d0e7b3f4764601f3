"""EncoderRunner: the pooling runner of an encoder (BERT, XLM-RoBERTa): whole prompts in, one
pooled row (and a cross-encoder's logits) per prompt out; no KV cache, no sampler.

The engine hands it a ``SchedulerOutput`` as it hands ``ModelRunner`` one (``--runner pooling``):
every scheduled sequence is a whole prompt (the engine schedules encoders without chunking, and
``max_num_batched_tokens >= max_model_len`` is checked at start), with its token type ids
(``StepSequence.token_type_ids``: the tokenizer's, 1 on the second text of a pair). The step's
sequences are concatenated into ``models/encoder/forward.EncoderBatch``, padded to a token bucket
(powers of two, as the decoder's) and its sequence bucket, and one jitted program per bucket runs
the encoder and ``encoder_step_outputs``: per sequence the sum of its hidden states, its first
token's and its last token's in f32 (``RunnerOutput.pooled``, the meaning ``programs.pool_step``
gives it for a decoder) and, for a sequence classifier, its logits (``RunnerOutput.classified``).

There is no KV cache, since a prompt never outlives its step. The scheduler still counts blocks:
``num_blocks`` is a host-side count that covers two steps of the token budget (the step on the
device and the one scheduled behind it), with no device memory behind it, so blocks never limit
an encoder; the capacity lines say so, and the concurrency the token budget allows.

Attention (``encoder_attention`` says which; the start-up log too):

- ``packed`` (the default on Hopper and later, bf16 or fp16): ``packed_segment_attention``,
  cuDNN's fused attention over packed sequences (its THD layout: each sequence's start and
  length), so the work is the sum of each sequence's length squared, with no mask in memory.
  On an H100 (2026-12-05) its GPU tests passed and it took 2.5 ms of a 26.7 ms BGE-large step.
- ``cudnn`` (older GPUs): ``windowed_segment_attention`` on cuDNN, each query tile of
  the flat batch looking at its own tile and the two beside it (a sequence no longer than the
  tile lies within them), the segments as its mask: T times three tiles of scores, not T
  squared. On the H200 (2026-12-05) this was 10.4 ms of a 34 ms BGE-large step of 256-token
  texts, three 512-token tiles a query tile where its own sequence's 256 keys would do.
- ``xla``: the same windows through the jnp reference (off the GPU, and for f32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine_config import EngineConfig
from jaxserve.models.encoder import heads
from jaxserve.models.encoder.config import EncoderConfig
from jaxserve.models.encoder.forward import EncoderBatch, forward, segment_ids
from jaxserve.models.encoder.weights import (
    EncoderWeights,
    dummy_encoder_weights,
    load_encoder_weights,
)
from jaxserve.runner import warmup
from jaxserve.runner.buckets import Buckets, next_power_of_2
from jaxserve.runner.capacity import Capacity, GiB
from jaxserve.runner.devices import quiet_backend_probe, resolve_dtype
from jaxserve.runner.in_flight import InFlight
from jaxserve.runner.programs import compiler_options
from jaxserve.runner.segment_attention import (
    packed_segment_attention,
    segment_attention_form,
    windowed_segment_attention,
)
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from pallas_kernels.env_choice import env_choice
from pallas_kernels.layer_norm import dispatch as norm_dispatch
from pallas_kernels.swiglu_matmul import dispatch as mlp_dispatch

_LOG = logging.getLogger(__name__)


ENCODER_ATTENTION_ENV = "JAXSERVE_ENCODER_ATTENTION"


ATTENTION_NAMES = {
    "packed": "cuDNN fused attention over packed sequences",
    "cudnn": "cuDNN fused attention over windows of the flat batch",
    "xla": "XLA (jnp reference, windows of the flat batch)",
}


def encoder_attention(dtype: Any) -> tuple[str, str]:
    """``("packed" | "cudnn" | "xla", why)``: how the encoder's attention runs in this process
    for activations of ``dtype`` (``JAXSERVE_ENCODER_ATTENTION``: auto, the default, packed,
    cudnn or xla)."""
    choice = env_choice(ENCODER_ATTENTION_ENV, ("auto", *ATTENTION_NAMES), "auto")
    if choice != "auto":
        return choice, f"{ENCODER_ATTENTION_ENV}={choice}"
    form, not_packed = segment_attention_form(dtype)
    return form, not_packed or f"{ENCODER_ATTENTION_ENV}=auto"


def encoder_step_outputs(
    hidden: jax.Array,  # [T, H]
    cu_seq_lens: jax.Array,  # i32[S + 1]
) -> jax.Array:  # f32[S, 3, H]
    """Per sequence: the sum of its hidden states, its first token's, its last token's (what
    ``programs.pool_step`` returns of a decoder's chunk; padding rows are garbage)."""
    num_seqs = cu_seq_lens.shape[0] - 1
    hidden = hidden.astype(jnp.float32)
    segments = segment_ids(cu_seq_lens, hidden.shape[0])
    sums = jax.ops.segment_sum(hidden, segments, num_segments=num_seqs + 1)[:num_seqs]
    first = hidden[heads.first_token_rows(cu_seq_lens, hidden.shape[0])]
    last = hidden[jnp.clip(cu_seq_lens[1:] - 1, 0, hidden.shape[0] - 1)]
    return jnp.stack([sums, first, last], axis=1)


def encoder_step(
    weights: EncoderWeights,
    batch: EncoderBatch,
    *,
    config: EncoderConfig,
    tile: int,
    attention_impl: str = "xla",
) -> tuple[jax.Array, jax.Array | None]:
    """The encoder over one step's whole sequences: (pooled f32[S, 3, H], a classifier's
    logits f32[S, L] or None)."""
    if attention_impl == "packed":
        # Padding rows stay as cuDNN left them: nothing mixes rows, and the outputs read only
        # their sequences' rows (the sums drop the padding's segment), so zeroing them was a
        # pass over every layer's attention output for nothing.
        attention = functools.partial(
            packed_segment_attention, cu_seq_lens=batch.cu_seq_lens, zero_padding=False
        )
    else:
        attention = functools.partial(
            windowed_segment_attention, tile=tile, implementation=attention_impl
        )
    hidden = forward(weights, batch, config, attention)
    pooled = encoder_step_outputs(hidden, batch.cu_seq_lens)
    logits = None
    if weights.head is not None:
        logits = heads.classify(weights.head, hidden, batch.cu_seq_lens)
    return pooled, logits


@dataclasses.dataclass(frozen=True)
class EncoderCapacity(Capacity):
    """An encoder's capacity: no KV cache; the token budget bounds what runs at once."""

    max_num_batched_tokens: int = 0

    def lines(self) -> list[str]:
        concurrency = self.max_num_batched_tokens / max(self.max_model_len, 1)
        return [
            f"Model weights take {self.weight_bytes / GiB:.2f} GiB; no KV cache (an encoder "
            "runs each prompt whole in one step)",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x (--max-num-batched-tokens {self.max_num_batched_tokens:,} "
            "per step)",
        ]


class EncoderRunner:
    """The ``Runner`` of an encoder (``engine/interfaces.py``); see the module docstring."""

    def __init__(self, encoder_config: EncoderConfig, config: EngineConfig) -> None:
        quiet_backend_probe()
        self.model_config = encoder_config
        self.config = config
        self.max_model_len = config.max_model_len or encoder_config.max_seq_len
        self.buckets = Buckets.of(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.resolved_max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
        )
        self.tile = next_power_of_2(self.max_model_len)
        warmup.enable_compilation_cache(config.cache_dir)
        self.dtype = resolve_dtype(config)
        self.multihost = False
        self.is_sleeping = False
        # Host-side blocks for the scheduler's count (two steps' worth): no device memory.
        blocks = -(-config.max_num_batched_tokens // config.block_size)
        per_step = blocks + config.resolved_max_num_seqs
        self.num_blocks = 2 * per_step
        start = time.perf_counter()
        self.weights = self._load(config.model_dir, config.load_format)
        self.load_seconds = time.perf_counter() - start
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.weights))
        self.capacity: Capacity = EncoderCapacity(
            device_memory_bytes=0,
            memory_utilization=config.gpu_memory_utilization,
            weight_bytes=weight_bytes,
            activation_bytes=0,
            kv_budget_bytes=0,
            kv_bytes_per_token=0,
            block_size=config.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        _LOG.info(
            "Encoder %s (%d layers, hidden %d%s), %s, max_model_len %d; weights in %.1f s",
            encoder_config.model_type,
            encoder_config.num_layers,
            encoder_config.hidden_size,
            f", {encoder_config.num_labels} label(s)" if encoder_config.has_classifier else "",
            jnp.dtype(self.dtype).name,
            self.max_model_len,
            self.load_seconds,
        )
        self.step_fn = self._jitted_step(encoder_config)
        self.compiled: dict[int, Any] = {}
        self.compile_seconds = 0.0
        self.ready_tokens = self.buckets.token_buckets[-1]

    def _jitted_step(self, encoder_config: EncoderConfig) -> Any:
        """``encoder_step`` jitted, its attention as ``encoder_attention`` says (logged)."""
        implementation, why = encoder_attention(self.dtype)
        _LOG.info("Encoder attention: %s (%s)", ATTENTION_NAMES[implementation], why)
        gelu = mlp_dispatch.GELU_ENV
        if encoder_config.hidden_act == "gelu" and mlp_dispatch.requested(gelu) != "off":
            _LOG.info("%s", mlp_dispatch.describe(gelu))
        if norm_dispatch.requested() != "off":
            _LOG.info("%s", norm_dispatch.describe())
        step = functools.partial(
            encoder_step, config=encoder_config, tile=self.tile, attention_impl=implementation
        )
        options = compiler_options(False, pooling=True, encoder=True)
        return jax.jit(step, compiler_options=options)

    def _load(self, model_dir: Path, load_format: str) -> EncoderWeights:
        if load_format == "dummy":
            return dummy_encoder_weights(self.model_config, self.dtype, seed=self.config.seed)
        return load_encoder_weights(model_dir, self.model_config, self.dtype)

    def _precision(self) -> Any:
        """float32 means float32 (no TF32 on GPUs), as ``StepPrograms.precision``."""
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    # -- warm-up ---------------------------------------------------------------------------

    def padding_batch(self, num_tokens: int) -> EncoderBatch:
        return EncoderBatch.from_sequences(
            [[0]], num_tokens=num_tokens, num_seqs=self.buckets.seq_bucket(num_tokens)
        )

    def warmup(self) -> int:
        """Compile the program of every token bucket, then run the smallest once (on a GPU
        each bucket once: a program's first run costs about 0.2 s there, ``warmup``'s module
        docstring)."""
        start = time.perf_counter()
        with self._precision():
            for bucket in self.buckets.token_buckets:
                lowered = self.step_fn.lower(self.weights, self.padding_batch(bucket))
                self.compiled[bucket] = lowered.compile()
            buckets = self.buckets.token_buckets
            for bucket in buckets if warmup.runs_every_bucket() else buckets[:1]:
                batch = self.padding_batch(bucket)
                jax.block_until_ready(self.compiled[bucket](self.weights, batch))
        self.compile_seconds = time.perf_counter() - start
        _LOG.info(
            "Compiled %d encoder step shapes in %.1f s", len(self.compiled), self.compile_seconds
        )
        return len(self.compiled)

    # -- one step --------------------------------------------------------------------------

    def build_batch(self, output: SchedulerOutput) -> EncoderBatch:
        """The step's whole sequences as one padded flat batch (host arrays)."""
        token_ids, types = [], []
        for item in output.scheduled:
            seq = item.seq
            if item.start != 0 or item.num_new_tokens != seq.num_prompt_tokens:
                raise RuntimeError(
                    f"sequence {seq.seq_id!r}: an encoder runs whole prompts, got tokens "
                    f"{item.start}..{item.start + item.num_new_tokens} of {seq.num_prompt_tokens}"
                )
            token_ids.append(seq.prompt_token_ids)
            given = seq.token_type_ids
            types.append(list(given) if given is not None else [0] * seq.num_prompt_tokens)
        num_tokens = self.buckets.token_bucket(output.num_batched_tokens)
        return EncoderBatch.from_sequences(
            token_ids, types, num_tokens=num_tokens, num_seqs=self.buckets.seq_bucket(num_tokens)
        )

    def dispatch(self, output: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        batch = self.build_batch(output)
        program = self.compiled.get(batch.num_tokens, self.step_fn)
        with self._precision():
            pooled, logits = program(self.weights, jax.device_put(batch))
        rows = {item.seq.seq_id: i for i, item in enumerate(output.scheduled)}
        return InFlight(None, None, {}, rows, pooled=pooled, classified=logits)

    def sample(self, step: InFlight, token_mask: np.ndarray | None) -> None:
        """Nothing to sample."""

    def collect(self, step: InFlight) -> RunnerOutput:
        return step.read_back()

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(output))

    def shift_states(self, seq_id: str, delta: int) -> None:
        """Nothing: an encoder keeps no states for a drafter (it never generates)."""

    # -- weights, sleep, shutdown ------------------------------------------------------------

    def update_weights(self, weights: Any, layout: str = "auto") -> None:
        """New weights laid out as ``self.weights`` (every leaf of the same shape)."""
        if layout not in ("auto", "engine"):
            raise ValueError(f"layout={layout!r}: an encoder takes its own pytree layout only")
        old = jax.tree.structure(self.weights)
        if jax.tree.structure(weights) != old:  # type: ignore[operator]
            raise ValueError("the weights' tree differs from the encoder's (EncoderWeights)")
        for new, now in zip(jax.tree.leaves(weights), jax.tree.leaves(self.weights), strict=True):
            if tuple(new.shape) != tuple(now.shape):
                raise ValueError(f"a leaf has shape {tuple(new.shape)}, expected {now.shape}")
        self.weights = jax.tree.map(lambda x: jnp.asarray(x, self.dtype), weights)

    def load_weights_from(self, model_dir: str | Path) -> float:
        start = time.perf_counter()
        self.weights = load_encoder_weights(Path(model_dir), self.model_config, self.dtype)
        return time.perf_counter() - start

    def sleep(self, level: int) -> None:
        raise RuntimeError("sleep mode is not served for encoder models")

    def wake_up(self, tags: tuple[str, ...]) -> None:
        raise RuntimeError("sleep mode is not served for encoder models")

    def shutdown(self) -> None:
        """Nothing runs in the background."""
