"""ModelRunner: ``SchedulerOutput`` -> padded arrays -> one jitted model step -> sampled tokens.

The engine's programs are jitted here (``programs.py`` builds them): the model step, the logits
and prompt logprobs (one program per token bucket; the KV cache is donated so it is updated in
place) and the sampler (one per sequence bucket and variant). Each step's inputs travel packed,
one host-to-device copy per program (``packing.py``). Shapes are padded to powers of two: T
tokens in ``token_buckets``, S = min(T, max sequences) sequence rows. Warm-up (``warmup.py``)
compiles every program at start-up, with JAX's persistent compilation cache so a second start
is fast; no request compiles anything."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.batch import Batch, kv_page_shapes, make_kv_cache_for
from jaxserve.models.kv_scales import kv_dtype_label
from jaxserve.runner import bucket_compile, step_broadcast
from jaxserve.runner.capacity import Capacity, engine_capacity, reserve_device_memory
from jaxserve.runner.devices import (
    quiet_backend_probe,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_quantization,
    startup_lines,
    uses_compact_samplers,
)
from jaxserve.runner.in_flight import DeferredSampler, InFlight
from jaxserve.runner.input_builder import InputBuilder, next_power_of_2, token_buckets_for
from jaxserve.runner.model_weights import kv_cache_scales, start_loading
from jaxserve.runner.packing import Layout, pack
from jaxserve.runner.programs import (
    Forward,
    StepSamples,
    jitted_head_programs,
    jitted_model_step,
)
from jaxserve.runner.sampling import SamplerFlags, SamplingInputs
from jaxserve.runner.sharding import prepare_tp
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from jaxserve.runner.warmup import enable_compilation_cache, warm_up

_LOG = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """``eos_token_ids``: every id that ends a sequence (held back until ``min_tokens``)."""
        quiet_backend_probe()  # both before the backend starts
        reserve_device_memory(config.gpu_memory_utilization)
        self.model_config = model_config
        self.config = config
        self.max_model_len = max_model_len = config.resolved_max_model_len(model_config)
        self.block_size = config.block_size
        self.pages_per_seq = -(-max_model_len // config.block_size)
        self.token_buckets = token_buckets_for(config.max_num_batched_tokens)
        self.max_seq_bucket = next_power_of_2(config.max_num_seqs)
        enable_compilation_cache(config.cache_dir)

        self.dtype = resolve_dtype(config)
        self.quant = resolve_quantization(config)  # None: unquantized
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)  # raises where fp8 cannot run
        for line in startup_lines(
            model_config, config, self.dtype, max_model_len, self.quant, self.kv_dtype
        ):
            _LOG.info(line)
        # Tensor parallelism: shardings from sharding.py; TP=1 keeps the plain program.
        self.tp = None
        if config.tensor_parallel_size > 1:
            ep = config.enable_expert_parallel
            self.tp = prepare_tp(
                model_config, config.tensor_parallel_size, quant=self.quant, expert_parallel=ep
            )
        self.kv_scales = kv_cache_scales(model_config, config, self.kv_dtype)
        # NOTE: the capacity plan needs the weights' size, not the weights: a model that does
        # not fit ends the start here, before a weight is made (made on a thread of their own,
        # they held the process after its error, the interpreter's exit waiting for them).
        self.capacity = self._plan_capacity()
        self.num_blocks = self.capacity.num_blocks
        self.num_slots = self.num_blocks * self.block_size
        # With warm-up on, the weights load while the programs compile against their shapes.
        stop = threading.Event()  # set: the load ends at its next tensor
        try:
            self.loading = start_loading(
                model_config, config, self.dtype, self.quant, self.tp, stop
            )
            self._finish_init(eos_token_ids)
        except BaseException:  # an error or a Ctrl-C (even inside start_loading): the load ends
            stop.set()
            raise

    def _finish_init(self, eos_token_ids: tuple[int, ...]) -> None:
        """The rest of ``__init__``, once the weights have begun to load."""
        model_config, config, max_model_len = self.model_config, self.config, self.max_model_len
        self.load_seconds = 0.0
        if self.loading.shapes is None:
            self.wait_for_weights()
        else:  # shapes only, until wait_for_weights
            self._set_weights(self.loading.shapes)
        # NOTE: with warm-up on, the cache is allocated after the step buckets are compiled,
        # so XLA's autotuner compiles with the memory the cache will take still free.
        self.kv_cache: Any = None
        if not config.warmup:
            self.allocate_kv_cache()
        self.step_fn = jitted_model_step(model_config, self.kv_scales, self.tp)
        # Ahead-of-time executables from warm-up: model step, logits and prompt logprobs per
        # token bucket, sampler per (sequence bucket, variant).
        self.compiled_steps: dict[int, Any] = {}
        self.compiled_logits: dict[int, Any] = {}
        self.compiled_prompt_lp: dict[int, Any] = {}
        self.compiled_samplers: dict[tuple[int, SamplerFlags], Any] = {}
        self.logits_fn, self.sample_fn, self.prompt_lp_fn = jitted_head_programs(
            model_config, self.max_seq_bucket, self.tp
        )
        # The sampled ids a step reads its pending tokens from when no step came before it.
        self.no_previous_ids = self.put(np.zeros(self.max_seq_bucket, np.int32))
        self.compile_seconds = 0.0
        # Steps of up to this many tokens have every program compiled (warm-up lowers it, then
        # raises it as the larger buckets compile in ``background``).
        self.ready_tokens = self.token_buckets[-1]
        self.background = bucket_compile.BackgroundCompile()
        # Several processes (hosts) share this model: process 0 broadcasts each step.
        self.multihost = jax.process_count() > 1
        self.inputs = InputBuilder(
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            num_slots=self.num_slots,
            vocab_size=model_config.vocab_size,
            eos_token_ids=eos_token_ids,
            compact_samplers=uses_compact_samplers(config),
        )

    # -- memory ----------------------------------------------------------------------------

    def _plan_capacity(self) -> Capacity:
        kv_dtype = kv_dtype_label(self.kv_dtype)
        return engine_capacity(self.model_config, self.config, self.dtype, self.quant, kv_dtype)

    def wait_for_weights(self) -> None:
        """The loaded weights in place of the shapes warm-up compiled against."""
        weights, self.load_seconds = self.loading.wait()
        self._set_weights(weights)

    def _set_weights(self, weights: Any) -> None:
        self.weights = weights
        self.tied = weights.lm_head is None
        self.head = weights.embed if self.tied else weights.lm_head

    def allocate_kv_cache(self) -> None:
        if self.kv_cache is not None:
            return
        if self.tp is not None:
            self.kv_cache = self.tp.make_kv_cache(self.num_blocks, self.block_size, self.kv_dtype)
        else:
            self.kv_cache = make_kv_cache_for(
                self.model_config, self.num_blocks, self.block_size, self.kv_dtype
            )

    def abstract_kv_cache(self) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """The cache's shapes (and shardings) only: enough to compile against."""
        n = self.model_config.num_layers
        shardings = self.tp.kv_cache_shardings(n) if self.tp is not None else [(None, None)] * n
        k_shape, v_shape = kv_page_shapes(self.model_config, self.num_blocks, self.block_size)
        abstract = functools.partial(jax.ShapeDtypeStruct, dtype=self.kv_dtype)
        return [
            (abstract(k_shape, sharding=k), abstract(v_shape, sharding=v)) for k, v in shardings
        ]

    def precision(self) -> contextlib.AbstractContextManager:
        """float32 means float32: on GPUs XLA would otherwise multiply f32 in TF32."""
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def warmup(self, max_workers: int = 8) -> int:
        """Compile every shape bucket ahead of time (see ``warmup.py``), then allocate the KV
        cache; returns the number of model shapes compiled."""
        with self.precision():
            return warm_up(self, max_workers)

    def step_inputs(
        self, batch: Batch, source: np.ndarray | None = None
    ) -> tuple[np.ndarray, Layout]:
        """A step's host inputs packed for the model step: the batch, and for each token the
        row of the previous step's sampled ids it reads (-1: its own input id)."""
        if source is None:
            source = np.full(batch.num_tokens, -1, np.int32)
        return pack((batch, source))

    def lower_step(self, num_tokens: int, kv_cache: Any = None) -> Any:
        """The model step of a token bucket, lowered (not yet compiled); ``kv_cache``: the
        runner's own cache by default, or its abstract shapes."""
        packed, layout = self.step_inputs(self.inputs.padding_step(num_tokens)[0])
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        return self.step_fn.lower(self.weights, kv_cache, packed, self.no_previous_ids, layout)

    def run_step(
        self,
        batch: Batch,  # host arrays
        source: np.ndarray | None = None,  # i32[T]  see ``step_inputs``
        previous_ids: jax.Array | None = None,  # i32[S_max]  the previous step's sampled ids
    ) -> tuple[Any, Forward]:
        """(kv_cache, the step's output) of one model step."""
        packed, layout = self.step_inputs(batch, source)
        args = (self.put(packed), self.no_previous_ids if previous_ids is None else previous_ids)
        step = self.compiled_steps.get(batch.num_tokens)
        if step is None:
            kv_cache, hidden = self.step_fn(self.weights, self.kv_cache, *args, layout)
        else:
            kv_cache, hidden = step(self.weights, self.kv_cache, *args)
        return kv_cache, Forward(hidden, args[0], layout)

    def sample(self, forward: Forward, inputs: SamplingInputs, flags: SamplerFlags) -> StepSamples:
        """The logits of the step's last rows, then the sampler variant ``flags``."""
        num_tokens = forward.hidden.shape[0]
        logits_fn = self.compiled_logits.get(num_tokens)
        if logits_fn is None:
            logits_fn = functools.partial(self.logits_fn, layout=forward.layout, tied=self.tied)
        logits = logits_fn(self.head, forward.hidden, forward.packed)
        packed, layout = pack(inputs)
        compiled = self.compiled_samplers.get((self.inputs.seq_bucket(num_tokens), flags))
        if compiled is None:
            return self.sample_fn(logits, self.put(packed), layout=layout, flags=flags)
        return compiled(logits, self.put(packed))

    def prompt_logprobs(self, hidden: jax.Array, next_ids: Any) -> tuple[jax.Array, ...]:
        compiled = self.compiled_prompt_lp.get(hidden.shape[0])
        if compiled is None:
            return self.prompt_lp_fn(self.head, hidden, next_ids, tied=self.tied)
        return compiled(self.head, hidden, next_ids)

    def put(self, tree: Any) -> Any:
        """Host step inputs on the device(s), laid out as every compiled program expects."""
        return self.tp.put_replicated(tree) if self.tp is not None else jax.device_put(tree)

    # -- one step --------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """One step, start to finish: dispatch, then wait for the sampled tokens."""
        return self.collect(self.dispatch(output))

    def dispatch(
        self,
        output: SchedulerOutput,
        previous: InFlight | None = None,
        defer_sampling: bool = False,
    ) -> InFlight:
        """Queue one step on the device and return without waiting for it.

        A sequence may decode a token that ``previous`` (the step dispatched just before, not
        yet collected) is still sampling: its input id is ``PENDING_TOKEN`` on the host and
        is read from ``previous``'s sampled ids on the device. With ``defer_sampling`` (a
        constrained sequence is in the step) only the forward pass is queued: the sampler
        follows in ``dispatch_sampler``, with the token mask the host builds meanwhile.
        """
        self.inputs.update_states(output)
        host_batch, rows = self.inputs.build_batch(output)
        seqs = [item.seq for item in output.scheduled]
        kv_lens = np.asarray(host_batch.kv_lens)  # host arrays until forward
        flags = self.inputs.sampler_flags(rows, kv_lens, use_mask=defer_sampling)
        inputs = self.inputs.sampling_inputs(seqs, rows, kv_lens, flags)
        next_ids, spans = self.inputs.prompt_logprob_targets(output, host_batch)
        if self.multihost:  # followers join the same step with process 0's inputs
            header = step_broadcast.StepHeader.of(host_batch, flags, next_ids)
            host_batch, inputs, next_ids = step_broadcast.announce(
                header, (host_batch, inputs, next_ids)
            )
        # The step's pending tokens: (source row in ``previous``'s sampled ids or -1, those ids).
        previous_rows = previous.sampled_row if previous is not None else None
        source = self.inputs.pending_sources(output, host_batch, previous_rows)
        feed = (source, previous.sampled_ids) if source is not None and previous else None
        forward, prompt_out = self.forward(host_batch, next_ids, feed)
        sampled_row = {item.seq.seq_id: i for i, item in enumerate(output.scheduled)}
        step = InFlight(None, prompt_out, spans, sampled_row)
        step.deferred = DeferredSampler(forward, inputs, flags)
        if not defer_sampling:
            self.dispatch_sampler(step)
        return step

    def token_mask_buffer(self, step: InFlight) -> np.ndarray:
        """The host mask a deferred sampler will send: i32[rows, W], every bit set; row i is
        scheduled sequence i's (``structured_outputs.start_masks`` fills it in place)."""
        assert step.deferred is not None, "the step's sampler was already dispatched"
        return np.asarray(step.deferred.inputs.token_mask)  # the host array itself, no copy

    def dispatch_sampler(self, step: InFlight) -> None:
        """Queue the sampler of a step dispatched with ``defer_sampling``, with its token mask
        as ``token_mask_buffer`` now holds it."""
        deferred, step.deferred = step.deferred, None
        assert deferred is not None, "the step's sampler was already dispatched"
        inputs = deferred.inputs
        if deferred.flags.use_mask and self.multihost:
            inputs.token_mask = step_broadcast.share_token_mask(inputs.token_mask)
        with self.precision():
            step.out = self.sample(deferred.forward, inputs, deferred.flags)

    def collect(self, step: InFlight) -> RunnerOutput:
        """Wait for a dispatched step and copy its sampled tokens (and logprobs) to the host."""
        return step.read_back()

    def forward(
        self,
        host_batch: Batch,
        next_ids: np.ndarray | None,
        feed: tuple[np.ndarray, jax.Array] | None = None,
    ) -> tuple[Forward, tuple[jax.Array, ...] | None]:
        """Model step and (when asked) prompt logprobs on the device: (the step's output,
        prompt logprobs). ``feed``: (source, previous sampled ids) of the step's pending tokens."""
        source, previous_ids = feed if feed is not None else (None, None)
        with self.precision():  # also keys the jit caches: warm-up runs under it too
            self.kv_cache, forward = self.run_step(host_batch, source, previous_ids)
            prompt_out = None
            if next_ids is not None:
                prompt_out = self.prompt_logprobs(forward.hidden, self.put(next_ids))
        return forward, prompt_out

    # -- multi-host ------------------------------------------------------------------------

    def follow(self) -> None:
        """On processes other than 0: join every step process 0 runs, until it stops."""
        step_broadcast.follow(self)

    def shutdown(self) -> None:
        """Stop loading the weights if they still load (a start-up that failed), stop compiling
        the buckets warm-up left to the background (what compiles now finishes) and release
        the follower processes of a multi-host replica."""
        self.loading.cancel()
        self.background.stop()
        if self.multihost:
            step_broadcast.stop_followers()
            self.multihost = False
