"""ModelRunner: ``SchedulerOutput`` -> padded arrays -> one jitted model step -> sampled tokens.

The only ``jax.jit`` sites of the engine live here: the model step (one compile per token
bucket, KV cache donated so it is updated in place), the sampler (one compile per sequence
bucket and sampler variant) and prompt logprobs. Shapes are padded to powers of two:
T tokens in ``token_buckets``, S = min(T, max sequences) sequence rows, so the number of
compiled model shapes is ``len(token_buckets)``; warm-up compiles them all at start-up, with
JAX's persistent compilation cache so a second start is fast.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxserve.config import ModelConfig
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.request import PENDING_TOKEN, Sequence
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.models import llama
from jaxserve.models.batch import Batch, make_kv_cache
from jaxserve.models.weights import dummy_weights, load_weights
from jaxserve.runner import sampling
from jaxserve.runner.capacity import Capacity, detect_device_memory, plan_capacity
from jaxserve.runner.distributed import broadcast_ints, broadcast_step_inputs
from jaxserve.runner.input_builder import (
    NUM_TOP_LOGPROBS,
    InputBuilder,
    next_power_of_2,
    token_buckets_for,
)
from jaxserve.runner.sampling import SamplerFlags, SamplerOutput, SamplingInputs
from jaxserve.runner.sharding import prepare_tp

_LOG = logging.getLogger(__name__)


def resolve_dtype(config: EngineConfig) -> jnp.dtype:
    """``auto``: bfloat16 on accelerators, float32 on the CPU (exact parity in tests)."""
    if config.dtype != "auto":
        return jnp.dtype(config.dtype)
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def enable_compilation_cache(cache_dir: str) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its device outputs, not yet read back."""

    out: SamplerOutput
    prompt_out: tuple[jax.Array, ...] | None
    spans: dict[str, tuple[int, int]]  # seq_id -> (offset, count) of its prompt logprob rows
    sampled_row: dict[str, int]  # seq_id -> its row in out.token_ids, one per scheduled seq


@dataclasses.dataclass
class RunnerOutput:
    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray | None = None  # f32[S]
    ranks: np.ndarray | None = None  # i32[S]
    top_ids: np.ndarray | None = None  # i32[S, K]
    top_logprobs: np.ndarray | None = None  # f32[S, K]
    # seq_id -> (logprob[n], rank[n], top_ids[n, K], top_lp[n, K]) for the chunk's next tokens
    prompt_logprobs: dict[str, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)


def _model_step(weights, kv_cache, batch, *, config, attention_fn=None):
    return llama.forward(weights, kv_cache, batch, config, attention_fn)


def shared_attention(attention_fn: Any) -> Any:
    """``attention_fn`` under one ``jax.jit``, so every layer's call shares one lowering.

    Lowering a Mosaic GPU kernel takes about a second of Python; called bare, each of the 32
    layers of an 8B model lowers (and embeds) its own copy in every bucket. Behind one jit the
    layers' calls have the same traced function and JAX lowers it once per bucket.
    """
    return jax.jit(attention_fn, static_argnames=("sm_scale", "sliding_window", "soft_cap"))


def _sample_step(head, hidden, logits_indices, inputs, *, tied, flags, num_rows):
    weights = llama.Weights(
        embed=head if tied else None, layers=[], final_norm=None, lm_head=None if tied else head
    )
    logits = llama.compute_logits(weights, hidden[logits_indices])  # f32[S, V]
    out = sampling.sample(logits, inputs, flags)
    # Token ids padded to the largest sequence bucket: the next step's on-device feed of
    # pending tokens then has one shape per token bucket, all compiled at warm-up.
    padding = num_rows - out.token_ids.shape[0]
    return dataclasses.replace(out, token_ids=jnp.pad(out.token_ids, (0, padding)))


def _feed_pending(input_ids, source, previous_ids):
    """Input ids with each pending token (source >= 0) taken from the previous step's samples."""
    taken = previous_ids[jnp.clip(source, 0, previous_ids.shape[0] - 1)]
    return jnp.where(source >= 0, taken, input_ids)


def _prompt_logprobs_step(head, hidden, next_ids, *, tied):
    weights = llama.Weights(
        embed=head if tied else None, layers=[], final_norm=None, lm_head=None if tied else head
    )
    return sampling.prompt_logprobs(
        llama.compute_logits(weights, hidden), next_ids, NUM_TOP_LOGPROBS
    )


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int) -> None:
        self.model_config = model_config
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.pages_per_seq = -(-max_model_len // config.block_size)
        self.token_buckets = token_buckets_for(config.max_num_batched_tokens)
        self.max_seq_bucket = next_power_of_2(config.max_num_seqs)
        enable_compilation_cache(config.cache_dir)

        self.dtype = resolve_dtype(config)
        # Tensor parallelism: shardings from sharding.py; TP=1 keeps the plain program.
        self.tp = (
            prepare_tp(model_config, config.tensor_parallel_size)
            if config.tensor_parallel_size > 1
            else None
        )
        placement = self.tp.placement if self.tp is not None else None
        start = time.perf_counter()
        if config.load_format == "dummy":
            self.weights = dummy_weights(
                model_config, self.dtype, seed=config.seed, placement=placement
            )
        else:
            self.weights = load_weights(
                config.model_dir, model_config, self.dtype, placement=placement
            )
        jax.block_until_ready(self.weights)
        self.load_seconds = time.perf_counter() - start
        self.tied = self.weights.lm_head is None
        self.head = self.weights.embed if self.tied else self.weights.lm_head

        self.capacity = self._plan_capacity()
        self.num_blocks = self.capacity.num_blocks
        self.num_slots = self.num_blocks * self.block_size
        # NOTE: with warm-up on, the cache is allocated after the step buckets are compiled,
        # so XLA's autotuner compiles with the memory the cache will take still free.
        self.kv_cache: Any = None
        if not config.warmup:
            self.allocate_kv_cache()
        if self.tp is not None:
            in_shardings, out_shardings = self.tp.step_shardings()
            self._step_fn = jax.jit(
                functools.partial(
                    _model_step,
                    config=model_config,
                    attention_fn=shared_attention(self.tp.attention_fn),
                ),
                in_shardings=in_shardings,
                out_shardings=out_shardings,
                donate_argnames=("kv_cache",),
            )
        else:
            self._step_fn = jax.jit(
                functools.partial(
                    _model_step,
                    config=model_config,
                    attention_fn=shared_attention(pallas_kernels.ragged_paged_attention),
                ),
                donate_argnames=("kv_cache",),
            )
        self._compiled_steps: dict[int, Any] = {}  # token bucket -> ahead-of-time executable
        self._sample_fn = jax.jit(
            functools.partial(_sample_step, num_rows=self.max_seq_bucket),
            static_argnames=("tied", "flags"),
        )
        self._prompt_lp_fn = jax.jit(_prompt_logprobs_step, static_argnames=("tied",))
        self._feed_fn = jax.jit(_feed_pending)
        self.compile_seconds = 0.0
        # Several processes (hosts) share this model: process 0 broadcasts each step.
        self.multihost = jax.process_count() > 1
        self.inputs = InputBuilder(
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            num_slots=self.num_slots,
            vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: tuple[int, ...]) -> None:
        self.inputs.eos_token_ids = value

    def seq_bucket(self, token_bucket: int) -> int:
        return self.inputs.seq_bucket(token_bucket)

    def release(self, seq: Sequence) -> None:
        self.inputs.release(seq)

    # -- memory ----------------------------------------------------------------------------

    def device_memory_bytes(self) -> int:
        """The memory the KV budget is a fraction of (``device_memory_bytes`` overrides)."""
        if self.config.device_memory_bytes is not None:
            return self.config.device_memory_bytes
        return detect_device_memory()

    def _plan_capacity(self) -> Capacity:
        return plan_capacity(
            self.model_config,
            max_model_len=self.max_model_len,
            device_memory_bytes=self.device_memory_bytes(),
            memory_utilization=self.config.gpu_memory_utilization,
            dtype_bytes=self.dtype.itemsize,
            block_size=self.block_size,
            tensor_parallel_size=self.config.tensor_parallel_size,
            max_num_batched_tokens=self.token_buckets[-1],
            max_num_seqs=self.max_seq_bucket,
            num_blocks_override=self.config.num_gpu_blocks_override,
        )

    def kv_cache_shape(self) -> tuple[int, int, int, int]:
        c = self.model_config
        return (self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

    def allocate_kv_cache(self) -> None:
        if self.kv_cache is not None:
            return
        if self.tp is not None:
            self.kv_cache = self.tp.make_kv_cache(self.num_blocks, self.block_size, self.dtype)
        else:
            self.kv_cache = make_kv_cache(
                self.model_config.num_layers,
                *self.kv_cache_shape()[:2],
                self.model_config.num_kv_heads,
                self.model_config.head_dim,
                self.dtype,
            )

    def _abstract_kv_cache(self) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """The cache's shapes (and shardings) only: enough to compile against."""
        shardings = (
            self.tp.kv_cache_shardings(self.model_config.num_layers)
            if self.tp is not None
            else [(None, None)] * self.model_config.num_layers
        )
        shape = self.kv_cache_shape()
        return [
            (
                jax.ShapeDtypeStruct(shape, self.dtype, sharding=k),
                jax.ShapeDtypeStruct(shape, self.dtype, sharding=v),
            )
            for k, v in shardings
        ]

    def _precision(self) -> contextlib.AbstractContextManager:
        """float32 means float32: on GPUs XLA would otherwise multiply f32 in TF32."""
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def warmup(self, max_workers: int = 8) -> int:
        """Compile every token bucket ahead of time, in parallel threads (XLA compiles release
        the GIL), then allocate the KV cache and run each bucket once with the two plain
        sampler variants (greedy, random); returns the number of model shapes compiled. Other
        sampler variants (top-k/p, penalties, logprobs) are small and compile on first use."""
        with self._precision():
            return self._warmup(max_workers)

    def _warmup(self, max_workers: int) -> int:
        start = time.perf_counter()
        kv_cache = self.kv_cache if self.kv_cache is not None else self._abstract_kv_cache()
        total = len(self.token_buckets)
        _LOG.info(
            "Compiling the model step for %d token buckets: %s",
            total,
            ", ".join(map(str, self.token_buckets)),
        )
        workers = max(1, min(max_workers, total, os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            # Lowering holds the GIL, compiling does not: each bucket's compile starts as soon
            # as it is lowered, while the next one lowers.
            futures = {}
            for bucket in self.token_buckets:
                lowered = self._step_fn.lower(self.weights, kv_cache, self._empty_batch(bucket))
                futures[pool.submit(lowered.compile)] = bucket
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                bucket = futures[future]
                self._compiled_steps[bucket] = future.result()
                _LOG.info(
                    "Compiled model step for %d tokens (%d/%d) at %.1f s",
                    bucket,
                    done,
                    total,
                    time.perf_counter() - start,
                )
        self.allocate_kv_cache()
        for bucket in self.token_buckets:
            batch = self._empty_batch(bucket)
            self.kv_cache, hidden = self._run_step(batch)
            s_pad = self.seq_bucket(bucket)
            rows = np.full(s_pad, self.inputs.pad_row, np.int32)
            for flags in (SamplerFlags(all_greedy=True), SamplerFlags()):
                inputs = self.inputs.sampling_inputs([], rows, np.zeros(s_pad, np.int32), flags)
                out = self._sample_fn(
                    self.head, hidden, batch.logits_indices, inputs, tied=self.tied, flags=flags
                )
                jax.block_until_ready(out.token_ids)
            source = np.full(bucket, -1, np.int32)
            jax.block_until_ready(self._feed_fn(batch.input_ids, source, out.token_ids))
        self.compile_seconds = time.perf_counter() - start
        return len(self.token_buckets)

    def _run_step(self, batch: Batch) -> tuple[Any, jax.Array]:
        step = self._compiled_steps.get(batch.input_ids.shape[0])
        if step is None:
            return self._step_fn(self.weights, self.kv_cache, batch)
        return step(self.weights, self.kv_cache, batch)

    def _empty_batch(self, num_tokens: int) -> Batch:
        num_seqs = self.seq_bucket(num_tokens)
        return Batch(
            input_ids=jnp.zeros(num_tokens, jnp.int32),
            positions=jnp.zeros(num_tokens, jnp.int32),
            slot_mapping=jnp.full(num_tokens, self.num_slots, jnp.int32),
            kv_lens=jnp.zeros(num_seqs, jnp.int32),
            page_indices=jnp.zeros((num_seqs, self.pages_per_seq), jnp.int32),
            cu_q_lens=jnp.zeros(num_seqs + 1, jnp.int32),
            num_seqs=jnp.zeros(1, jnp.int32),
            logits_indices=jnp.zeros(num_seqs, jnp.int32),
        )

    # -- one step --------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """One step, start to finish: dispatch, then wait for the sampled tokens."""
        return self.collect(self.dispatch(output))

    def dispatch(self, output: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        """Queue one step on the device and return without waiting for it.

        A sequence may decode a token that ``previous`` (the step dispatched just before, not
        yet collected) is still sampling: its input id is ``PENDING_TOKEN`` on the host and
        is read from ``previous``'s sampled ids on the device.
        """
        host_batch, rows = self.inputs.build_batch(output)
        seqs = [item.seq for item in output.scheduled]
        flags = self.inputs.sampler_flags(rows, host_batch.kv_lens)
        inputs = self.inputs.sampling_inputs(seqs, rows, host_batch.kv_lens, flags)
        next_ids, spans = self._prompt_logprob_targets(output, host_batch)
        if self.multihost:  # followers join the same step with process 0's inputs
            broadcast_ints(_encode_header(host_batch, inputs, flags, next_ids), HEADER_SIZE)
            host_batch, inputs, next_ids = broadcast_step_inputs((host_batch, inputs, next_ids))
        feed = self._pending_feed(output, host_batch, previous)
        out, prompt_out = self._device_step(host_batch, inputs, flags, next_ids, feed)
        sampled_row = {item.seq.seq_id: i for i, item in enumerate(output.scheduled)}
        return InFlight(out, prompt_out, spans, sampled_row)

    def collect(self, step: InFlight) -> RunnerOutput:
        """Wait for a dispatched step and copy its sampled tokens (and logprobs) to the host."""
        out, num = step.out, len(step.sampled_row)
        result = RunnerOutput(token_ids=np.asarray(out.token_ids)[:num])
        if out.logprobs is not None:
            result.logprobs = np.asarray(out.logprobs)[:num]
            result.ranks = np.asarray(out.ranks)[:num]
            result.top_ids = np.asarray(out.top_ids)[:num]
            result.top_logprobs = np.asarray(out.top_logprobs)[:num]
        if step.prompt_out is not None:
            lp, ranks, top_ids, top_lp = (np.asarray(a) for a in step.prompt_out)
            result.prompt_logprobs = {
                sid: (lp[o : o + n], ranks[o : o + n], top_ids[o : o + n], top_lp[o : o + n])
                for sid, (o, n) in step.spans.items()
            }
        return result

    def _pending_feed(
        self, output: SchedulerOutput, host_batch: Batch, previous: InFlight | None
    ) -> tuple[np.ndarray, jax.Array] | None:
        """(source row in ``previous``'s sampled ids, or -1, per token; those ids) or None."""
        pending = np.flatnonzero(host_batch.input_ids == PENDING_TOKEN)
        if pending.size == 0:
            return None
        if previous is None:
            raise RuntimeError("a pending input token without the step that samples it")
        owners = np.searchsorted(host_batch.cu_q_lens, pending, side="right") - 1
        source = np.full(host_batch.input_ids.shape[0], -1, np.int32)
        source[pending] = [previous.sampled_row[output.scheduled[i].seq.seq_id] for i in owners]
        return source, previous.out.token_ids

    def _device_step(
        self,
        host_batch: Batch,
        inputs: SamplingInputs,
        flags: SamplerFlags,
        next_ids: np.ndarray | None,
        feed: tuple[np.ndarray, jax.Array] | None = None,
    ) -> tuple[SamplerOutput, tuple[jax.Array, ...] | None]:
        """Model step, sampler and (when asked) prompt logprobs on the device."""
        if self.tp is not None:
            batch, inputs = self.tp.put_replicated((host_batch, inputs))
        else:
            batch, inputs = jax.device_put((host_batch, inputs))
        with self._precision():  # also keys the jit caches: warm-up runs under it too
            if feed is not None:
                source, previous_ids = feed
                batch = dataclasses.replace(
                    batch, input_ids=self._feed_fn(batch.input_ids, source, previous_ids)
                )
            self.kv_cache, hidden = self._run_step(batch)
            out = self._sample_fn(
                self.head, hidden, batch.logits_indices, inputs, tied=self.tied, flags=flags
            )
            prompt_out = None
            if next_ids is not None:
                prompt_out = self._prompt_lp_fn(self.head, hidden, next_ids, tied=self.tied)
        return out, prompt_out

    def _prompt_logprob_targets(
        self, output: SchedulerOutput, host_batch: Batch
    ) -> tuple[np.ndarray | None, dict[str, tuple[int, int]]]:
        """The next prompt token of every row that needs a prompt logprob, and each
        sequence's (offset, count) among the rows; None when no sequence asked."""
        wanted = [
            (i, item)
            for i, item in enumerate(output.scheduled)
            if item.seq.params.prompt_logprobs is not None
            and item.seq.index == 0  # samples of one request share the prompt
            and item.start < item.seq.num_prompt_tokens - 1
        ]
        if not wanted:
            return None, {}
        next_ids = np.zeros(host_batch.input_ids.shape[0], np.int32)
        spans = {}
        for i, item in wanted:
            seq = item.seq
            offset = int(host_batch.cu_q_lens[i])
            # Row for position p scores prompt token p + 1 (prompt tokens only).
            stop = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            n = stop - item.start
            next_ids[offset : offset + n] = seq.prompt_token_ids[item.start + 1 : stop + 1]
            spans[seq.seq_id] = (offset, n)
        return next_ids, spans

    # -- multi-host ------------------------------------------------------------------------

    def follow(self) -> None:
        """On processes other than 0: join every step process 0 runs, until it stops."""
        while True:
            header = broadcast_ints(None, HEADER_SIZE)
            if header[0] == 0:
                return
            host_batch, inputs, flags, next_ids = _placeholders(header, self)
            host_batch, inputs, next_ids = broadcast_step_inputs((host_batch, inputs, next_ids))
            self._device_step(host_batch, inputs, flags, next_ids)

    def stop_followers(self) -> None:
        if self.multihost:
            broadcast_ints([0] * HEADER_SIZE, HEADER_SIZE)
            self.multihost = False


# The step header process 0 broadcasts: the shapes and sampler variant of the next step.
HEADER_SIZE = 8


def _encode_header(
    batch: Batch, inputs: SamplingInputs, flags: SamplerFlags, next_ids: np.ndarray | None
) -> list[int]:
    return [
        batch.input_ids.shape[0],
        inputs.bias_ids.shape[1],
        inputs.output_ids.shape[1],
        inputs.prompt_ids.shape[1],
        flags.num_logprobs,
        int(flags.use_sort) | int(flags.use_penalties) << 1 | int(flags.use_bias) << 2,
        int(flags.all_greedy),
        int(next_ids is not None),
    ]


def _placeholders(
    header: tuple[int, ...], runner: ModelRunner
) -> tuple[Batch, SamplingInputs, SamplerFlags, np.ndarray | None]:
    """Arrays of the shapes process 0 announced (their values arrive by broadcast)."""
    t_pad, num_bias, out_len, prompt_len, num_logprobs, bits, all_greedy, has_lp = header
    s_pad = runner.seq_bucket(t_pad)
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    batch = Batch(
        input_ids=zeros(t_pad),
        positions=zeros(t_pad),
        slot_mapping=zeros(t_pad),
        kv_lens=zeros(s_pad),
        page_indices=zeros(s_pad, runner.pages_per_seq),
        cu_q_lens=zeros(s_pad + 1),
        num_seqs=zeros(1),
        logits_indices=zeros(s_pad),
    )
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    inputs = SamplingInputs(
        temperature=f32(s_pad),
        top_k=zeros(s_pad),
        top_p=f32(s_pad),
        min_p=f32(s_pad),
        seeds=np.zeros(s_pad, np.uint32),
        positions=zeros(s_pad),
        bias_ids=zeros(s_pad, num_bias),
        bias_values=f32(s_pad, num_bias),
        presence_penalty=f32(s_pad),
        frequency_penalty=f32(s_pad),
        repetition_penalty=f32(s_pad),
        output_ids=zeros(s_pad, out_len),
        prompt_ids=zeros(s_pad, prompt_len),
    )
    flags = SamplerFlags(
        use_sort=bool(bits & 1),
        use_penalties=bool(bits & 2),
        use_bias=bool(bits & 4),
        num_logprobs=num_logprobs,
        all_greedy=bool(all_greedy),
    )
    return batch, inputs, flags, zeros(t_pad) if has_lp else None
