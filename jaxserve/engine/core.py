"""EngineCore: the step loop. schedule -> run -> update -> emit.

Requests arrive through ``add_request`` / ``abort_request`` (thread-safe: the HTTP side calls
them from the event loop while ``step`` runs on the engine thread) and leave as
``RequestOutput`` deltas returned by ``step``. Stop conditions (EOS, stop token ids, stop
strings on the detokenized text, max_tokens, max_model_len) are checked here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence as Seq

from jaxserve.config import ModelConfig
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.kv_cache import KVCacheManager
from jaxserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.engine.request import PENDING_TOKEN, Request, SeqStatus, Sequence, derive_seed
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.tokenizer import Tokenizer, has_tokenizer_files
from jaxserve.runner.runner import InFlight, ModelRunner, RunnerOutput

_LOG = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served."""


class RequestError(ValueError):
    """A request the engine cannot take; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_aborted: int
    num_steps: int


def generation_eos_ids(model_dir) -> tuple[int, ...]:
    """Extra EOS ids from generation_config.json (instruct models stop on e.g. <|im_end|>)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        # XLA's GPU allocator takes its share of memory when the backend starts (no effect if
        # the process already started it).
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(config.gpu_memory_utilization)
        self.config = config
        model_dir = config.model_dir
        self.model_config = ModelConfig.from_hf_dir(model_dir)
        if config.load_format == "dummy" and not has_tokenizer_files(config.tokenizer_dir):
            _LOG.warning(
                "%s has no tokenizer: using a dummy one (token <tN> per id)", config.tokenizer_dir
            )
            self.tokenizer = Tokenizer(None, dummy_vocab_size=self.model_config.vocab_size)
        else:
            self.tokenizer = Tokenizer(config.tokenizer_dir)
        self.vocab_size = self.model_config.vocab_size
        eos = set(self.model_config.eos_token_ids) | set(generation_eos_ids(model_dir))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        # A test may pass its own runner (same interface, hand-computable tokens).
        self.runner = runner or ModelRunner(self.model_config, config, self.max_model_len)
        self.runner.eos_token_ids = self.eos_token_ids
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        for line in self.capacity_lines():
            _LOG.info(line)
        self.num_compiled_shapes = self.runner.warmup() if config.warmup else 0
        if config.warmup:
            _LOG.info(
                "Compiled %d step shapes in %.1f s (compilation cache: %s)",
                self.num_compiled_shapes,
                self.runner.compile_seconds,
                config.cache_dir,
            )
        self.requests: dict[str, Request] = {}
        self._inbox: collections.deque[Request] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()
        self._seed_rng = random.Random(config.seed)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_aborted = 0
        self.num_steps = 0
        # Asynchronous scheduling: step n + 1 is scheduled and dispatched before step n's
        # tokens are read back, so the host's work overlaps the device's. Sequences with
        # penalties need their full output history on the host, so while any such request
        # is live the engine reads each step back before scheduling the next.
        self.async_scheduling = config.async_scheduling and not self.runner.multihost
        self._in_flight: tuple[SchedulerOutput, InFlight] | None = None
        self._num_sync_requests = 0

    def shutdown(self) -> None:
        """Wait for a step still on the device, then release the follower processes of a
        multi-host replica (a no-op on one host). Call it once the step loop has stopped."""
        if self._in_flight is not None:
            self._read_in_flight()
        stop = getattr(self.runner, "stop_followers", None)
        if stop is not None:
            stop()

    # -- capacity --------------------------------------------------------------------------

    def capacity_lines(self) -> list[str]:
        return self.runner.capacity.lines()

    # -- requests (any thread) -------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> SamplingParams:
        """Check a request against the model; returns params with max_tokens filled in."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size})",
                param="prompt",
            )
        params = params.for_vocab(self.vocab_size)
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens; it must leave room for at least one "
                "generated token.",
                param="prompt",
                code="context_length_exceeded",
            )
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            return params.replace(max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.max_tokens > room:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the prompt "
                "or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return params

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = self.validate(prompt_token_ids, params)
        arrival = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=arrival,
            priority=priority,
            cache_salt=cache_salt,
            metrics=RequestMetrics(arrival_time=arrival),
        )
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        for index in range(params.num_samples):
            seq = Sequence(
                seq_id=request_id if params.num_samples == 1 else f"{request_id}#{index}",
                request=request,
                index=index,
                seed=derive_seed(base_seed, index),
                status=SeqStatus.WAITING if index == 0 else SeqStatus.WAITING_FOR_PARENT,
            )
            if params.logprobs is not None:
                seq.logprobs = []
            seq.detokenizer = self.tokenizer.detokenizer(
                request.prompt_token_ids, params.skip_special_tokens
            )
            request.seqs.append(seq)
        with self._lock:
            if request_id in self.requests or any(r.request_id == request_id for r in self._inbox):
                raise RequestError(
                    f"request id {request_id!r} is already in use", param="request_id"
                )
            self._inbox.append(request)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._in_flight or self.scheduler.has_work())

    def num_waiting(self) -> int:
        """Sequences not yet running (a request with n samples counts n)."""
        inbox = sum(r.params.num_samples for r in list(self._inbox))
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
        )

    # -- the step (engine thread) ----------------------------------------------------------

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = list(self._inbox), collections.deque()
            aborts, self._aborts = list(self._aborts), collections.deque()
        for request in new:
            self.requests[request.request_id] = request
            self._num_sync_requests += request.params.has_penalties
            for seq in request.seqs:
                self.scheduler.add(seq)
        outputs = []
        for request_id in aborts:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    self.runner.release(seq)
                    seq.drop_pending()
                    seq.status = SeqStatus.FINISHED
                    seq.finish_reason = "abort"
            self.num_aborted += 1
            outputs.append(self._make_output(request, request.seqs))
            self._retire(request)
        return outputs

    def step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        overlap = self.async_scheduling and self._num_sync_requests == 0
        if not overlap:
            outputs += self._read_in_flight()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs + self._read_in_flight()
        now = time.time()
        for item in sched.scheduled:
            metrics = item.seq.request.metrics
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        for seq in sched.preempted:
            self.runner.release(seq)
        if not overlap:
            result = self.runner.execute(sched)
            self.scheduler.update_from_output(sched)
            self.num_steps += 1
            return outputs + self._process(sched, result)
        previous = self._in_flight[1] if self._in_flight else None
        step = self.runner.dispatch(sched, previous)
        self.scheduler.update_from_output(sched)
        self.num_steps += 1
        for item in sched.scheduled:
            if item.completes_sequence:  # its token is read back after the next dispatch
                item.seq.output_token_ids.append(PENDING_TOKEN)
                item.seq.num_pending += 1
        outputs += self._read_in_flight()
        self._in_flight = (sched, step)
        return outputs

    def _read_in_flight(self) -> list[RequestOutput]:
        """Wait for the dispatched step, if any, and process its tokens."""
        if self._in_flight is None:
            return []
        sched, step = self._in_flight
        self._in_flight = None
        return self._process(sched, self.runner.collect(step))

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, list[Sequence]] = {}
        for i, item in enumerate(sched.scheduled):
            seq = item.seq
            request = seq.request
            self.prompt_tokens += max(
                0, min(item.start + item.num_new_tokens, seq.num_prompt_tokens) - item.start
            )
            if seq.index == 0 and seq.seq_id in result.prompt_logprobs:
                self._add_prompt_logprobs(seq, item.start, result.prompt_logprobs[seq.seq_id])
            if not item.completes_sequence or seq.is_finished:
                if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                    touched.setdefault(request.request_id, [])
                continue
            try:
                self._append_token(seq, result, i)
            except Exception as exc:  # one bad request must not stop the batch
                _LOG.exception("request %s failed while processing its output", request.request_id)
                seq.finish_reason, seq.stop_reason = "error", repr(exc)
            if seq.finish_reason is not None:
                seq.drop_pending()  # a token sampled past the end is discarded
                self.scheduler.finish(seq)
                self.runner.release(seq)
            if seq.index == 0 and seq.num_resolved_outputs == 1:
                self.scheduler.release_parked(seq)
            metrics = request.metrics
            if metrics is not None:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            touched.setdefault(request.request_id, []).append(seq)
        outputs = []
        for request_id, seqs in touched.items():
            request = self.requests[request_id]
            if request.params.best_of and request.params.best_of > request.params.n:
                if not request.is_finished:
                    continue
                seqs = request.seqs
            outputs.append(self._make_output(request, seqs))
            if request.is_finished:
                self._retire(request)
        return outputs

    def _append_token(self, seq: Sequence, result: RunnerOutput, row: int) -> None:
        token = int(result.token_ids[row])
        params = seq.params
        if seq.num_pending:  # the oldest pending token is this one
            seq.output_token_ids[seq.num_resolved_outputs] = token
            seq.num_pending -= 1
        else:
            seq.output_token_ids.append(token)
        self.generation_tokens += 1
        if result.logprobs is not None:
            seq.cumulative_logprob += float(result.logprobs[row])
            if seq.logprobs is not None:
                entry = {token: Logprob(float(result.logprobs[row]), int(result.ranks[row]))}
                for tid, lp in zip(
                    result.top_ids[row, : params.logprobs],
                    result.top_logprobs[row, : params.logprobs],
                    strict=True,
                ):
                    entry.setdefault(int(tid), Logprob(float(lp), None))
                rank = 1
                for tid in list(entry):
                    if entry[tid].rank is None:
                        entry[tid].rank = rank
                    rank += 1
                for tid, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
                seq.logprobs.append(entry)
        num_out = seq.num_resolved_outputs
        is_stop_token = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )
        if is_stop_token and num_out >= params.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
            return  # the stop token's text is not part of the output
        seq.text += seq.detokenizer.add([token])
        if params.stop and num_out >= params.min_tokens and self._check_stop_strings(seq):
            return
        if num_out >= params.max_tokens or seq.num_prompt_tokens + num_out >= self.max_model_len:
            seq.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(seq: Sequence) -> bool:
        params = seq.params
        longest = max(len(s) for s in params.stop)
        # Only the tail can hold a new match: the last token's text plus a stop's length.
        window_start = max(0, seq.num_text_sent - longest)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            pos = seq.text.find(stop, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        seq.text = (
            seq.text[: pos + len(stop)] if params.include_stop_str_in_output else seq.text[:pos]
        )
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _add_prompt_logprobs(self, seq: Sequence, start: int, arrays: tuple) -> None:
        request = seq.request
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        lp, ranks, top_ids, top_lp = arrays
        k = seq.params.prompt_logprobs or 0
        for j in range(len(lp)):
            token = request.prompt_token_ids[start + j + 1]
            entry = {token: Logprob(float(lp[j]), int(ranks[j]))}
            for r, (tid, v) in enumerate(zip(top_ids[j, :k], top_lp[j, :k], strict=True), start=1):
                entry.setdefault(int(tid), Logprob(float(v), r))
            for tid, value in entry.items():
                value.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
            request.prompt_logprobs.append(entry)

    def _make_output(self, request: Request, seqs: list[Sequence]) -> RequestOutput:
        params = request.params
        finished = request.is_finished
        chosen = seqs
        if params.best_of and params.best_of > params.n:
            ranked = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)
            chosen = ranked[: params.n]
        completions = []
        for out_index, seq in enumerate(chosen):
            hold = 0
            if params.stop and not seq.is_finished and not params.include_stop_str_in_output:
                hold = max(len(s) for s in params.stop) - 1  # a stop string may be starting
            text_end = max(seq.num_text_sent, len(seq.text) - hold)
            delta_text = seq.text[seq.num_text_sent : text_end]
            new_tokens = seq.output_token_ids[seq.num_tokens_sent : seq.num_resolved_outputs]
            new_logprobs = None
            if seq.logprobs is not None:
                new_logprobs = seq.logprobs[seq.num_tokens_sent :]
            seq.num_text_sent = text_end
            seq.num_tokens_sent = seq.num_resolved_outputs
            if seq.is_finished and seq.num_text_sent < len(seq.text):
                delta_text += seq.text[seq.num_text_sent :]
                seq.num_text_sent = len(seq.text)
            index = out_index if params.best_of and params.best_of > params.n else seq.index
            completions.append(
                CompletionOutput(
                    index=index,
                    text=delta_text,
                    token_ids=new_tokens,
                    cumulative_logprob=seq.cumulative_logprob
                    if params.logprobs is not None
                    else None,
                    logprobs=new_logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            if len(request.prompt_logprobs) == len(request.prompt_token_ids):
                prompt_logprobs = list(request.prompt_logprobs)
                request.prompt_logprobs_sent = True
        if finished and request.metrics is not None:
            request.metrics.finished_time = time.time()
        error = None
        if finished and any(s.finish_reason == "error" for s in request.seqs):
            error = next(str(s.stop_reason) for s in request.seqs if s.finish_reason == "error")
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            error=error,
        )

    def _retire(self, request: Request) -> None:
        if self.requests.pop(request.request_id, None) is not None:
            self._num_sync_requests -= request.params.has_penalties
        for seq in request.seqs:
            self.kv.forget_hashes(seq)
