"""Host-side request state: one ``Request`` per client request, one ``Sequence`` per sample.

A request with ``n`` (or ``best_of``) > 1 fans out into that many sequences. Sequence 0
prefills the prompt; the others start once it has, sharing its full prompt blocks (ref
counted) and recomputing only the partial last block: copy-on-write by recompute.

Each field of a ``Sequence`` has one writer (docs/architecture.md): the scheduler its queue
state (``status``, ``num_computed_tokens``, ``num_preemptions``), the KV-cache manager its
``block_ids``, the engine core its tokens (through the pending-token methods below) and its
finish. The runner's per-row state and the output processor's text and logprobs live in those
components, keyed by ``seq_id``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from typing import Any, cast

from jaxserve.engine.outputs import Logprob, RequestMetrics
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.step import PENDING_TOKEN, ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new or preempted)
    WAITING_FOR_PARENT = "waiting_for_parent"  # sample i > 0 waits for sample 0's prefill
    RUNNING = "running"
    FINISHED = "finished"


def derive_seed(seed: int, index: int) -> int:
    """A 32-bit sampling seed for sample ``index`` of a request seeded with ``seed``."""
    if index == 0 and 0 <= seed < 2**32:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int  # the sample index (CompletionOutput.index)
    seed: int  # 32-bit seed of the sampling key
    # Generated tokens; the last few may be PENDING_TOKEN (asynchronous scheduling: sampled by
    # a dispatched step, not read back yet; one a step, or a verify step's drafts and one more,
    # counted as if all were accepted). Written only by the methods below.
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_pending: int = 0  # trailing PENDING_TOKEN entries of output_token_ids
    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    # The device slot of its adapter while it runs (the scheduler acquires and releases it);
    # 0: the base model, or not running.
    lora_slot: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def token_type_ids(self) -> list[int] | None:
        return self.request.token_type_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_resolved_outputs(self) -> int:
        """Output tokens known on the host (the pending ones excluded)."""
        return len(self.output_token_ids) - self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host knows (pending ones excluded)."""
        return self.num_tokens - self.num_pending

    # -- the pending-token protocol (asynchronous scheduling) ------------------------------

    def add_pending(self) -> None:
        """A dispatched step will sample this sequence's next token."""
        self.output_token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def append_token(self, token: int) -> None:
        """A sampled token read back: it replaces the oldest pending entry, if any."""
        if self.num_pending:
            self.output_token_ids[self.num_resolved_outputs] = token
            self.num_pending -= 1
        else:
            self.output_token_ids.append(token)

    def drop_pending(self, count: int | None = None) -> None:
        """Forget tokens still in flight (the sequence finished or was aborted); ``count``:
        only the oldest ``count`` of them (a verify step read back gave fewer tokens than it
        was counted for: its rejected drafts, while a later step is in flight)."""
        if count is None:
            count = self.num_pending
        count = min(count, self.num_pending)
        if count > 0:
            first = self.num_resolved_outputs
            del self.output_token_ids[first : first + count]
            self.num_pending -= count

    @property
    def last_token_id(self) -> int:
        return (
            self.output_token_ids[-1]
            if self.output_token_ids
            else self.request.prompt_token_ids[-1]
        )

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        prompt = self.request.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # Requests submitted together (the prompts of one API call) share one turn of admission;
    # "" means a group of its own.
    group_id: str = ""
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    # The compiled constraint (structured outputs), handed to StructuredOutputs, its owner,
    # when the request joins the step loop; None without one.
    grammar: Any = None
    # A pooling request (an embedding): its prompt runs, in chunks like a prefill, and it ends
    # when the last chunk has run; nothing is sampled (``params`` is a neutral placeholder).
    pooling: PoolingParams | None = None
    # False: its prompt is computed whole, never taken from the prefix cache (a pooling that
    # needs every token's hidden state: mean, CLS).
    reads_prefix_cache: bool = True
    # An encoder's token type per prompt token (0 / 1 for the two texts of a BERT pair, as the
    # tokenizer gives them); None: all 0.
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    # True: one output when it finishes, holding everything (vLLM's FINAL_ONLY: ``LLM``'s
    # generate, which reads no deltas); False: a delta after every step that gives it tokens.
    final_only: bool = False

    @property
    def prefix_cache_key(self) -> str | None:
        """What its blocks' hashes take in besides the tokens: the cache salt and the
        adapter, so neither tenants nor adapters share blocks."""
        if self.lora_request is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}|{self.lora_request.cache_key}"

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    def add_samples(self, base_seed: int) -> None:
        """One sequence per sample: the first waits for admission, the others for its prompt
        (they share its KV blocks once it is prefilled)."""
        num = self.params.num_samples
        for index in range(num):
            seq_id = self.request_id if num == 1 else f"{self.request_id}#{index}"
            status = SeqStatus.WAITING if index == 0 else SeqStatus.WAITING_FOR_PARENT
            seed = derive_seed(base_seed, index)
            self.seqs.append(Sequence(seq_id, request=self, index=index, seed=seed, status=status))

    @functools.cached_property
    def returns_best_of(self) -> bool:
        """best_of > n: only the n best samples are returned, once all have finished."""
        return (self.params.best_of or 0) > self.params.n

    @property
    def is_finished(self) -> bool:
        # (a loop, not all() over a generator: twice a request a step, at every batch size)
        for seq in self.seqs:
            if seq.status is not SeqStatus.FINISHED:
                return False
        return True


def seq_of(item: ScheduledSeq) -> Sequence:
    """The engine's own ``Sequence`` behind a step's entry (the runner sees a ``StepSequence``)."""
    return cast(Sequence, item.seq)


def mark_scheduled(sched: SchedulerOutput, now: float) -> None:
    """Note the first time each scheduled sequence's request got a step."""
    for item in sched.scheduled:
        metrics = seq_of(item).request.metrics
        if metrics is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
