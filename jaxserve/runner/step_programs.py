"""StepPrograms: the engine's compiled programs, their lowering, and the calls that run them.

The programs are the bodies in ``programs.py``, jitted here (the only jit sites): the model step
(the KV cache donated, so it is updated in place) and the logits and prompt logprobs, one
program per token bucket; the sampler, one per sequence bucket and variant. Warm-up
(``warmup.py``) lowers each one (``lower_step``, ``lower``) against arguments laid out as at
run time and puts the executables in the tables here; a call (``run_step``, ``sample``,
``prompt_logprobs``) runs the executable of its shape, or the jitted program where none was
compiled (warm-up off). ``ready_tokens`` says up to which bucket every program is compiled, and
``background`` is the compile warm-up leaves running while the engine serves.

What it takes comes from the runner: the model config, the shape buckets, the weights (their
shapes until they have loaded: ``set_weights``), the KV cache's shapes, the tensor-parallel
layout; the padding steps it lowers against come from ``InputBuilder``. It holds no KV cache:
``run_step`` takes the runner's and returns the updated one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.batch import Batch
from jaxserve.models.decoder import WholePromptAttention
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.input_builder import InputBuilder
from jaxserve.runner.lora_slots import LoraSlots
from jaxserve.runner.packing import Layout, pack, write_rows
from jaxserve.runner.parallel.sharding import TensorParallel
from jaxserve.runner.programs import (
    Forward,
    StepSamples,
    flat_drafts,
    holds_fp8,
    jitted_head_programs,
    jitted_model_step,
    pool_step,
)
from jaxserve.runner.sampling import TOKEN_MASK_LEAF, SamplerFlags, SamplingInputs
from jaxserve.runner.step import DeviceDrafts
from jaxserve.runner.verify_ahead import META_ROWS, advance_step, shift_rows
from jaxserve.runner.weight_update import committed

# The warm-up's lines, under one name: users filter them as one story.
_LOG = logging.getLogger("jaxserve.runner.warmup")

BACKGROUND_SLOTS = 4  # compiles at a time once the KV cache is allocated
BACKGROUND_RETRIES = 3  # compiles alone after running out of device memory

# The programs of a token bucket besides its model step (``StepPrograms.uncompiled``' kinds):
# a generating runner's, and a pooling runner's (``--runner pooling``: no logits, no sampler).
PROGRAMS = ("logits", "prompt_logprobs", "samplers")
POOLING_PROGRAMS = ("pooling",)

KVCacheShapes = list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]

# A verify step scheduled before the last was read back, moved on the device (``verify_ahead``):
# its model inputs, and its sampler's positions.
_advance = jax.jit(advance_step, static_argnames=("layout", "k", "page_size"))
_shift_rows = jax.jit(shift_rows, static_argnames=("layout", "leaf"))
POSITIONS_LEAF = [f.name for f in dataclasses.fields(SamplingInputs)].index("positions")


@dataclasses.dataclass
class Advance:
    """What a verify step scheduled before the last one was read back needs to be corrected on
    the device (``verify_ahead.advance_step``), and its result."""

    sampled: jax.Array  # i32[S_max]  the last step's sampled ids
    drafts: jax.Array  # i32[S_max]  the drafts it verified (its drafts' feed)
    meta: np.ndarray  # i32[META_ROWS, S_pad]  per sequence of this step
    k: int  # drafts a sequence verifies at most
    shift: jax.Array | None = None  # i32[S_max]  each sequence's, once ``run_step`` ran


def pack_step(
    batch: Batch, source: np.ndarray | None = None, lora_slots: np.ndarray | None = None
) -> tuple[np.ndarray, Layout]:
    """A step's host inputs packed for the model step: the batch, and for each token the row
    of the previous step's sampled ids it reads (-1: its own input id); with LoRA on, each
    token's adapter slot (i32[T], 0: none) too."""
    if source is None:
        source = np.full(batch.num_tokens, -1, np.int32)
    if lora_slots is None:
        return pack((batch, source))
    return pack((batch, source, lora_slots))


@dataclasses.dataclass
class BackgroundCompile:
    """The buckets warm-up leaves to compile while the engine serves (``serve_while_compiling``).

    NOTE: XLA's autotuner times candidate kernels on buffers of each program's shapes. Once
    the KV cache is allocated only the activation headroom is left (1.3 GiB on the H200 for
    Llama-3-8B). Measured there: model steps of up to 256 tokens compiled beside it, sixteen
    at a time; a sampler with a new number of rows did not, even alone, while it held the
    matmul by the head (timed on a 1 GiB copy of it): that matmul is now a program of its own
    (``programs.logits_step``), compiled before the cache (``warm_up``).
    Four compile at a time here, and one that runs out of memory compiles again alone."""

    thread: threading.Thread | None = None
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    slots: threading.Semaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(BACKGROUND_SLOTS)
    )
    _alone: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def compile(self, lowered: Any) -> Any:
        """``lowered.compile()`` in one of the slots; out of device memory, again alone (every
        slot held), up to ``BACKGROUND_RETRIES`` times a second apart."""
        for attempt in range(BACKGROUND_RETRIES + 1):
            if self.stopping.is_set():  # before waiting for a slot: queued ones end at once
                raise concurrent.futures.CancelledError("the runner shut down")
            if attempt:
                time.sleep(1.0)
            with self._alone if attempt else contextlib.nullcontext():
                held = BACKGROUND_SLOTS if attempt else 1
                for _ in range(held):
                    self.slots.acquire()
                try:
                    if self.stopping.is_set():
                        raise concurrent.futures.CancelledError("the runner shut down")
                    return lowered.compile()
                except jax.errors.JaxRuntimeError as exc:
                    if "RESOURCE_EXHAUSTED" not in str(exc) or attempt == BACKGROUND_RETRIES:
                        raise
                    _LOG.info("Out of device memory compiling a program; again, alone")
                finally:
                    for _ in range(held):
                        self.slots.release()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """End what has not started at once (``compile`` raises ``CancelledError`` once
        stopping) and wait for what has (a compile thread still running at the interpreter's
        exit can crash it).

        NOTE: not ``shutdown(cancel_futures=True)``: a future cancelled in the pool's queue
        never tells ``concurrent.futures.as_completed`` (only a worker taking it up does), so
        the compile thread waiting there for the model steps waited forever, and so did the
        server after SIGTERM whenever more steps were queued than the pool had workers."""
        self.stopping.set()
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        if self.thread is not None:
            self.thread.join()


class StepPrograms:
    def __init__(
        self,
        model_config: ModelConfig,
        buckets: Buckets,
        inputs: InputBuilder,  # the padding steps the programs are lowered against
        *,
        weights: Any,  # layers.Weights, or their jax.ShapeDtypeStruct until they have loaded
        kv_cache_shapes: KVCacheShapes,  # (K, V) pages per layer, with their shardings
        dtype: Any,  # the activations' (jnp.float32, jnp.bfloat16, ...)
        tp: TensorParallel | None = None,  # None: one device, the plain programs
        kv_scales: tuple[tuple[float, float], ...] | None = None,  # an fp8 cache's, per layer
        batch_invariant: bool = False,  # each row's result independent of its step
        pooling: bool = False,  # a pooling runner's programs: model step and pooling only
        lora: LoraSlots | None = None,  # the adapter slots (--enable-lora), read at each step
        whole_prompts: WholePromptAttention | None = None,  # a pooling step's, without cache
    ) -> None:
        self.model_config = model_config
        self.kinds = POOLING_PROGRAMS if pooling else PROGRAMS
        self.lora = lora
        self.buckets = buckets
        self.inputs = inputs
        self.kv_cache_shapes = kv_cache_shapes
        self.dtype = dtype
        self.tp = tp
        # LoRA under tensor parallelism: the stacks go in positionally, with their shardings.
        self.lora_positional = tp is not None and lora is not None
        lora_shardings = lora.shardings if self.lora_positional and lora is not None else None
        self._step_args = (model_config, kv_scales, tp, batch_invariant)
        self._step_kwargs: dict[str, Any] = dict(
            lora_shardings=lora_shardings,
            fp8_weights=holds_fp8(weights),  # its XLA options
        )
        self.step_fn = jitted_model_step(
            *self._step_args, **self._step_kwargs, whole_prompts=whole_prompts
        )
        self.logits_fn, self.sample_fn, self.prompt_lp_fn = jitted_head_programs(
            model_config, buckets.max_seq_bucket, tp, batch_invariant
        )
        # Ahead-of-time executables from warm-up: model step, logits and prompt logprobs per
        # token bucket, sampler per (sequence bucket, variant).
        self.compiled_steps: dict[int, Any] = {}
        self.compiled_logits: dict[int, Any] = {}
        self.compiled_prompt_lp: dict[int, Any] = {}
        self.compiled_samplers: dict[tuple[int, SamplerFlags], Any] = {}
        self.pool_fn = jax.jit(pool_step, static_argnames=("layout",))
        self.compiled_pool: dict[int, Any] = {}
        self.compile_seconds = 0.0  # warm-up's, until the engine serves
        # Steps of up to this many tokens have every program compiled (warm-up lowers it, then
        # raises it as the larger buckets compile in ``background``).
        self.ready_tokens = buckets.token_buckets[-1]
        self.background = BackgroundCompile()
        # The sampled ids a step reads its pending tokens from when no step came before it.
        # committed, as the sampled ids that take its place are (programs of committed weights)
        self.no_previous_ids = committed(self.put(np.zeros(buckets.max_seq_bucket, np.int32)))
        # Drafts left on the device, laid out as a step reads them (``draft_feed``)
        feed = functools.partial(flat_drafts, size=buckets.max_seq_bucket)
        self._draft_feed = jax.jit(feed, out_shardings=self.no_previous_ids.sharding)
        self.set_weights(weights)

    def return_aux_states(self, aux_layers: tuple[int, ...]) -> None:
        """From now on the model step also returns the states entering ``aux_layers``
        (``Forward.aux``: an EAGLE-3 drafter reads them); before warm-up compiles."""
        if self.compiled_steps:
            raise RuntimeError("return_aux_states after the model steps compiled")
        self.step_fn = jitted_model_step(
            *self._step_args, **self._step_kwargs, aux_layers=tuple(aux_layers)
        )

    def set_weights(self, weights: Any) -> None:
        """The weights the programs run on (or are lowered against, as shapes)."""
        self.weights = weights
        self.tied = weights.lm_head is None
        self.head = weights.embed if self.tied else weights.lm_head

    def put(self, tree: Any) -> Any:
        """Host step inputs on the device(s), laid out as every compiled program expects."""
        return self.tp.put_replicated(tree) if self.tp is not None else jax.device_put(tree)

    def feeds_drafts(self, drafts: DeviceDrafts) -> bool:
        """Whether a step can take these drafts on the device: their sequences' rows of W
        fit the ids a step reads its pending tokens from (S_max of them)."""
        return len(drafts.rows) * drafts.ids.shape[1] <= self.no_previous_ids.shape[0]

    def warm_draft_feed(self, shapes: list[tuple[int, int]]) -> int:
        """Compile ``draft_feed`` for each shape of a drafter's drafts; returns how many."""
        for shape in shapes:
            self._draft_feed(committed(self.put(np.zeros(shape, np.int32))))
        return len(shapes)

    def warm_verify_ahead(self, max_tokens: int, k: int) -> int:
        """Compile the corrections of a verify step scheduled ahead (``verify_ahead``) for the
        token buckets of up to ``max_tokens`` (a drafting step's most: the sequences that draft
        and their drafts), and the sampler rows' shift for every sampler variant of their
        sequence buckets; returns how many programs."""
        with self.precision():  # (it keys the jit caches: the calls run under it)
            return self._warm_verify_ahead(max_tokens, k)

    def _warm_verify_ahead(self, max_tokens: int, k: int) -> int:
        ids, leaf = self.no_previous_ids, POSITIONS_LEAF
        count, warmed = 0, set()
        for bucket in self.buckets.token_buckets:
            if bucket > self.buckets.token_bucket(max_tokens):
                break
            packed, layout = self._padding_packed(bucket)
            rows = self.buckets.seq_bucket(bucket)
            meta = self.put(np.zeros((META_ROWS, rows), np.int32))
            _advance(
                self.put(packed),
                ids,
                ids,
                meta,
                layout=layout,
                k=k,
                page_size=self.inputs.block_size,
            )
            count += 1
            for flags in self.inputs.sampler_variants:
                if (rows, flags) in warmed:
                    continue
                warmed.add((rows, flags))
                packed, layout = pack(self.inputs.padding_step(bucket, flags)[1])
                row_seq = self.put(np.full(rows, -1, np.int32))
                _shift_rows(self.put(packed), row_seq, ids, layout=layout, leaf=leaf)
                count += 1
        return count

    def draft_feed(self, ids: jax.Array) -> jax.Array:
        """The drafts (i32[S, W], on the device) as a step's pending tokens' ids: i32[S_max],
        row s's draft j at s * W + j (``InputBuilder.draft_sources``)."""
        return self._draft_feed(ids)

    def precision(self) -> contextlib.AbstractContextManager:
        """float32 means float32: on GPUs XLA would otherwise multiply f32 in TF32 (also keys
        the jit caches: every program is lowered and run under it)."""
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    # -- running ---------------------------------------------------------------------------

    def run_step(
        self,
        kv_cache: Any,  # donated: use the one returned
        batch: Batch,  # host arrays
        source: np.ndarray | None = None,  # i32[T]  see ``pack_step``
        previous_ids: jax.Array | None = None,  # i32[S_max]  the previous step's sampled ids
        lora_slots: np.ndarray | None = None,  # i32[T]  each token's adapter slot (LoRA on)
        advance: Advance | None = None,  # a verify step scheduled ahead (``verify_ahead``)
    ) -> tuple[Any, Forward]:
        """(kv_cache, the step's output) of one model step; with ``advance``, its inputs are
        corrected on the device first, and ``advance.shift`` is set."""
        if self.lora is not None and lora_slots is None:
            lora_slots = np.zeros(batch.num_tokens, np.int32)
        packed, layout = pack_step(batch, source, lora_slots)
        buffer = self.put(packed)
        if advance is not None:
            buffer, advance.shift = _advance(
                buffer,
                advance.sampled,
                advance.drafts,
                self.put(advance.meta),
                layout=layout,
                k=advance.k,
                page_size=self.inputs.block_size,
            )
        args = (buffer, self.no_previous_ids if previous_ids is None else previous_ids)
        extra = self._lora_args()
        lora = self._lora_positional_args()
        step = self.compiled_steps.get(batch.num_tokens)
        if step is None:
            out = self.step_fn(self.weights, kv_cache, *args, layout, *lora, **extra)
        else:
            out = step(self.weights, kv_cache, *args, *lora, **extra)
        kv_cache, hidden, *aux = out  # aux: [T, A * H] with ``return_aux_states``
        return kv_cache, Forward(hidden, args[0], layout, aux[0] if aux else None)

    def _lora_args(self) -> dict[str, Any]:
        """The model step's adapter stacks, as they are now (none without LoRA), by keyword
        on one device."""
        if self.lora is None or self.lora_positional:
            return {}
        return {"lora_weights": self.lora.weights}

    def _lora_positional_args(self) -> tuple[Any, ...]:
        """The stacks as the step's sixth argument, under tensor parallelism."""
        return (self.lora.weights,) if self.lora is not None and self.lora_positional else ()

    def sample(
        self,
        forward: Forward,
        inputs: SamplingInputs,
        flags: SamplerFlags,
        token_mask: np.ndarray | None = None,  # i32[<= S, W]  with ``flags.use_mask``
        shifted: tuple[np.ndarray, jax.Array] | None = None,  # (row -> sequence, shift)
    ) -> StepSamples:
        """The logits of the step's last rows, then the sampler variant ``flags``; the leading
        rows of ``inputs.token_mask`` are ``token_mask``'s where one is given (copied once,
        into the packed inputs). ``shifted``: each row's sequence (i32[R], -1: none) and each
        sequence's shift on the device (``verify_ahead``), added to the rows' positions."""
        num_tokens = forward.hidden.shape[0]
        logits_fn = self.compiled_logits.get(num_tokens)
        if logits_fn is None:
            logits_fn = functools.partial(self.logits_fn, layout=forward.layout, tied=self.tied)
        logits = logits_fn(self.head, forward.hidden, forward.packed)
        packed, layout = pack(inputs)
        if token_mask is not None:
            write_rows(packed, layout, TOKEN_MASK_LEAF, token_mask)
        buffer = self.put(packed)
        if shifted is not None:
            row_seq, shift = shifted
            buffer = _shift_rows(
                buffer, self.put(row_seq), shift, layout=layout, leaf=POSITIONS_LEAF
            )
        compiled = self.compiled_samplers.get((self.buckets.seq_bucket(num_tokens), flags))
        if compiled is None:
            return self.sample_fn(logits, buffer, layout=layout, flags=flags)
        return compiled(logits, buffer)

    def pool(self, forward: Forward) -> jax.Array:
        """f32[S, 3, H]: per sequence of the step, the sum of its hidden states, its first
        token's and its last token's (``programs.pool_step``)."""
        compiled = self.compiled_pool.get(forward.hidden.shape[0])
        if compiled is None:
            return self.pool_fn(forward.hidden, forward.packed, layout=forward.layout)
        return compiled(forward.hidden, forward.packed)

    def prompt_logprobs(self, hidden: jax.Array, next_ids: Any) -> tuple[jax.Array, ...]:
        compiled = self.compiled_prompt_lp.get(hidden.shape[0])
        if compiled is None:
            return self.prompt_lp_fn(self.head, hidden, next_ids, tied=self.tied)
        return compiled(self.head, hidden, next_ids)

    # -- lowering --------------------------------------------------------------------------

    def lower_step(self, num_tokens: int, kv_cache: Any = None) -> Any:
        """The model step of a token bucket, lowered (not yet compiled); ``kv_cache``: the
        cache's shapes by default."""
        packed, layout = self._padding_packed(num_tokens)
        kv_cache = self.kv_cache_shapes if kv_cache is None else kv_cache
        return self.step_fn.lower(
            self.weights,
            kv_cache,
            packed,
            self.no_previous_ids,
            layout,
            *self._lora_positional_args(),
            **self._lora_args(),
        )

    def _padding_packed(self, num_tokens: int) -> tuple[np.ndarray, Layout]:
        """A padding step's model inputs, packed as ``run_step`` packs a step's."""
        lora_slots = None if self.lora is None else np.zeros(num_tokens, np.int32)
        return pack_step(self.inputs.padding_step(num_tokens)[0], None, lora_slots)

    def uncompiled(
        self, buckets: list[int], kinds: tuple[str, ...] | None = None
    ) -> Iterator[tuple[str, dict, Any, int]]:
        """(kind, its table, its key, its token bucket) of each program of ``kinds`` that
        ``buckets`` need and no table holds yet: the logits and the prompt logprobs per token
        bucket, the sampler variants per sequence bucket (several token buckets share one)."""
        kinds = self.kinds if kinds is None else tuple(k for k in kinds if k in self.kinds)
        queued: set[Any] = set()
        for bucket in buckets:
            rows = self.buckets.seq_bucket(bucket)
            wanted: list[tuple[str, dict, Any]] = []
            if "pooling" in kinds:
                wanted.append(("pooling", self.compiled_pool, bucket))
            if "logits" in kinds:
                wanted.append(("logits", self.compiled_logits, bucket))
            if "prompt_logprobs" in kinds:
                wanted.append(("prompt_logprobs", self.compiled_prompt_lp, bucket))
            if "samplers" in kinds:
                for flags in self.inputs.sampler_variants:
                    wanted.append(("samplers", self.compiled_samplers, (rows, flags)))
            for kind, table, key in wanted:
                if key not in table and (kind, key) not in queued:
                    queued.add((kind, key))
                    yield kind, table, key, bucket

    def lower(self, kind: str, key: Any, specs: dict[int, jax.ShapeDtypeStruct]) -> Any:
        """The program ``kind`` of ``key`` (a token bucket, or a sampler's (sequence bucket,
        variant)), lowered against arguments laid out as at run time; ``specs``: the samplers'
        logits found so far, by number of rows."""
        if kind == "samplers":
            rows, flags = key
            _, inputs = self.inputs.padding_step(rows, flags)
            packed, layout = pack(inputs)
            if rows not in specs:
                specs[rows] = self._logits_spec(rows)
            return self.sample_fn.lower(specs[rows], self.put(packed), layout=layout, flags=flags)
        hidden = self.put(np.zeros((key, self.model_config.hidden_size), self.dtype))
        if kind == "pooling":
            packed, layout = pack_step(self.inputs.padding_step(key)[0])
            return self.pool_fn.lower(hidden, self.put(packed), layout=layout)
        if kind == "logits":
            packed, layout = self._padding_packed(key)
            return self.logits_fn.lower(self.head, hidden, self.put(packed), layout, tied=self.tied)
        next_ids = self.put(np.zeros(key, np.int32))
        return self.prompt_lp_fn.lower(self.head, hidden, next_ids, tied=self.tied)

    def _logits_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        """The logits a sampler of ``rows`` rows takes, as the logits program returns them
        (replicated; not made: 128 MiB at 256 rows of a 128k vocabulary)."""
        hidden = self.put(np.zeros((rows, self.model_config.hidden_size), self.dtype))
        packed, layout = self._padding_packed(rows)
        # The jitted function's own eval_shape: under jax.eval_shape it would be a nested jit,
        # which may not carry compiler options (batch-invariant mode's).
        shape = self.logits_fn.eval_shape(
            self.head, hidden, self.put(packed), layout=layout, tied=self.tied
        )
        sharding = self.tp.replicated if self.tp is not None else hidden.sharding
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
