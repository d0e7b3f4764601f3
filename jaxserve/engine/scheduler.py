"""Continuous batching with one token budget per step: chunked prefill and preemption.

Each step the scheduler gives every running sequence its next tokens (one for a decode, a
chunk for a prefill), then admits waiting sequences while the token budget, the sequence cap
and the block pool allow. When blocks run out, the lowest-priority (newest) running sequence
is preempted: its blocks are freed and it is recomputed later (its tokens are kept).
The result is a ``SchedulerOutput``; ``update_from_output`` advances the sequences.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.engine.kv_cache import KVCacheManager
from jaxserve.engine.request import SeqStatus, Sequence


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    # True when this step reaches the end of the known tokens (a token gets sampled); fixed
    # when scheduled, since the sequence may gain a pending token before the step is read.
    completes_sequence: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.completes_sequence = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # samples waiting for their sibling's prefill
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------

    def _priority_key(self, seq: Sequence) -> tuple[int, float]:
        return (seq.request.priority, seq.request.arrival_time)

    def add(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.WAITING_FOR_PARENT:
            self.parked.append(seq)
            return
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        if self.policy == "priority":
            self.waiting = collections.deque(sorted(self.waiting, key=self._priority_key))

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and free its blocks."""
        for queue in (self.running, self.parked):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.parked)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _victim(self, first_unscheduled: int) -> Sequence:
        """The sequence to preempt, among those not yet scheduled this step."""
        candidates = self.running[first_unscheduled:]
        if self.policy == "priority":
            return max(candidates, key=self._priority_key)
        return candidates[-1]

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and len(seq.output_token_ids) >= max_tokens:
            return 0  # its pending last token ends it: nothing more to compute
        remaining = min(seq.num_tokens, self.max_model_len) - seq.num_computed_tokens
        return min(remaining, budget)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate(seq, num_new):
                victim = self._victim(i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
                budget -= num_new
                i += 1
                continue
            # `seq` itself was preempted; the loop index now points at the next sequence.

        # 2. Waiting sequences, while budget, sequence cap and blocks allow.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
                computed = max(seq.num_computed_tokens, len(cached) * self.kv.block_size)
                remaining = seq.num_tokens - computed
                num_new = min(remaining, budget)
                if num_new < remaining and not self.enable_chunked_prefill:
                    break
                if not self.kv.allocate(seq, num_new, cached):
                    break
                self.waiting.popleft()
                if seq.num_computed_tokens == 0 and seq.num_preemptions == 0:
                    seq.request.num_cached_tokens = max(
                        seq.request.num_cached_tokens, len(cached) * self.kv.block_size
                    )
                seq.num_computed_tokens = computed
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSeq(seq, num_new, computed))
                budget -= num_new

        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted=preempted,
        )

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Advance computed-token counts after the runner executed ``output``."""
        for item in output.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens

    def release_parked(self, parent: Sequence) -> None:
        """Sibling samples of ``parent`` share its prompt blocks and join the waiting queue."""
        for seq in [s for s in self.parked if s.request is parent.request]:
            self.parked.remove(seq)
            seq.num_computed_tokens = self.kv.share_prefix(seq, parent)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        # A sequence preempted while its last token was in flight finishes from `waiting`.
        self.remove(seq)
        seq.status = SeqStatus.FINISHED
