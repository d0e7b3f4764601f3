"""EngineCore: the step loop. schedule -> dispatch -> read back -> process -> emit.

Requests arrive through ``add_request`` / ``abort_request`` (thread-safe: the HTTP side calls
them from the event loop while ``step`` runs on the engine thread) and leave as
``RequestOutput`` deltas returned by ``step``. Each step the scheduler says what runs, the
runner runs it (asynchronously: step n + 1 is dispatched before step n is read back), and the
output processor turns the sampled tokens into text, logprobs, stop decisions and deltas.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from jaxserve.config import ModelConfig, read_config_json
from jaxserve.engine.grammar import GrammarCompiler, GrammarLimits
from jaxserve.engine.interfaces import EngineStats, Runner
from jaxserve.engine.kv_cache import KVCacheManager
from jaxserve.engine.kv_event_publisher import make_publisher
from jaxserve.engine.kv_events import KVEventLog
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import RequestMetrics, RequestOutput
from jaxserve.engine.pooler import Pooler
from jaxserve.engine.request import Request, SeqStatus, Sequence, mark_scheduled, seq_of
from jaxserve.engine.request_checks import (
    GENERATION_REFUSED,
    POOLING_REFUSED,
    RequestError,
    check_pooling_request,
    check_request,
)
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scoring import (
    CANNOT_SCORE,
    CLASSIFY_NEEDS_POOLING,
    CROSS_ENCODER,
    RERANKER,
    SCORE_NEEDS_POOLING,
    ScoringModel,
)
from jaxserve.engine.spec_decode import (
    DrafterTarget,
    DraftPayoff,
    Proposer,
    SpecDecodeStats,
    accepted_run,
    make_proposer,
)
from jaxserve.engine.step_log import StepLog
from jaxserve.engine.structured_outputs import Accepted, StructuredOutputs
from jaxserve.engine.tokenizer import end_of_sequence_ids, load_tokenizer
from jaxserve.engine_config import EngineConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.models.encoder.config import EncoderConfig, is_encoder, load_encoder_config
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from jaxserve.models.pooling import PoolingConfig, is_base_model
from jaxserve.models.scoring import (
    ScoreHead,
    check_hf_overrides,
    reranker_tokens,
    token_difference_head,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner import verify_ahead
from jaxserve.runner.batch_size import resolve_batch_size
from jaxserve.runner.buckets import next_power_of_2
from jaxserve.runner.step import DeviceDrafts, RunnerOutput, ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from jaxserve.runner.in_flight import InFlight
    from jaxserve.runner.lora_slots import LoraSlots

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
# A pooling request's placeholder sampling parameters: it samples nothing.
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What config.json (with ``--hf-overrides`` on top) says the model is."""

    raw: dict[str, Any]
    is_encoder: bool  # BERT / XLM-RoBERTa (models/encoder/): pooling only
    reranker: tuple[str, str] | None  # a decoder reranker's ("no", "yes") tokens

    @classmethod
    def of(cls, config: EngineConfig, model_dir: Any) -> ServedModel:
        raw = read_config_json(model_dir / "config.json")
        overrides = config.hf_overrides or {}
        check_hf_overrides(overrides)
        encoder = is_encoder(raw)
        return cls(raw, encoder, None if encoder else reranker_tokens(raw, overrides))


def resolve_runner(config: EngineConfig, model_dir: Any) -> EngineConfig:
    """``config`` with ``runner`` "generate" or "pooling": "auto" pools a checkpoint whose
    config.json names only base models (``Qwen3Model``: no language-model head), an encoder
    and a decoder reranker; "generate" on those last two is a ``ValueError``."""
    served = ServedModel.of(config, model_dir)
    if served.is_encoder or served.reranker is not None:
        if config.runner == "generate":
            what = (
                f"an encoder ({', '.join(served.raw.get('architectures') or ['BERT'])})"
                if served.is_encoder
                else "a decoder reranker (classifier_from_token)"
            )
            raise ValueError(
                f"--runner generate: {model_dir} is {what}; it serves embeddings and scores, "
                "not generation: start it with --runner pooling (or auto)"
            )
        return dataclasses.replace(config, runner="pooling")
    if config.runner != "auto":
        return config
    architectures = served.raw.get("architectures") or []
    runner = "pooling" if is_base_model(list(architectures)) else "generate"
    return dataclasses.replace(config, runner=runner)


def encoder_engine_config(config: EngineConfig, encoder: EncoderConfig) -> EngineConfig:
    """An encoder's engine settings: ``max_model_len`` at most (and by default) its position
    table's ``max_seq_len``, every prompt whole in one step (no chunking, so the step's token
    budget must hold the longest), no prefix cache (every token is computed)."""
    if config.tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size}: an encoder runs on one "
            "device; start it with --tensor-parallel-size 1"
        )
    limit = encoder.max_seq_len
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than the {limit} positions of this "
            f"encoder (max_position_embeddings={encoder.max_position_embeddings} in its "
            f"config.json); lower --max-model-len to {limit} or less"
        )
    if config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is less than "
            f"max_model_len={max_model_len}: an encoder runs each prompt whole in one step; "
            f"raise --max-num-batched-tokens to {max_model_len} or more, or lower --max-model-len"
        )
    return dataclasses.replace(
        config,
        max_model_len=max_model_len,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )


def pooler_for(
    config: EngineConfig, model_dir: Any, model_config: ModelConfig | EncoderConfig
) -> Pooler | None:
    """A pooling engine's pooler, its pooling read from the model's directory; else None. An
    encoder without sentence-transformers files pools its CLS token, normalized (vLLM's
    default for BERT); a decoder its last token."""
    if config.runner != "pooling":
        return None
    default = "cls" if isinstance(model_config, EncoderConfig) else "last"
    pooling = PoolingConfig.from_model_dir(model_dir, model_config.hidden_size, default)
    _LOG.info("Pooling runner: %s", pooling.describe())
    return Pooler(pooling)


def check_speculative(config: EngineConfig) -> None:
    """A speculative method that is not built yet ends the start (``NotImplementedError``)."""
    if config.speculative_config is not None:
        config.speculative_config.check_built()


def score_head_for(served: ServedModel, model_config: Any, runner: Any, tokenizer: Any) -> Any:
    """(ScoringModel, ScoreHead or None): what the model scores pairs with."""
    if isinstance(model_config, EncoderConfig):
        labels = model_config.labels
        if model_config.num_labels == 1:
            head = ScoreHead("classifier", model_config.score_activation)
            head = dataclasses.replace(head, description=f"cross-encoder, {head.activation}")
            return ScoringModel(CROSS_ENCODER, labels=labels), head
        if model_config.has_classifier:
            why = f"this model cannot score pairs: its classifier has {model_config.num_labels} "
            return ScoringModel(None, why + "labels; a score needs one", labels), None
        return ScoringModel(None, CANNOT_SCORE), None
    if served.reranker is None:
        return ScoringModel(None, CANNOT_SCORE), None
    ids = []
    for token in served.reranker:
        token_id = tokenizer.hf_tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.hf_tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the tokenizer")
        ids.append(int(token_id))
    return ScoringModel(RERANKER), token_difference_head(runner.head_rows(ids), served.reranker)


def runner_model_config(
    model_config: ModelConfig, pooling: bool, reranker: bool = False
) -> ModelConfig:
    """The config the runner loads: a pooling runner reads no language-model head (the
    embedding stands in for it, never used), as embedding checkpoints publish none; a decoder
    reranker reads its head (two rows of it make its score)."""
    if pooling and not reranker:
        return dataclasses.replace(model_config, tie_word_embeddings=True)
    return model_config


def decoder_config(served: ServedModel, model_dir: Any) -> ModelConfig:
    """A decoder's config; a reranker's config.json may name ``*ForSequenceClassification``,
    which the decoder families do not: it is read by its ``model_type``."""
    if served.reranker is not None:
        return model_config_from_dict({**served.raw, "architectures": []})
    return load_model_config(model_dir)


GC_FREEZE_ENV = "JAXSERVE_GC_FREEZE"
# "0": a model drafter's drafts come to the host before the verify step, as every drafter's
# did before ``DeviceDrafts`` (for timing one against the other: benchmarks/spec_decode.py)
DEVICE_DRAFTS_ENV = "JAXSERVE_DEVICE_DRAFTS"


def freeze_startup_heap() -> bool:
    """Take every object alive after start-up (JAX's, the tokenizer's, the model's: some 340,000
    on the demo model) out of the garbage collector's reach, as vLLM does once its engine has
    started (``gc.freeze``). The collector then walks only what serving makes: on the CPU a
    full collection in the middle of a 512-sequence run took 212 ms before, 6 ms after.
    ``JAXSERVE_GC_FREEZE=0`` leaves the collector alone (a process that makes and drops many
    engines: frozen objects in reference cycles are freed only after ``gc.unfreeze``, which
    ``EngineCore.shutdown`` calls). Whether it froze."""
    if os.environ.get(GC_FREEZE_ENV, "1").strip() == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a batch of requests is made or queued: each of
    its collections walked every request made so far, so on the CPU (a quiet 2-core machine)
    queuing 10,000 embeddings took 0.31-0.36 s with it and 0.16-0.22 s without, and moving them
    to the scheduler 0.17 s against 0.03. Reference counting still frees what is dropped; the
    collector runs again after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class EngineCore:
    # True once ``shutdown`` ran: its device memory is given back and it takes no requests.
    is_shut_down = False

    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        self.runner: Runner
        check_speculative(config)  # before anything loads
        model_dir = config.model_dir
        self.config = config = resolve_runner(config, model_dir)
        served = ServedModel.of(config, model_dir)
        self.config = config = self._read_model(served, model_dir)
        self.tokenizer = load_tokenizer(config, self.model_config.vocab_size)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_ids(served, model_dir)
        self.pooler = pooler_for(config, model_dir, self.model_config)  # docs/embeddings.md
        if runner is None:  # a test may pass its own (same interface, hand-computable tokens)
            runner = self._make_runner(served)
        self.runner = runner
        self.lora_slots: LoraSlots | None = getattr(runner, "lora_slots", None)  # --enable-lora
        # NOTE: from here to the end of warm-up the runner's weights may be loading on a
        # thread of their own: an error or a Ctrl-C stops them (the interpreter's exit would
        # wait for them) and the compiles.
        try:
            # A model drafter loads first: its memory comes out of the KV cache's blocks.
            self.proposer = self._make_proposer()
            self.kv = self._make_kv_cache(runner)
            self.scheduler = self._make_scheduler(runner)
            if self.proposer is not None:  # a step's sequences and drafts share sampler rows
                self.scheduler.max_sample_rows = next_power_of_2(config.max_sample_rows)
            self.output_processor = OutputProcessor(
                self.tokenizer, self.eos_token_ids, self.max_model_len
            )
            limits = GrammarLimits.of(config)
            self.grammar_compiler = GrammarCompiler(
                self.tokenizer.hf_tokenizer, self.vocab_size, self.eos_token_ids, limits
            )
            self.structured_outputs = StructuredOutputs(self.vocab_size)
            for line in self.capacity_lines():
                _LOG.info(line)
            self.num_compiled_shapes = self._warm_up() if config.warmup else 0
            self.scoring = self._scoring_model(served)  # a reranker's reads loaded weights
        except BaseException:
            self._abandon(runner)
            raise
        self.requests: dict[str, Request] = {}
        self._inbox: dict[str, Request] = {}  # new requests by id, in arrival order
        self._aborts: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._seed_rng = random.Random(config.seed)
        self.prompt_tokens = self.generation_tokens = self.num_aborted = self.num_steps = 0
        # Asynchronous scheduling: step n + 1 is scheduled and dispatched before step n's
        # tokens are read back, so the host's work overlaps the device's. Sequences with
        # penalties need their full output history on the host, so while any such request
        # is live the engine reads each step back before scheduling the next.
        self.async_scheduling = config.async_scheduling and not runner.multihost
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None
        self._num_sync_requests = 0
        self.device_drafts = os.environ.get(DEVICE_DRAFTS_ENV, "1").strip() != "0"
        # The next step's drafts, drafted on the device behind the last verify step
        # (``draft_ahead``): taken by the next step's ``_propose`` when they still apply.
        self._ahead: Any = None
        self.num_verified_ahead = 0  # verify steps dispatched while the last one was in flight
        self.step_log = StepLog.from_env()  # JAXSERVE_STEP_LOG: each step's host spans
        freeze_startup_heap()

    def _make_proposer(self) -> Proposer | None:
        """The drafter of ``speculative_config`` (None: off); a method not built yet, or a
        pooling runner, is refused here, before warm-up."""
        spec = self.config.speculative_config
        # The next verify step scheduled and dispatched before the last one is read back
        # (on unless JAXSERVE_ASYNC_VERIFY=0, with drafts made ahead: ``_verifies_ahead``).
        self.async_verify = verify_ahead.enabled()
        self.spec_stats = SpecDecodeStats()
        self.draft_payoff = DraftPayoff()
        self._num_asked = 0  # sequences the last step asked the drafter for
        if spec is None:
            return None
        if self.pooler is not None:
            raise ValueError("speculative_config with a pooling runner: it generates nothing")
        target = DrafterTarget(
            self.config, self.model_config, self.tokenizer, self.max_model_len, self.runner
        )
        proposer = make_proposer(spec, target)
        device_bytes = getattr(proposer, "device_bytes", None)  # a model drafter's memory
        reserve = getattr(self.runner, "reserve_for_drafter", None)
        if device_bytes is not None and reserve is not None:
            read = getattr(self.runner, "weights", None)  # the target's, which it may read
            reserve(device_bytes(read), spec.drafter)
        ahead = getattr(proposer, "ahead_on", False)
        async_verify = ahead and self.async_verify and self.config.async_scheduling
        _LOG.info(
            "Speculative decoding: %s; drafts while at most %d sequences run (above: none)%s; "
            "%s%s (docs/speculative_decoding.md)",
            spec.describe(),
            spec.max_batch_size,
            ", and pauses while it does not pay" if spec.pause_when_unpaid else "",
            "while every sequence decodes, the next verify step is scheduled before the last "
            "is read back, its drafts made behind the last on the device (JAXSERVE_ASYNC_VERIFY)"
            if async_verify
            else "a step with drafts is read back before the next is scheduled",
            ", the next step's drafts made behind it on the device (JAXSERVE_DRAFT_AHEAD)"
            if ahead and getattr(proposer, "ahead_always", False)
            else "",
        )
        return proposer

    def _warm_up(self) -> int:
        """The runner's programs, then a model drafter's (an EAGLE-3 or MTP drafter's read the
        runner's KV cache, allocated by the runner's warm-up); the runner's count."""
        count = self.runner.warmup()
        drafter_warmup = getattr(self.proposer, "warmup", None)
        if drafter_warmup is not None:
            start = time.perf_counter()
            capacity = getattr(self.runner, "capacity", None)  # (a test's runner has none)
            programs = drafter_warmup(getattr(capacity, "step_bytes", None))
            warm_feed = getattr(self.runner, "warm_draft_feed", None)
            if warm_feed is not None:  # the verify step's read of drafts left on the device
                programs += warm_feed(self.proposer.drafts_shapes())  # type: ignore[union-attr]
            programs += self._warm_verify_ahead()
            _LOG.info(
                "Compiled the drafter's %d programs in %.1f s",
                programs,
                time.perf_counter() - start,
            )
        return count

    def _propose(
        self, ahead: Any = None
    ) -> tuple[dict[str, list[int]] | None, DeviceDrafts | None]:
        """This step's drafts (speculative decoding), or None: off, or more sequences run
        than ``disable_by_batch_size``. Only sequences that decode, every token known. A model
        drafter's stay on the device (second: their values, the first holding their places)
        unless the host needs them before the step: a grammar checks them, or penalties
        count them. ``ahead``: the drafts queued behind the last step (``_draft_ahead``),
        taken where they are the ones these sequences need."""
        spec = self.config.speculative_config
        running = self.scheduler.running
        if self.proposer is None or spec is None or not running:
            return None, None
        if len(running) > spec.max_batch_size:
            return None, None
        decoding = [
            s for s in running if not s.num_pending and s.num_computed_tokens == s.num_tokens - 1
        ]
        self._num_asked = len(decoding)
        on_device = (
            self.device_drafts
            and self._num_sync_requests == 0
            and not self.structured_outputs.num_matchers
        )
        take_ahead = getattr(self.proposer, "take_ahead", None)
        if ahead is not None and on_device and take_ahead is not None:
            taken = take_ahead(ahead, decoding, spec.num_speculative_tokens)
            if taken is not None:
                return taken.placeholders(), taken
        drafts = self.proposer.propose(decoding, spec.num_speculative_tokens, on_device)
        if isinstance(drafts, DeviceDrafts):
            return drafts.placeholders(), drafts
        return self.structured_outputs.cut_drafts(drafts), None

    def _warm_verify_ahead(self) -> int:
        """What corrects a verify step scheduled ahead (``_verifies_ahead``), compiled for the
        largest drafting step, when it may run here; the programs' count."""
        spec, warm = self.config.speculative_config, getattr(self.runner, "warm_verify_ahead", None)
        scheduling = self.config.async_scheduling and not self.runner.multihost  # (as later)
        if spec is None or warm is None or not (self.async_verify and scheduling):
            return 0
        if not getattr(self.proposer, "ahead_on", False) or getattr(self.runner, "tp", None):
            return 0
        k = spec.num_speculative_tokens
        max_tokens = min(self.config.max_num_batched_tokens, spec.max_batch_size * (k + 1))
        return warm(max_tokens, k)

    def _propose_in_flight(
        self, ahead: Any
    ) -> tuple[dict[str, list[int]] | None, DeviceDrafts | None]:
        """A verify step scheduled while the last one is in flight (``_verifies_ahead``): the
        drafts the drafter made behind it (``ahead``) for every decoding sequence, or
        (None, None)."""
        spec = self.config.speculative_config
        take = getattr(self.proposer, "take_in_flight", None)
        if ahead is None or spec is None or take is None:
            return None, None
        decoding = self.scheduler.running  # every one decodes (``_verifies_ahead``)
        self._num_asked = len(decoding)
        taken = take(ahead, decoding, spec.num_speculative_tokens)
        return (None, None) if taken is None else (taken.placeholders(), taken)

    def _verifies_ahead(self) -> bool:
        """Whether this verify step may be scheduled before the last one is read back, and
        be kept in flight itself (unless JAXSERVE_ASYNC_VERIFY=0; ``runner/verify_ahead.py``): a
        drafter that makes its drafts on the device behind each verify step, one device,
        every running sequence decoding (nothing waits to start, no prompt in chunks), none
        that the host must see each token of (penalties, a grammar, ``min_tokens``), a model
        without sliding windows (the host's counts run ahead by the drafts in flight), and
        blocks enough that no sequence is preempted."""
        if not (self.async_verify and self.async_scheduling and self.device_drafts):
            return False
        if not getattr(self.proposer, "ahead_on", False) or self.runner.multihost:
            return False
        if getattr(self.runner, "tp", None) is not None or self.kv.sliding_window is not None:
            return False
        if self._num_sync_requests or self.structured_outputs.num_matchers:
            return False
        running = self.scheduler.running
        if not running or self.scheduler.num_waiting:
            return False
        if any(s.params.min_tokens or s.num_computed_tokens != s.num_tokens - 1 for s in running):
            return False
        spec = self.config.speculative_config
        assert spec is not None
        per_seq = self.kv.blocks_needed(2 * (spec.num_speculative_tokens + 1)) + 1
        return self.kv.pool.num_free >= len(running) * per_seq

    def _verify_in_flight(self) -> bool:
        """A verify step is in flight (its tokens counted as if every draft were accepted: its
        drafts were on the device; a step with drafts on the host is read back at once)."""
        return self._in_flight is not None and self._in_flight[0].device_drafts is not None

    def _read_model(self, served: ServedModel, model_dir: Any) -> EngineConfig:
        """``model_config`` (an encoder's or a decoder's) and ``max_model_len``; the engine
        config, with an encoder's settings (``encoder_engine_config``) and ``max_num_seqs``
        (the user's, or the device's default sized from the KV cache: ``resolve_batch_size``)."""
        config = self.config
        self.model_config: Any
        if served.is_encoder:  # models/encoder/, runner/encoder_runner.py
            self.model_config = load_encoder_config(model_dir)
            config = encoder_engine_config(config, self.model_config)
            self.max_model_len = config.max_model_len or 0
            return resolve_batch_size(config, None, self.max_model_len)
        self.model_config = decoder_config(served, model_dir)
        self.max_model_len = config.resolved_max_model_len(self.model_config, warn=True)
        return resolve_batch_size(config, self._loaded_config(served), self.max_model_len)

    def _eos_ids(self, served: ServedModel, model_dir: Any) -> tuple[int, ...]:
        if served.is_encoder:  # nothing is generated: the tokenizer's, for completeness
            eos = self.tokenizer.eos_token_id
            return () if eos is None else (eos,)
        return end_of_sequence_ids(self.model_config, model_dir, self.tokenizer)

    def _make_runner(self, served: ServedModel) -> Runner:
        if served.is_encoder:
            from jaxserve.runner.encoder_runner import EncoderRunner

            return EncoderRunner(self.model_config, self.config)
        from jaxserve.runner.runner import ModelRunner

        return ModelRunner(self._loaded_config(served), self.config, self.eos_token_ids)

    def _loaded_config(self, served: ServedModel) -> ModelConfig:
        """The decoder config the runner loads (``runner_model_config``)."""
        pooling, reranker = self.config.runner == "pooling", served.reranker is not None
        return runner_model_config(self.model_config, pooling, reranker)

    def _abandon(self, runner: Runner) -> None:
        """A start that failed: the runner's threads and the event publisher stopped."""
        runner.shutdown()
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            publisher.shutdown()

    def _make_scheduler(self, runner: Runner) -> Scheduler:
        config = self.config
        return Scheduler(
            self.kv,
            max_num_seqs=config.resolved_max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            # a pooling runner over whole prompts (runner/pooling_attention.py) chunks none
            enable_chunked_prefill=config.enable_chunked_prefill
            and getattr(runner, "whole_prompts", None) is None,
            policy=config.scheduling_policy,
            lora_slots=self.lora_slots,
        )

    def _make_kv_cache(self, runner: Runner) -> KVCacheManager:
        """The block pool; it records KV-cache events when --kv-events-config publishes them
        (each step hands them to ``kv_event_publisher``)."""
        config = self.config
        window = getattr(self.model_config, "all_layers_window", None)  # an encoder has none
        self.kv_event_publisher = make_publisher(config.kv_events_config)
        events = KVEventLog(window) if self.kv_event_publisher is not None else None
        kv_args = (runner.num_blocks, config.block_size, config.enable_prefix_caching)
        return KVCacheManager(*kv_args, sliding_window=window, events=events)

    def _scoring_model(self, served: ServedModel) -> ScoringModel:
        """What the model scores pairs with (docs/embeddings.md); its head to the pooler."""
        if self.pooler is None:
            return ScoringModel(None, SCORE_NEEDS_POOLING, classify_refusal=CLASSIFY_NEEDS_POOLING)
        scoring, head = score_head_for(served, self.model_config, self.runner, self.tokenizer)
        self.pooler.score_head = head
        if head is not None:
            _LOG.info("Scores pairs: %s", head.description)
        return scoring

    def shutdown(self) -> None:
        """Wait for a step still on the device, stop warm-up's background compile, release
        the follower processes of a multi-host replica, give back the runner's device memory
        (the KV cache, its references to the weights). Call it once the step loop stopped;
        the engine takes no request after it."""
        self.is_shut_down = True
        self._read_in_flight()
        if self.step_log is not None:
            self.step_log.flush()
        self.runner.shutdown()
        drafter_shutdown = getattr(self.proposer, "shutdown", None)  # a model drafter's memory
        if drafter_shutdown is not None:
            drafter_shutdown()
        self.grammar_compiler.close()
        self.structured_outputs.close()
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
            self.kv_event_publisher.shutdown()
        gc.unfreeze()  # what start-up froze is the collector's again (freeze_startup_heap)

    def publish_kv_events(self) -> None:
        """Hand the KV-cache events recorded since the last call to the publisher (one batch;
        nothing when there are none or events are off)."""
        events = self.kv.pool.events
        if self.kv_event_publisher is not None and events is not None and events.pending:
            self.kv_event_publisher.publish(events.take())

    def settle(self) -> list[RequestOutput]:
        """Read back the step on the device, if any (its outputs)."""
        return self._read_in_flight()

    def is_quiet(self) -> bool:
        """No sequence runs and no step is on the device: weights may change."""
        return not self.scheduler.running and self._in_flight is None

    def swap_weights(self, swap: Callable[[], _T]) -> _T:
        """Run ``swap`` (the runner's weight update) while the engine is quiet (``is_quiet``:
        the caller stops admission and steps until it is), then clear the prefix cache, whose
        blocks hold the old weights' keys and values. Requests still waiting start on the
        new weights."""
        if not self.is_quiet():
            raise RuntimeError(
                f"{len(self.scheduler.running)} sequences are running: weights change between "
                "steps with none running"
            )
        result = swap()
        self.kv.pool.reset_prefix_cache()
        self.publish_kv_events()
        return result

    @property
    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping

    def sleep(self, level: int) -> None:
        """Give the model's device memory up (``runner/sleep.py``) while the engine is quiet;
        the prefix cache is forgotten (the KV cache wakes empty). Steps wait until it wakes."""
        self._check_sleep_mode()
        self.swap_weights(lambda: self.runner.sleep(level))

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        self._check_sleep_mode()
        self.runner.wake_up(tags)

    def _check_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: start the engine with enable_sleep_mode")

    def capacity_lines(self) -> list[str]:
        return self.runner.capacity.lines()

    # -- requests (any thread) -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request for the next step (``RequestError`` if it cannot run); requests of
        one ``group_id`` (the prompts of one API call) take one admission turn together.
        ``lora_request``: its adapter, read and checked here if the engine does not know it
        yet (``AdapterError``). ``final_only``: ``step`` returns its output once, finished and
        whole, not a delta per step (``Request.final_only``)."""
        if self.pooler is not None:
            raise RequestError(GENERATION_REFUSED, code="pooling_model")
        params = check_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if lora_request is not None:
            self.ensure_lora(lora_request)
        arrival = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            arrival,
            priority,
            cache_salt,
            group_id or "",
            metrics=RequestMetrics(arrival_time=arrival),
            grammar=self.compile_grammar(params),
            lora_request=lora_request,
            final_only=final_only,
        )
        request.add_samples(
            params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        )
        self._enqueue(request)

    def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """Queue a pooling request (an embedding, or with ``task="score"`` a pair's score:
        ``--runner pooling``); ``RequestError`` naming the field if it cannot run. Its prompt
        runs like a prefill, chunked by the step's token budget (an encoder's whole in one
        step), and its one output (``RequestOutput.embedding`` or ``.score``) comes once the
        last chunk has run. ``token_type_ids``: an encoder's, one per prompt token (a text
        pair's 0 then 1, as the tokenizer gives them)."""
        if self.pooler is None:
            raise RequestError(POOLING_REFUSED, code="generation_model")
        if params.task == "score" and self.pooler.score_head is None:
            raise RequestError(self.scoring.refusal, code="model_cannot_score")
        if params.task == "classify" and not self.scoring.can_classify:
            raise RequestError(self.scoring.classify_refusal, code="model_cannot_classify")
        check_pooling_request(
            prompt_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if token_type_ids is not None and len(token_type_ids) != len(prompt_token_ids):
            raise RequestError(
                f"token_type_ids has {len(token_type_ids)} entries for "
                f"{len(prompt_token_ids)} prompt tokens",
                param="token_type_ids",
            )
        try:
            self.pooler.config.check(params)
        except SamplingParamsError as exc:
            raise RequestError(str(exc), param=exc.param) from None
        arrival = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            _POOLING_SAMPLING,
            arrival,
            priority,
            group_id=group_id or "",
            metrics=RequestMetrics(arrival_time=arrival),
            pooling=params,
            reads_prefix_cache=not self.pooler.config.uses_every_token,
            token_type_ids=list(token_type_ids) if token_type_ids is not None else None,
        )
        request.add_samples(0)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if self.is_shut_down:
            raise RuntimeError(
                "the engine was shut down (LLM.shutdown) and its device memory given back: "
                "make a new LLM to run more requests"
            )
        request_id = request.request_id
        # NOTE: the inbox is a dict so that this check is a lookup: a scan of the queue made
        # an offline batch of 10,000 requests quadratic before its first step.
        with self._lock:
            if request_id in self.requests or request_id in self._inbox:
                raise RequestError(f"request id {request_id!r} is in use", param="request_id")
            self._inbox[request_id] = request

    # -- LoRA adapters (any thread) --------------------------------------------------------

    def ensure_lora(self, lora_request: LoRARequest) -> None:
        if self.lora_slots is None:
            raise RequestError(
                f"adapter {lora_request.lora_name!r} asked for, but LoRA is off "
                "(start the engine with enable_lora / --enable-lora)",
                param="model",
            )
        if not self.lora_slots.has_lora(lora_request.lora_int_id):
            self.lora_slots.add_lora(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read, check and keep the adapter in host memory (``AdapterError`` if it does not
        fit the model); requests may then name it."""
        if self.lora_slots is None:
            raise RuntimeError("LoRA is off: start the engine with enable_lora / --enable-lora")
        self.lora_slots.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter; sequences that run with it finish on it."""
        if self.lora_slots is not None:
            self.lora_slots.remove_lora(lora_int_id)

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters of the running and of the waiting requests (vLLM's
        ``lora_requests_info``), each name once."""
        running: dict[str, bool] = {}
        waiting: dict[str, bool] = {}
        for request in list(self.requests.values()):
            lora = request.lora_request
            if lora is None:
                continue
            is_running = any(s.status == SeqStatus.RUNNING for s in request.seqs)
            (running if is_running else waiting)[lora.lora_name] = True
        for request in list(self._inbox.values()):
            if request.lora_request is not None:
                waiting[request.lora_request.lora_name] = True
        return tuple(running), tuple(w for w in waiting if w not in running)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` (None without one; cached);
        ``RequestError`` naming the field if it is invalid or too slow to compile."""
        spec = params.structured_outputs
        return None if spec is None else self.grammar_compiler.compile(spec)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._in_flight or self.scheduler.has_work())

    def num_waiting(self) -> int:
        """Sequences not yet running (a request with n samples counts n)."""
        inbox = sum(r.params.num_samples for r in list(self._inbox.values()))
        return inbox + self.scheduler.num_waiting

    def num_unfinished(self) -> int:
        return len(self._inbox) + len(self.requests)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.num_waiting(),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_aborted=self.num_aborted,
            num_steps=self.num_steps,
            num_gpu_blocks=self.kv.num_blocks,
            **self._lora_stats(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.proposer is None:
            return {}
        spec = self.spec_stats.copy()  # the engine thread adds to it meanwhile
        return {
            "spec_decode": True,
            "spec_num_drafts": spec.num_drafts,
            "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(spec.accepted_per_pos),
        }

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora_slots is None:
            return {}
        running, waiting = self.lora_names()
        return {
            "running_lora_adapters": running,
            "waiting_lora_adapters": waiting,
            "max_lora": self.config.max_loras,
        }

    # -- the step (engine thread) ----------------------------------------------------------

    def drain_inbox(self) -> list[RequestOutput]:
        """New requests to the scheduler's waiting queue, aborts carried out (their outputs)."""
        with self._lock:
            new, self._inbox = list(self._inbox.values()), {}
            aborts, self._aborts = list(self._aborts), collections.deque()
        with gc_paused():
            for request in new:
                self.requests[request.request_id] = request
                self._num_sync_requests += request.params.has_penalties
                self.output_processor.add_request(request)
                if request.grammar is not None:
                    self.structured_outputs.add_request(request, request.grammar)
                for seq in request.seqs:
                    self.scheduler.add(seq)
        outputs = []
        for request_id in aborts:
            aborted = self.requests.get(request_id)
            if aborted is not None:
                self.num_aborted += 1
                outputs.append(self._end_request(aborted))
        return outputs

    def _end_request(self, request: Request, error: str | None = None) -> RequestOutput:
        """Finish every unfinished sample of ``request`` (aborted, or failed with ``error``)
        and retire it."""
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.drop_pending()
                if error is None:
                    self.output_processor.abort(seq)
                else:
                    self.output_processor.fail(seq, error)
        output = self.output_processor.make_output(request, request.seqs)
        self._retire(request)
        return output

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self.publish_kv_events()
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.step_log is not None:
            self.step_log.start()
        outputs = self.drain_inbox()
        if self.is_sleeping:  # nothing runs until it wakes
            return outputs
        # A step that may draft (speculative decoding, few sequences running) needs every token
        # known to draft from, and its own read back before the next step is scheduled, unless
        # it verifies ahead (``_verifies_ahead``).
        drafting = self.proposer is not None and self._may_draft()
        overlap, drafts, device_drafts = self._overlap_and_drafts(drafting, outputs)
        self._span("propose")
        sched = self.scheduler.schedule(drafts)
        sched.device_drafts = device_drafts
        self._span("schedule")
        if sched.is_empty:
            return outputs + self._read_in_flight()
        mark_scheduled(sched, time.time())
        self.structured_outputs.update_states(sched)
        # A constrained step's sampler waits for its token masks: the forward pass runs while the
        # host reads back the previous step and fills this step's masks (``start_masks``).
        constrained = sched.is_constrained = self.structured_outputs.is_constrained(sched)
        try:
            step, result = self._run_step(sched, overlap, constrained)
        except Exception as exc:
            return outputs + self._fail_new_requests(sched, exc)
        self._span("dispatch")
        self.scheduler.update_from_output(sched)
        self.num_steps += 1
        if overlap:
            self._count_in_flight(sched)
        collected = self._collect_in_flight()  # nothing is in flight unless overlap
        # The masks once the grammars have taken the previous step's tokens, filled while
        # the engine turns those tokens into outputs.
        masks = self.structured_outputs.start_masks(sched) if constrained else None
        if collected is not None:
            accepted_before = self.spec_stats.num_accepted_tokens
            outputs += self._process(*collected, followed=True)
            if collected[0].has_drafts:
                self._weigh_drafts(accepted_before)
        if masks is not None:
            self.runner.sample(step, masks.result())
            if not overlap:
                result = self.runner.collect(step)
        if not overlap:
            assert result is not None
            outputs += self._process_read_back(sched, result, drafting)
        else:
            self._in_flight = (sched, step)
        if self.step_log is not None:
            self.step_log.span("process")
            self.step_log.end(sched)
        return outputs

    def _overlap_and_drafts(
        self, drafting: bool, outputs: list[RequestOutput]
    ) -> tuple[bool, dict[str, list[int]] | None, DeviceDrafts | None]:
        """(whether this step overlaps the step in flight, its drafts, their values on the
        device). A step that does not overlap reads the step in flight first (its outputs to
        ``outputs``). Also the scheduler's budget and its rule for drafts with tokens in
        flight, for this step."""
        # A verify step may be scheduled before the last one is read back (``_verifies_ahead``)
        ahead_verify = drafting and self._verifies_ahead()
        overlap = (
            self.async_scheduling
            and self._num_sync_requests == 0
            and (ahead_verify or not (drafting or self._verify_in_flight()))
        )
        if not overlap:
            outputs += self._read_in_flight()
        # Until warm-up's background compile is done, steps stay within the compiled buckets.
        budget = min(self.config.max_num_batched_tokens, self.runner.ready_tokens)
        self.scheduler.max_num_batched_tokens = budget
        ahead, self._ahead = self._ahead, None  # drafted behind the last step: this step's
        drafts, device_drafts = None, None
        if ahead_verify and self._in_flight is not None:
            drafts, device_drafts = self._propose_in_flight(ahead)
            if device_drafts is None:  # not for each of them: the last step is read first
                outputs += self._read_in_flight()
                ahead_verify = overlap = False
            else:
                self.num_verified_ahead += 1
        if drafting and device_drafts is None:
            drafts, device_drafts = self._propose(ahead)
        self.scheduler.drafts_with_pending = ahead_verify
        return overlap, drafts, device_drafts

    def _count_in_flight(self, sched: SchedulerOutput) -> None:
        """The step's tokens counted in its sequences before it is read back, one for each
        row a sequence samples (a verify step's: as if every draft were accepted)."""
        for item in sched.scheduled:
            if item.completes_sequence and seq_of(item).request.pooling is None:
                for _ in range(item.num_sampled):
                    seq_of(item).add_pending()
        sched.tokens_in_flight = True

    def _run_step(
        self, sched: SchedulerOutput, overlap: bool, constrained: bool
    ) -> tuple[InFlight, RunnerOutput | None]:
        """The step on the device: dispatched after ``previous`` (overlap) and sampled, unless
        it waits for its token masks; a step read back before the next (neither) is also
        collected here, its device wait timed apart from its dispatch."""
        previous = self._in_flight[1] if overlap and self._in_flight else None
        step = self.runner.dispatch(sched, previous)
        if not constrained:
            self.runner.sample(step, None)
            always = getattr(self.proposer, "ahead_always", False)
            if sched.device_drafts is not None and (overlap or always):
                self._span("dispatch")
                self._draft_ahead(sched, step)
                self._span("propose")  # (the step log: drafting's host time)
        if overlap or constrained:
            return step, None
        self._span("dispatch")
        result = self.runner.collect(step)
        self._span("wait")
        return step, result

    def _draft_ahead(self, sched: SchedulerOutput, step: InFlight) -> None:
        """Queue the next step's drafts behind this verify step, before the host reads it back
        (a model drafter's ``draft_ahead``; behind a step kept in flight, or behind every one
        with ``JAXSERVE_DRAFT_AHEAD=1``), so that the drafter runs while the host processes
        this step and schedules the next."""
        draft_ahead = getattr(self.proposer, "draft_ahead", None)
        if draft_ahead is not None:
            self._ahead = draft_ahead(sched, step)

    def _span(self, name: str) -> None:
        """The engine thread's time since the last mark, added to this step's span ``name``
        (``JAXSERVE_STEP_LOG`` set; else nothing)."""
        if self.step_log is not None:
            self.step_log.span(name)

    def _may_draft(self) -> bool:
        spec = self.config.speculative_config
        running = len(self.scheduler.running)
        if spec is None or not 0 < running <= spec.max_batch_size:
            return False
        return self.draft_payoff.may_draft(self.num_steps)

    def _process_read_back(
        self, sched: SchedulerOutput, result: RunnerOutput, drafting: bool
    ) -> list[RequestOutput]:
        """A step read back before the next: its outputs; after a step that could draft,
        whether drafting paid (``_weigh_drafts``)."""
        if sched.device_drafts is not None:  # what the step verified, now on the host
            sched.device_drafts.fill(sched.scheduled)
        accepted_before = self.spec_stats.num_accepted_tokens
        outputs = self._process(sched, result)
        if drafting:
            self._weigh_drafts(accepted_before)
        return outputs

    def _weigh_drafts(self, accepted_before: int) -> None:
        """After a step that could draft: did it pay (``DraftPayoff``)? A pause is logged."""
        spec = self.config.speculative_config
        if spec is None or not spec.pause_when_unpaid:
            return
        accepted = self.spec_stats.num_accepted_tokens - accepted_before
        if self.draft_payoff.record(self.num_steps, self._num_asked, accepted):
            first = self.draft_payoff.num_pauses == 1
            _LOG.log(
                logging.INFO if first else logging.DEBUG,
                self.draft_payoff.describe_pause(self.num_steps),
            )
        self._num_asked = 0

    def _fail_new_requests(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A step whose inputs could not be built: the requests that joined it fail, and the
        engine carries on (with no new request to blame, the step loop dies)."""
        blamed = {seq_of(item).request.request_id for item in sched.scheduled if item.is_new}
        if not blamed:
            raise exc
        self.scheduler.restore_notices(sched)  # the runner may not have seen them
        _LOG.exception("a step with new requests %s failed; they fail", sorted(blamed))
        return [self._end_request(self.requests[r], repr(exc)) for r in blamed]

    def _collect_in_flight(self) -> tuple[SchedulerOutput, RunnerOutput, Accepted] | None:
        """Wait for the dispatched step, if any, and pass its tokens through the grammars."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        sched, step = in_flight
        self._span("process")  # the host's work before it blocks
        result = self.runner.collect(step)
        self._span("wait")
        if sched.device_drafts is not None:  # what the step verified, now on the host
            sched.device_drafts.fill(sched.scheduled)
        return sched, result, self.structured_outputs.accept_step(sched, result)

    def _read_in_flight(self) -> list[RequestOutput]:
        """Wait for the dispatched step, if any, and process its tokens."""
        collected = self._collect_in_flight()
        return [] if collected is None else self._process(*collected)

    def _process(
        self,
        sched: SchedulerOutput,
        result: RunnerOutput,
        accepted: Accepted | None = None,
        followed: bool = False,  # another step was dispatched after it (asynchronous)
    ) -> list[RequestOutput]:
        if accepted is None:
            accepted = self.structured_outputs.accept_step(sched, result)
        if sched.has_drafts:
            self._verified(sched, result)
        now = time.time()
        touched: dict[str, list[Sequence]] = {}
        outputs = self._failed_on_device(sched, result) if result.failed else []
        if self.pooler is not None:  # a pooling engine runs pooling requests only
            return outputs + self._process_pooled(sched, result)
        # NOTE: the loops below run once a sequence (and a token) a step, at every batch size:
        # the cheap test first (a decode step has no prompt token, no prompt logprobs).
        for item, row in zip(sched.scheduled, sched.sample_rows(), strict=True):
            seq = seq_of(item)
            request = seq.request
            if item.start < len(request.prompt_token_ids):
                self._count_prompt_tokens(item)
            if result.prompt_logprobs and seq.index == 0 and seq.seq_id in result.prompt_logprobs:
                self.output_processor.add_prompt_logprobs(
                    seq, item.start, result.prompt_logprobs[seq.seq_id]
                )
            if not item.completes_sequence or seq.is_finished:
                if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                    touched.setdefault(request.request_id, [])
                continue
            count = self._num_emitted(item, result, row, accepted)
            for r in range(row, row + count):
                self.generation_tokens += 1
                self._process_token(seq, result, r, accepted if r == row + count - 1 else None)
                if seq.finish_reason is not None:  # a stop inside a verified run ends it there
                    seq.drop_pending()  # a token sampled past the end is discarded
                    self.scheduler.finish(seq)
                    break
            if sched.tokens_in_flight and item.draft_token_ids and not seq.is_finished:
                self._resolved_in_flight(seq, item.num_sampled - count, followed)
            if seq.index == 0 and len(request.seqs) > 1 and seq.num_resolved_outputs == 1:
                self.scheduler.release_parked(seq)  # its siblings share the prompt now
            metrics = request.metrics
            if metrics is not None:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            touched.setdefault(request.request_id, []).append(seq)
        return outputs + self._outputs_of(touched)

    def _failed_on_device(self, sched: SchedulerOutput, result: RunnerOutput) -> list:
        """The requests whose part of the step failed on the device: they fail, alone."""
        outputs = []
        for item in sched.scheduled:
            error = result.failed.get(item.seq.seq_id)
            request = seq_of(item).request
            if error is not None and request.request_id in self.requests:
                _LOG.error("request %s failed on the device: %s", request.request_id, error)
                outputs.append(self._end_request(request, error))
        return outputs

    def _outputs_of(self, touched: dict[str, list[Sequence]]) -> list[RequestOutput]:
        """The outputs of the requests a step gave tokens (or prompt logprobs); a finished
        request retires."""
        outputs = []
        for request_id, seqs in touched.items():
            if request_id not in self.requests:  # aborted while this step was on the device
                continue
            request = self.requests[request_id]
            if request.returns_best_of or request.final_only:
                if not request.is_finished:
                    continue
                seqs = request.seqs
            outputs.append(self.output_processor.make_output(request, seqs))
            if request.is_finished:
                self._retire(request)
        return outputs

    def _process_token(
        self, seq: Sequence, result: RunnerOutput, row: int, accepted: Accepted | None
    ) -> None:
        """One sampled token to the output processor; ``accepted``: what the grammars said of
        the sequence's last token of the step (None for the tokens before it)."""
        try:
            self.output_processor.process_token(seq, result, row)
            if accepted is not None and seq.seq_id in accepted.errors:
                raise RuntimeError(accepted.errors[seq.seq_id])
            if accepted is not None and seq.seq_id in accepted.complete:
                self.output_processor.complete_grammar(seq)
        except Exception as exc:  # one bad request must not stop the batch
            _LOG.exception("request %s failed while processing its output", seq.request.request_id)
            self.output_processor.fail(seq, repr(exc))

    def _num_emitted(
        self, item: ScheduledSeq, result: RunnerOutput, row: int, accepted: Accepted
    ) -> int:
        """The tokens a step gives a sequence that completes in it: one, or after verifying
        drafts the accepted ones and the target's next (cut where its grammar completed)."""
        drafts = item.draft_token_ids
        if not drafts:
            return 1
        run = accepted_run(drafts, result.token_ids, row)
        return min(len(run), accepted.cut.get(item.seq.seq_id, len(run)))

    def _resolved_in_flight(self, seq: Sequence, num_rejected: int, followed: bool) -> None:
        """A verify step whose tokens were counted while it was in flight (as if every draft
        were accepted) was read back: its rejected drafts' places go, a later step's states
        (``followed``) are counted from the true positions, and the drafter's cache holds the
        sequence's tokens (``verify_ahead``)."""
        seq.drop_pending(num_rejected)
        if followed and num_rejected:
            self.runner.shift_states(seq.seq_id, -num_rejected)
        caught_up = getattr(self.proposer, "caught_up", None)
        if caught_up is not None:
            caught_up(seq.seq_id, seq.num_known_tokens)

    def _verified(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        """A verify step's bookkeeping: counters, and each sequence's rejected drafts taken
        back from its computed tokens (their KV is overwritten by the steps that follow)."""
        for item, row in zip(sched.scheduled, sched.sample_rows(), strict=True):
            drafts = item.draft_token_ids
            # (a sequence that ended while this step was in flight: its part of it is void)
            if drafts and item.seq.seq_id not in result.failed and not seq_of(item).is_finished:
                num_accepted = len(accepted_run(drafts, result.token_ids, row)) - 1
                self.spec_stats.add(len(drafts), num_accepted)
                self.scheduler.reject_drafts(seq_of(item), len(drafts) - num_accepted)

    def _count_prompt_tokens(self, item: ScheduledSeq) -> None:
        seq = item.seq
        self.prompt_tokens += max(
            0, min(item.start + item.num_new_tokens, seq.num_prompt_tokens) - item.start
        )

    def _process_pooled(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """A pooling step: each request's chunk folded into its pooled state."""
        outputs = []
        for row, item in enumerate(sched.scheduled):
            self._count_prompt_tokens(item)
            outputs += self._pool_chunk(item, row, result)
        return outputs

    def _pool_chunk(self, item: ScheduledSeq, row: int, result: RunnerOutput) -> list:
        """One pooling request's chunk: folded into its pooled state; after its last chunk,
        its embedding is made, it finishes and retires (its blocks are freed)."""
        seq = seq_of(item)
        request = seq.request
        if seq.is_finished or request.request_id not in self.requests:
            return []  # failed or aborted while the step was on the device
        assert self.pooler is not None and request.pooling is not None
        assert result.pooled is not None, "a pooling step without pooled outputs"
        self.pooler.add_chunk(seq.seq_id, item.start, item.num_new_tokens, result.pooled[row])
        if not item.completes_sequence:
            return []
        params = request.pooling
        classified = None if result.classified is None else result.classified[row]
        try:
            if params.task == "score":
                score = self.pooler.score(seq.seq_id, params, classified)
            elif params.task == "classify":
                probs = self.pooler.classify(params, classified)
            else:
                embedding = self.pooler.embedding(seq.seq_id, params)
        except Exception as exc:  # one bad request must not stop the batch
            _LOG.exception("request %s failed while pooling", request.request_id)
            return [self._end_request(request, repr(exc))]
        self.output_processor.finish_prompt(seq)
        self.scheduler.finish(seq)
        output = self.output_processor.make_output(request, [seq])
        if params.task == "score":
            output.score = score
        elif params.task == "classify":
            output.probs = probs
        else:
            output.embedding = embedding
        self._retire(request)
        return [output]

    def _retire(self, request: Request) -> None:
        if self.requests.pop(request.request_id, None) is not None:
            self._num_sync_requests -= request.params.has_penalties
        self.output_processor.free(request)
        self.structured_outputs.free(request)
        for seq in request.seqs:
            self.kv.forget_hashes(seq)
            if self.proposer is not None:
                self.proposer.free(seq.seq_id)
            if self.pooler is not None:
                self.pooler.free(seq.seq_id)
