"""ModelRunner: ``SchedulerOutput`` -> padded arrays -> one compiled model step -> sampled tokens.

The runner owns the weights (loaded on a thread of their own, ``model_weights.py``), the KV
cache, the step's host inputs (``InputBuilder``, padded to the shape ``Buckets``) and the
dispatch, sampling and read-back of each step; the compiled programs and their lowering belong
to ``StepPrograms``, which warm-up (``warmup.py``) fills at start-up, with JAX's persistent
compilation cache so a second start is fast; no request compiles anything. Each step's inputs
travel packed, one host-to-device copy per program (``packing.py``). On a multi-host replica
process 0 announces each step (``parallel/step_broadcast.py``) and the other processes join it
(``follow``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.batch import Batch, kv_page_shapes, make_kv_cache_for
from jaxserve.models.decoder import WholePromptAttention, check_row_tile
from jaxserve.models.kv_scales import kv_dtype_label
from jaxserve.models.lora import lora_shapes
from jaxserve.runner import warmup
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.capacity import Capacity, engine_capacity, reserve_device_memory
from jaxserve.runner.devices import (
    quiet_backend_probe,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_quantization,
    startup_lines,
    uses_compact_samplers,
)
from jaxserve.runner.drafting import TargetStates
from jaxserve.runner.in_flight import DeferredSampler, InFlight
from jaxserve.runner.input_builder import InputBuilder
from jaxserve.runner.lora_slots import LoraSlots
from jaxserve.runner.model_weights import kv_cache_scales, model_weights, start_loading
from jaxserve.runner.parallel import step_broadcast
from jaxserve.runner.parallel.mesh import replica_devices, replica_mesh
from jaxserve.runner.parallel.sharding import TensorParallel, prepare_tp
from jaxserve.runner.pooling_attention import whole_prompt_attention
from jaxserve.runner.programs import Forward, invariant_row_tile
from jaxserve.runner.sleep import (
    WAKE_TAGS,
    SleepState,
    abstract,
    device_bytes,
    free,
    log_asleep,
    log_awake,
    placements,
    to_device,
    to_host,
)
from jaxserve.runner.step import PENDING_TOKEN, DeviceDrafts, RunnerOutput, SchedulerOutput
from jaxserve.runner.step_programs import Advance, KVCacheShapes, StepPrograms
from jaxserve.runner.verify_ahead import META_ROWS
from jaxserve.runner.weight_update import (
    checked_weights,
    committed,
    weights_from_named,
    weights_layout,
)
from pallas_kernels.env_choice import set_devices_per_model

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
        self.buckets = Buckets.of(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_sample_rows,  # a step's rows: its sequences and drafts
            max_model_len=max_model_len,
            block_size=config.block_size,
        )
        warmup.enable_compilation_cache(config.cache_dir)

        self.dtype = resolve_dtype(config)
        self.quant = resolve_quantization(config)  # None: unquantized
        self.kv_dtype = resolve_kv_dtype(config, self.dtype)  # raises where fp8 cannot run
        for line in startup_lines(
            model_config, config, self.dtype, max_model_len, self.quant, self.kv_dtype
        ):
            _LOG.info(line)
        check_row_tile(model_config, invariant_row_tile(config.batch_invariant))
        self.tp = self._prepare_parallel()
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

    def _prepare_parallel(self) -> TensorParallel | None:
        """Tensor parallelism's shardings (``sharding.py``); None (TP=1) keeps the plain
        program. A data-parallel replica runs on its own devices: a mesh even of one device,
        so every array and program is placed there rather than on the first device."""
        config = self.config
        # The kernels' "one device" is the model's (a data-parallel replica's), not the process's.
        set_devices_per_model(config.tensor_parallel_size)
        if config.tensor_parallel_size == 1 and config.data_parallel_size == 1:
            return None
        mesh = None  # one replica: the first tensor_parallel_size devices (make_mesh)
        if config.data_parallel_size > 1:
            rank = config.data_parallel_rank
            devices = replica_devices(config.tensor_parallel_size, config.data_parallel_size, rank)
            mesh = replica_mesh(devices)
        return prepare_tp(
            self.model_config,
            config.tensor_parallel_size,
            mesh=mesh,
            quant=self.quant,
            expert_parallel=config.enable_expert_parallel,
        )

    def _finish_init(self, eos_token_ids: tuple[int, ...]) -> None:
        """The rest of ``__init__``, once the weights have begun to load."""
        model_config, config = self.model_config, self.config
        self.load_seconds = 0.0
        weights = self.loading.shapes  # shapes only, until wait_for_weights
        if weights is None:
            weights, self.load_seconds = self.loading.wait()
        self.weights = weights = committed(weights)  # the served weights always are
        self.asleep = SleepState()
        # NOTE: with warm-up on, the cache is allocated after the step buckets are compiled,
        # so XLA's autotuner compiles with the memory the cache will take still free.
        self.kv_cache: Any = None
        # A drafter over the target's states (``keep_target_states``) reads the last step's.
        self.keeps_states = False
        self.last_states: TargetStates | None = None
        if not config.warmup:
            self.allocate_kv_cache()
        # Several processes (hosts) share this model: process 0 broadcasts each step.
        self.multihost = jax.process_count() > 1
        if self.multihost and self.is_pooling:
            raise ValueError("--runner pooling runs on one host: start it without multi-host")
        self.inputs = InputBuilder(
            self.buckets,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.resolved_max_num_seqs,
            num_slots=self.num_slots,
            vocab_size=model_config.vocab_size,
            eos_token_ids=eos_token_ids,
            compact_samplers=uses_compact_samplers(config),
            enable_lora=config.enable_lora,
        )
        self.lora_slots = self._make_lora_slots()
        self.whole_prompts = self._whole_prompts()
        self.programs = StepPrograms(
            model_config,
            self.buckets,
            self.inputs,
            weights=weights,
            kv_cache_shapes=self.abstract_kv_cache(),
            dtype=self.dtype,
            tp=self.tp,
            kv_scales=self.kv_scales,
            batch_invariant=config.batch_invariant,
            pooling=self.is_pooling,
            lora=self.lora_slots,
            whole_prompts=self.whole_prompts,
        )

    def _whole_prompts(self) -> WholePromptAttention | None:
        """A pooling runner's attention over whole prompts without the cache, or None: the
        paged path (``pooling_attention.py``, which says why in the start-up log)."""
        if not self.is_pooling:
            return None
        attention, why = whole_prompt_attention(
            self.model_config, self.config, self.max_model_len, self.dtype, self.tp
        )
        _LOG.info("Pooling attention: %s", why)
        return attention

    def keep_target_states(self, aux_layers: tuple[int, ...] | None) -> None:
        """Keep each step's states for a drafter (``last_states``): the states entering
        ``aux_layers`` (EAGLE-3), or the final hidden states (None: MTP)."""
        if aux_layers:
            self.programs.return_aux_states(aux_layers)
        self.keeps_states = True

    def _make_lora_slots(self) -> LoraSlots | None:
        """The adapter slots with ``--enable-lora`` (on one host: a follower process would
        need each slot write too), else None."""
        config = self.config
        if not config.enable_lora:
            return None
        if self.multihost:
            raise ValueError("enable_lora on a multi-host replica is not supported (docs/lora.md)")
        shapes = lora_shapes(self.model_config, config.max_loras, config.max_lora_rank)
        # Under tensor parallelism the stacks are split as their base projections are.
        shardings = None if self.tp is None else self.tp.lora_shardings(shapes)
        return LoraSlots(shapes, self.dtype, config.resolved_max_cpu_loras, shardings=shardings)

    @property
    def is_pooling(self) -> bool:
        """Prompts only, embeddings out (``--runner pooling``): no logits, no sampler."""
        return self.config.runner == "pooling"

    @property
    def ready_tokens(self) -> int:
        """The largest step whose programs have all compiled (see warm-up)."""
        return self.programs.ready_tokens

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    # -- weight updates --------------------------------------------------------------------

    def update_weights(self, weights: Any, layout: str = "auto") -> None:
        """Serve ``weights`` from the next step: a pytree laid out as ``self.weights``, or
        named as Hugging Face or a flax.nnx model names them (``layout``: one of
        ``weight_update.LAYOUTS``), converted on the device; a leaf or name that does not fit
        is a ``WeightsUpdateError`` naming it, and nothing changes."""
        self._check_weights_awake()
        layout = weights_layout(weights, layout)
        if layout != "engine":
            placement = self.tp.placement if self.tp is not None else None
            weights = weights_from_named(
                weights, layout, self.model_config, self.dtype, placement, self.quant
            )
        self._swap_weights(checked_weights(self.weights, weights))

    def load_weights_from(self, model_dir: str | Path) -> float:
        """Load the checkpoint in ``model_dir`` (this model's tensors and shapes; safetensors,
        or a converted orbax one of this dtype and quantization) as the start-up loads one, and
        serve it from the next step; the load's seconds. A checkpoint that does not fit raises
        before anything changes."""
        self._check_weights_awake()
        config = dataclasses.replace(self.config, model=str(model_dir), load_format="auto")
        placement = self.tp.placement if self.tp is not None else None
        weights, seconds = model_weights(
            self.model_config, config, self.dtype, placement, self.quant
        )
        self._swap_weights(checked_weights(self.weights, weights))
        return seconds

    def _check_weights_awake(self) -> None:
        if self.asleep.weights_asleep:
            raise RuntimeError("the weights are asleep: wake_up(['weights']) before an update")

    def _swap_weights(self, weights: Any) -> None:
        self.weights = committed(weights)
        self.programs.set_weights(self.weights)

    def head_rows(self, token_ids: list[int]) -> np.ndarray:
        """f32[len(token_ids), H]: the language-model head's rows of these tokens (a decoder
        reranker's score is made of two of them: ``models/scoring.py``)."""
        head = self.weights.embed if self.weights.lm_head is None else self.weights.lm_head
        if not isinstance(head, jax.Array):
            raise ValueError("a decoder reranker needs an unquantized language-model head")
        host = np.asarray(jax.device_get(head), np.float32)
        # the tied embedding is [V, H]; an untied head is stored [H, V]
        rows = host[token_ids] if self.weights.lm_head is None else host[:, token_ids].T
        return np.ascontiguousarray(rows)

    # -- sleep and wake (``sleep.py``) ------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self.asleep.level > 0

    def sleep(self, level: int) -> None:
        """Level 1: the weights to host memory; level 2: the weights dropped. The KV cache is
        freed in both; the compiled programs stay."""
        self.asleep.check_sleep(level)
        start = time.perf_counter()
        self.loading.forget()  # the loader's reference to the weights it made
        held = (device_bytes(self.weights), device_bytes(self.kv_cache))
        self.asleep = SleepState(level, True, True, placements=placements(self.weights))
        if level == 1:
            self.asleep.host_weights = to_host(self.weights)
        copied = time.perf_counter() - start
        free(self.kv_cache)
        self.kv_cache = None
        self._swap_weights(abstract(self.weights))  # the last reference: the memory is free
        log_asleep(level, time.perf_counter() - start, copied, held, self.asleep.host_weights)

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        """Make the weights (``"weights"``: from host memory after level 1, else as the
        start-up made them) and an empty KV cache (``"kv_cache"``) again."""
        self.asleep.check_tags(tags)
        woken: list[tuple[str, float]] = []  # (what, seconds until it is on the device)
        if "weights" in tags and self.asleep.weights_asleep:
            start = time.perf_counter()
            if self.asleep.host_weights is not None:
                weights = to_device(self.asleep.host_weights, self.asleep.placements)
            else:
                placement = self.tp.placement if self.tp is not None else None
                weights, _ = model_weights(
                    self.model_config, self.config, self.dtype, placement, self.quant
                )
            self._swap_weights(checked_weights(self.weights, weights))
            jax.block_until_ready(self.weights)
            source = "host memory" if self.asleep.host_weights is not None else "their source"
            woken.append((f"the weights from {source}", time.perf_counter() - start))
            self.asleep.weights_asleep, self.asleep.host_weights = False, None
        if "kv_cache" in tags and self.asleep.kv_cache_asleep:
            start = time.perf_counter()
            self.allocate_kv_cache()
            jax.block_until_ready(self.kv_cache)
            woken.append(("the KV cache", time.perf_counter() - start))
            self.asleep.kv_cache_asleep = False
        log_awake(woken, self.asleep.weights_asleep or self.asleep.kv_cache_asleep)
        if not self.asleep.weights_asleep and not self.asleep.kv_cache_asleep:
            self.asleep = SleepState()

    def device_bytes(self) -> int:
        """Device memory the weights and the KV cache hold now."""
        return device_bytes(self.weights, self.kv_cache)

    # -- memory ----------------------------------------------------------------------------

    def _plan_capacity(self) -> Capacity:
        kv_dtype = kv_dtype_label(self.kv_dtype)
        return engine_capacity(
            self.model_config, self.config, self.dtype, self.quant, kv_dtype, self.kv_dtype
        )

    def reserve_for_drafter(self, num_bytes: int, what: str) -> None:
        """Take a speculative drafter's device memory (``PagedDrafter.device_bytes``, measured
        once it loaded) out of the KV cache's budget, before warm-up compiles against the
        cache's shape; a cache made already (warm-up off) is made again at its new size. A
        cache of ``num_gpu_blocks_override`` blocks stays as asked. Unplanned, an EAGLE-3
        head's weights, pages and kept states (about 1.3 GiB at the Llama-3-8B shape) came
        out of the activation headroom, and its warm-up ran out of memory on an H100."""
        if num_bytes <= 0 or self.config.num_gpu_blocks_override is not None:
            return
        self.capacity = self.capacity.with_drafter(num_bytes, what)
        self.num_blocks = self.capacity.num_blocks
        self.num_slots = self.inputs.num_slots = self.num_blocks * self.block_size
        self.programs.kv_cache_shapes = self.abstract_kv_cache()
        if self.kv_cache is not None:
            free(self.kv_cache)
            self.kv_cache = None
            self.allocate_kv_cache()

    def wait_for_weights(self) -> None:
        """The loaded weights in place of the shapes warm-up compiled against."""
        weights, self.load_seconds = self.loading.wait()
        self._swap_weights(weights)

    def allocate_kv_cache(self) -> None:
        if self.kv_cache is not None:
            return
        if self.tp is not None:
            self.kv_cache = self.tp.make_kv_cache(self.num_blocks, self.block_size, self.kv_dtype)
        else:  # committed, as every step's cache is once made from the committed weights
            cache = make_kv_cache_for(
                self.model_config, self.num_blocks, self.block_size, self.kv_dtype
            )
            self.kv_cache = committed(cache)

    def abstract_kv_cache(self) -> KVCacheShapes:
        """The cache's shapes (and shardings) only: enough to compile against."""
        n = self.model_config.num_layers
        shardings = self.tp.kv_cache_shardings(n) if self.tp is not None else [(None, None)] * n
        k_shape, v_shape = kv_page_shapes(self.model_config, self.num_blocks, self.block_size)
        return [
            (
                jax.ShapeDtypeStruct(k_shape, self.kv_dtype, sharding=k),
                jax.ShapeDtypeStruct(v_shape, self.kv_dtype, sharding=v),
            )
            for k, v in shardings
        ]

    # -- warm-up ---------------------------------------------------------------------------

    def warmup(self, max_workers: int = 8) -> int:
        """Compile every shape bucket ahead of time (see ``warmup.py``), then allocate the KV
        cache; returns the number of model shapes compiled before serving."""
        serve_early = self.config.serve_while_compiling and not self.multihost
        plan = warmup.WarmUpPlan.of(self.buckets, serve_while_compiling=serve_early)
        with self.programs.precision():
            return warmup.warm_up(
                self.programs,
                plan,
                check=self.loading.raise_if_failed,
                prepare=self._prepare_to_serve,
                cache_dir=self.config.cache_dir,
                max_workers=max_workers,
                headroom_bytes=self.capacity.step_bytes,
            )

    def _prepare_to_serve(self) -> None:
        """Warm-up's step between its compiles: the loaded weights in place of their shapes,
        the KV cache allocated, one step of the smallest bucket run (on a GPU, of every
        bucket compiled so far: ``warmup.run_first_steps``)."""
        waited = time.perf_counter()
        self.wait_for_weights()
        if self.loading.shapes is not None:
            warmup.log_weights_ready(time.perf_counter() - waited, self.load_seconds)
        warmup.log_free_memory(self.capacity.kv_budget_bytes, self.capacity.step_bytes)
        allocated = time.perf_counter()
        self.allocate_kv_cache()
        jax.block_until_ready(self.kv_cache)
        warmup.log_kv_cache_allocated(
            self.capacity.kv_budget_bytes, time.perf_counter() - allocated
        )
        self.kv_cache = warmup.run_first_steps(self.programs, self.kv_cache)

    # -- one step --------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """One unconstrained step, start to finish: dispatch, sample, then wait for the
        sampled tokens."""
        step = self.dispatch(output)
        self.sample(step, None)
        return self.collect(step)

    def dispatch(self, output: SchedulerOutput, previous: InFlight | None = None) -> InFlight:
        """Queue one step's forward pass on the device and return without waiting for it;
        ``sample`` queues its sampler.

        A sequence may decode a token that ``previous`` (the step dispatched just before, not
        yet collected) is still sampling: its input id is ``PENDING_TOKEN`` on the host and
        is read from ``previous``'s sampled ids on the device. A constrained step
        (``output.is_constrained``) takes the sampler variant that applies a token mask.
        """
        self.inputs.update_states(output)
        if self.is_pooling:
            return self._dispatch_pooling(output)
        device_drafts = output.device_drafts
        if device_drafts is not None and (
            self.multihost or not self.programs.feeds_drafts(device_drafts)
        ):
            device_drafts.fill(output.scheduled)  # their values on the host, in the inputs
            output.device_drafts = device_drafts = None
        host_batch, rows = self.inputs.build_batch(output)
        kv_lens = np.asarray(host_batch.kv_lens)  # host arrays until forward
        # One sampler row per sequence, and one more per drafted token (speculative decoding).
        seqs, sample_rows, positions, drafted = self.inputs.sampled_positions(output, rows, kv_lens)
        flags = self.inputs.sampler_flags(sample_rows, positions, use_mask=output.is_constrained)
        inputs = self.inputs.sampling_inputs(seqs, sample_rows, positions, flags, drafted)
        next_ids, spans = self.inputs.prompt_logprob_targets(output, host_batch)
        if self.multihost:  # followers join the same step with process 0's inputs
            header = step_broadcast.StepHeader.of(host_batch, flags, next_ids)
            host_batch, inputs, next_ids = step_broadcast.announce(
                header, (host_batch, inputs, next_ids)
            )
        # The step's pending tokens: (source row in ``previous``'s sampled ids or -1, those ids).
        feed = self._feed(output, host_batch, previous)
        advance = self._advance(output, host_batch, previous, feed)
        lora_slots = self.inputs.lora_token_slots(host_batch, rows)
        # The drafter took the last step's states before this step (its ``propose``): let
        # them go before the forward pass, so that this step's states can take their memory.
        # XLA records a step's command buffers (CUDA graphs) again wherever a buffer moved,
        # and states kept alive across the launch put each step's output at a new address
        # (a batch-1 launch 2.59 against 1.48 ms on an H100; benchmarks/probes/launch_reuse.py).
        self.last_states = None
        forward, prompt_out = self.forward(host_batch, next_ids, feed, lora_slots, advance)
        if self.keeps_states:
            self.last_states = self._states_of(output, forward)
        first_rows = output.sample_rows()
        sampled_row = {
            item.seq.seq_id: r for item, r in zip(output.scheduled, first_rows, strict=True)
        }
        step = InFlight(None, prompt_out, spans, sampled_row, num_rows=len(seqs))
        shifted = None
        if advance is not None:
            assert advance.shift is not None
            step.shift = advance.shift
            shifted = (self._row_sequences(output, len(sample_rows)), advance.shift)
        step.deferred = DeferredSampler(forward, inputs, flags, shifted)
        if device_drafts is not None and feed is not None:  # what a step scheduled ahead reads
            step.drafts_feed = feed[1]
            step.verified = self._verified_rows(output, device_drafts, first_rows)
        return step

    @staticmethod
    def _verified_rows(
        output: SchedulerOutput, drafts: DeviceDrafts, first_rows: list[int]
    ) -> dict[str, tuple[int, int, int]]:
        """seq_id -> (its first sampled row, the drafts it verifies, its first draft's index in
        the drafts' feed) of each sequence of ``output`` that verifies drafts on the device."""
        width = drafts.ids.shape[1]
        return {
            item.seq.seq_id: (r, len(item.draft_token_ids), drafts.rows[item.seq.seq_id] * width)
            for item, r in zip(output.scheduled, first_rows, strict=True)
            if item.draft_token_ids and item.seq.seq_id in drafts.rows
        }

    def _advance(
        self,
        output: SchedulerOutput,
        host_batch: Batch,
        previous: InFlight | None,
        feed: tuple[np.ndarray, jax.Array] | None,
    ) -> Advance | None:
        """For a verify step scheduled before ``previous`` (a verify step too) was read back:
        what corrects it on the device (``verify_ahead``); else None. A sequence of both
        steps moves by its accepted drafts less those it verified in ``previous``, and its
        first input is the token ``previous`` sampled after them. A token in flight that
        neither this nor ``feed`` gives the step is an error."""
        verified = previous.verified if previous is not None else None
        if not verified or output.device_drafts is None or previous is None:
            if feed is not None and output.device_drafts is not None:
                unfed = (np.asarray(host_batch.input_ids) == PENDING_TOKEN) & (feed[0] < 0)
                if unfed.any():  # a verify step's token in flight, not through verify_ahead
                    raise RuntimeError("a pending input token without the step that samples it")
            return None
        assert previous.drafts_feed is not None
        meta = np.zeros((META_ROWS, host_batch.kv_lens.shape[0]), np.int32)
        for i, item in enumerate(output.scheduled):
            entry = verified.get(item.seq.seq_id)
            if entry is not None:  # (this step may verify fewer drafts, or none)
                meta[:, i] = (*entry, 1)
        if not meta[META_ROWS - 1].any():
            return None
        k = max(n for _, n, _ in verified.values())
        return Advance(previous.sampled_ids, previous.drafts_feed, meta, k)

    @staticmethod
    def _row_sequences(output: SchedulerOutput, num_rows: int) -> np.ndarray:
        """Each sampler row's scheduled sequence (i32[num_rows], -1 past them)."""
        row_seq = np.full(num_rows, -1, np.int32)
        for i, (item, first) in enumerate(zip(output.scheduled, output.sample_rows(), strict=True)):
            row_seq[first : first + item.num_sampled] = i
        return row_seq

    def warm_verify_ahead(self, max_tokens: int, k: int) -> int:
        """Compile what corrects a verify step scheduled ahead on the device, for steps of up to
        ``max_tokens`` tokens with up to ``k`` drafts a sequence; returns how many programs."""
        return 0 if self.multihost else self.programs.warm_verify_ahead(max_tokens, k)

    def warm_draft_feed(self, shapes: list[tuple[int, int]]) -> int:
        """Compile the verify step's read of drafts left on the device (``DeviceDrafts``),
        for each shape of a drafter's drafts; returns how many programs."""
        return 0 if self.multihost else self.programs.warm_draft_feed(shapes)

    def _feed(
        self, output: SchedulerOutput, host_batch: Batch, previous: InFlight | None
    ) -> tuple[np.ndarray, jax.Array] | None:
        """(source, ids) of the step's ``PENDING_TOKEN`` inputs, taken on the device: the
        drafts the drafter left there (``output.device_drafts``), or the tokens ``previous``
        samples; None when no input is pending."""
        if output.device_drafts is not None:
            source = self.inputs.draft_sources(output, host_batch)
            return source, self.programs.draft_feed(output.device_drafts.ids)
        previous_rows = previous.sampled_row if previous is not None else None
        pending = self.inputs.pending_sources(output, host_batch, previous_rows)
        return (pending, previous.sampled_ids) if pending is not None and previous else None

    def shift_states(self, seq_id: str, delta: int) -> None:
        """The kept states' rows of ``seq_id`` start ``delta`` positions further: the step was
        scheduled before the verify step ahead of it was read back, counted as if every draft
        were accepted, and moved on the device by its rejected ones (``verify_ahead``)."""
        states = self.last_states
        if states is not None and seq_id in states.rows:
            row, start, count = states.rows[seq_id]
            states.rows[seq_id] = (row, start + delta, count)

    @staticmethod
    def _states_of(output: SchedulerOutput, forward: Forward) -> TargetStates:
        """The step's states for a drafter, and each sequence's rows among them."""
        rows: dict[str, tuple[int, int, int]] = {}
        row = 0
        for item in output.scheduled:
            rows[item.seq.seq_id] = (row, item.start, item.num_new_tokens)
            row += item.num_new_tokens
        states = forward.aux if forward.aux is not None else forward.hidden
        return TargetStates(states, rows)

    def _dispatch_pooling(self, output: SchedulerOutput) -> InFlight:
        """A pooling runner's step: the model step, then what pooling needs of each sequence's
        chunk (``StepPrograms.pool``); nothing is sampled."""
        host_batch, _ = self.inputs.build_batch(output)
        forward, _ = self.forward(host_batch, None)
        with self.programs.precision():
            pooled = self.programs.pool(forward)
        sampled_row = {item.seq.seq_id: i for i, item in enumerate(output.scheduled)}
        return InFlight(None, None, {}, sampled_row, pooled=pooled)

    def sample(self, step: InFlight, token_mask: np.ndarray | None) -> None:
        """Queue the sampler of a dispatched step (once). ``token_mask`` (i32[num_scheduled,
        ceil(V / 32)], only for a step dispatched with ``is_constrained``): row i packs the
        tokens scheduled sequence i may take, bit v % 32 of word v // 32; None: no constraint.
        It is copied into the sampler's inputs: the caller may reuse it once this returns.
        A pooling runner's step has no sampler: nothing is queued."""
        if step.pooled is not None:
            return
        deferred, step.deferred = step.deferred, None
        assert deferred is not None, "the step was sampled already"
        if token_mask is not None and not deferred.flags.use_mask:
            raise ValueError("a token mask for a step dispatched without is_constrained")
        if deferred.flags.use_mask and self.multihost:  # the followers sample with it too
            shared = np.array(deferred.inputs.token_mask)  # every token, in every row
            if token_mask is not None:
                shared[: len(token_mask)] = token_mask
            token_mask = step_broadcast.share_token_mask(shared)
        with self.programs.precision():
            step.out = self.programs.sample(
                deferred.forward, deferred.inputs, deferred.flags, token_mask, deferred.shifted
            )

    def collect(self, step: InFlight) -> RunnerOutput:
        """Wait for a dispatched step and copy its sampled tokens (and logprobs) to the host."""
        return step.read_back()

    def forward(
        self,
        host_batch: Batch,
        next_ids: np.ndarray | None,
        feed: tuple[np.ndarray, jax.Array] | None = None,
        lora_slots: np.ndarray | None = None,
        advance: Advance | None = None,
    ) -> tuple[Forward, tuple[jax.Array, ...] | None]:
        """Model step and (when asked) prompt logprobs on the device: (the step's output,
        prompt logprobs). ``feed``: (source, previous sampled ids) of the step's pending tokens;
        ``lora_slots``: each token's adapter slot (i32[T]); ``advance``: a verify step
        scheduled ahead, corrected on the device first (``verify_ahead``)."""
        source, previous_ids = feed if feed is not None else (None, None)
        programs = self.programs
        with programs.precision():  # also keys the jit caches: warm-up runs under it too
            self.kv_cache, forward = programs.run_step(
                self.kv_cache, host_batch, source, previous_ids, lora_slots, advance
            )
            prompt_out = None
            if next_ids is not None:
                prompt_out = programs.prompt_logprobs(forward.hidden, programs.put(next_ids))
        return forward, prompt_out

    # -- multi-host ------------------------------------------------------------------------

    def follow(self) -> None:
        """On processes other than 0: join every step process 0 runs, until it stops."""
        while (header := step_broadcast.next_header()) is not None:
            batch, inputs = self.inputs.padding_step(header.num_tokens, header.flags)
            next_ids = np.zeros(header.num_tokens, np.int32) if header.has_prompt_logprobs else None
            batch, inputs, next_ids = step_broadcast.receive((batch, inputs, next_ids))
            forward, _ = self.forward(batch, next_ids)
            token_mask = None
            if header.flags.use_mask:  # process 0's, once its host has built it
                token_mask = step_broadcast.share_token_mask(inputs.token_mask)
            with self.programs.precision():
                self.programs.sample(forward, inputs, header.flags, token_mask)

    def shutdown(self) -> None:
        """Stop loading the weights if they still load (a start-up that failed), stop compiling
        the buckets warm-up left to the background (what compiles now finishes) and release
        the follower processes of a multi-host replica, and give back the device memory the
        runner holds: the KV cache is freed and the weights are let go (arrays a trainer handed
        to ``update_weights`` stay its own), so a second engine can start in the same process."""
        self.loading.cancel()
        self.programs.background.stop()
        if self.multihost:
            step_broadcast.stop_followers()
            self.multihost = False
        free(self.kv_cache)
        self.kv_cache = None
        self._swap_weights(abstract(self.weights))
