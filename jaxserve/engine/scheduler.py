"""Continuous batching with one token budget per step: chunked prefill and preemption.

Each step the scheduler gives every running sequence its next tokens (one for a decode, a
chunk for a prefill), then admits waiting sequences while the token budget, the sequence cap
and the block pool allow. When blocks run out, the lowest-priority (newest) running sequence
is preempted: its blocks are freed and it is recomputed later (its tokens are kept).

Admission is round-robin over the waiting requests (``WaitingQueue``): a request with many
samples takes one slot per round, so it cannot hold back a request that arrived after it; and
the last ``max_num_seqs // 16`` slots (at least one) only admit requests with nothing running,
so one request cannot fill the batch and make a later one wait for a slot to free.

The result is a ``SchedulerOutput``, which also tells the runner which sequences are new and
which were preempted or finished since the last step; ``update_from_output`` advances the
sequences once the step is dispatched.
"""

from __future__ import annotations

from typing import Protocol

from jaxserve.engine.kv_cache import KVCacheManager
from jaxserve.engine.request import SeqStatus, Sequence, seq_of
from jaxserve.engine.waiting_queue import WaitingQueue
from jaxserve.lora_request import LoRARequest
from jaxserve.runner.step import ScheduledSeq, SchedulerOutput


class AdapterSlots(Protocol):
    """What the scheduler asks of the adapter slots (``runner/lora_slots.LoraSlots``)."""

    def acquire(self, request: LoRARequest) -> int | None: ...
    def release(self, slot_number: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        lora_slots: AdapterSlots | None = None,
    ) -> None:
        """``lora_slots``: the runner's adapter slots (``runner/lora_slots.py``), with LoRA on."""
        self.kv = kv
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting = WaitingQueue(by_priority=policy == "priority")
        self.num_reserved_slots = max(1, max_num_seqs // 16) if max_num_seqs > 1 else 0
        # False: no waiting sequence starts (a weight update waits for the running ones)
        self.is_admitting = True
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # samples waiting for their sibling's prefill
        self.num_preemptions = 0
        # The sampler's rows in a step (the runner's largest sequence bucket): a step's
        # sequences and drafted tokens together fit them.
        self.max_sample_rows = max_num_seqs
        # A decoding sequence with tokens in flight verifies drafts too: its verify step is
        # scheduled before the last one is read back (``runner/verify_ahead.py``), counted as
        # if every draft in flight were accepted. Set by the engine for each step.
        self.drafts_with_pending = False
        # Told to the runner with the next step that runs: their runner state goes.
        self._preempted_ids: list[str] = []
        self._finished_ids: list[str] = []

    # -- queue management ------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.WAITING_FOR_PARENT:
            self.parked.append(seq)
            return
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it, free its blocks, and tell the
        runner with the next step."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING_FOR_PARENT:
            self.parked.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._release_adapter(seq)
        self._finished_ids.append(seq.seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.parked)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        self._release_adapter(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)
        self._preempted_ids.append(seq.seq_id)

    def _victim(self, first_unscheduled: int) -> Sequence:
        """The sequence to preempt, among those not yet scheduled this step."""
        candidates = self.running[first_unscheduled:]
        if self.policy == "priority":
            return max(candidates, key=WaitingQueue.priority_key)
        return candidates[-1]

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and len(seq.output_token_ids) >= max_tokens:
            return 0  # its pending last token ends it: nothing more to compute
        remaining = min(seq.num_tokens, self.max_model_len) - seq.num_computed_tokens
        return min(remaining, budget)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """The step's work. ``drafts`` (speculative decoding): seq id -> tokens drafted after
        its last one; a decoding sequence verifies what the step's budget, its blocks, its
        ``max_tokens`` and the sampler's ``max_sample_rows`` leave of them (``_with_draft``)."""
        num_preempted = len(self._preempted_ids)
        scheduled, budget = self._schedule_running(self.max_num_batched_tokens, drafts or {})
        # drafted tokens scheduled: each takes a row of the sampler
        num_drafted = sum(len(item.draft_token_ids) for item in scheduled)

        # 2. Waiting sequences, round-robin over requests, while budget, sequence cap and
        # blocks allow (none after a preemption: the pool is short). The last few slots are
        # kept for groups with nothing running, so a request that arrives while a large one
        # fills the batch starts at the next step instead of waiting for a slot to free.
        if self.is_admitting and len(self._preempted_ids) == num_preempted:
            open_slots = self.max_num_seqs - self.num_reserved_slots
            running_groups: set[str] | None = None
            for seq in self.waiting.round_robin():
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                if len(scheduled) + num_drafted >= self.max_sample_rows:
                    break
                if len(self.running) >= open_slots:
                    if running_groups is None:
                        running_groups = {s.request.group_id for s in self.running}
                    if seq.request.group_id in running_groups:
                        continue
                    running_groups.add(seq.request.group_id)
                if not self._acquire_adapter(seq):
                    continue  # every adapter slot is held: it waits, others may start
                num_new = self._admit(seq, budget)
                if num_new == 0:
                    self._release_adapter(seq)
                    break
                scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens, True))
                budget -= num_new
            self.waiting.remove_admitted()

        output = SchedulerOutput(scheduled, self.max_num_batched_tokens - budget)
        if scheduled:  # lifecycle notices travel with the next step that runs
            output.preempted_seq_ids, self._preempted_ids = self._preempted_ids, []
            output.finished_seq_ids, self._finished_ids = self._finished_ids, []
        return output

    def _schedule_running(
        self, budget: int, drafts: dict[str, list[int]]
    ) -> tuple[list[ScheduledSeq], int]:
        """Running sequences, oldest first, with their drafts; preempt from the back when
        blocks run out. The step's entries so far and the budget left."""
        scheduled: list[ScheduledSeq] = []
        num_drafted = 0
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
                if victim is seq:
                    break
            else:
                item = ScheduledSeq(seq, num_new, seq.num_computed_tokens)
                if seq.seq_id in drafts:  # its drafts verified, as the budget allows
                    item = self._with_draft(item, drafts[seq.seq_id], budget, num_drafted)
                    num_drafted += len(item.draft_token_ids)
                scheduled.append(item)
                budget -= item.num_new_tokens
                i += 1
                continue
            # `seq` itself was preempted; the loop index now points at the next sequence.
        return scheduled, budget

    def _with_draft(
        self, item: ScheduledSeq, draft: list[int], budget: int, num_drafted: int
    ) -> ScheduledSeq:
        """A decoding sequence's step with its drafted tokens to verify: as many as the token
        budget, the sampler's rows (``max_sample_rows``, the running sequences each keeping
        one) and the block pool allow (a draft never preempts), and no more than the sequence
        could use: ``max_tokens`` and ``max_model_len`` (the token after the last draft is
        sampled too)."""
        seq = seq_of(item)
        if item.num_new_tokens != 1 or not item.completes_sequence:
            return item
        if seq.num_pending and not self.drafts_with_pending:
            return item
        room = self.max_model_len - seq.num_tokens - 1
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(seq.output_token_ids) - 1)
        rows_left = self.max_sample_rows - len(self.running) - num_drafted
        k = min(len(draft), budget - 1, rows_left, room)
        if k <= 0 or not self.kv.allocate(seq, 1 + k):
            return item
        return ScheduledSeq(seq, 1 + k, item.start, item.is_new, list(draft[:k]))

    def reject_drafts(self, seq: Sequence, num_rejected: int) -> None:
        """A verify step's rejected drafts: their KV is not the sequence's (slots past
        ``num_computed_tokens`` are written again by the steps that follow). A sequence no
        longer running (finished, or preempted while a later step was in flight: its count
        starts again from zero) keeps its count."""
        if seq.status == SeqStatus.RUNNING:
            seq.num_computed_tokens -= num_rejected

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """A device slot for the sequence's adapter (``seq.lora_slot``); False when none is
        free. True for a sequence of the base model."""
        lora = seq.request.lora_request
        if lora is None or self.lora_slots is None:
            return True
        slot = self.lora_slots.acquire(lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot and self.lora_slots is not None:
            self.lora_slots.release(seq.lora_slot)
        seq.lora_slot = 0

    def restore_notices(self, output: SchedulerOutput) -> None:
        """Tell the runner ``output``'s preemptions and finishes again with the next step (the
        step of ``output`` did not run)."""
        self._preempted_ids[:0] = output.preempted_seq_ids
        self._finished_ids[:0] = output.finished_seq_ids

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move a waiting sequence to running with blocks for its next chunk; returns the
        chunk's tokens, or 0 (nothing changed) when it does not fit."""
        reads_cache = seq.num_computed_tokens == 0 and seq.request.reads_prefix_cache
        cached = self.kv.find_cached_prefix(seq) if reads_cache else []
        computed = max(seq.num_computed_tokens, len(cached) * self.kv.block_size)
        remaining = seq.num_tokens - computed
        num_new = min(remaining, budget)
        if num_new < remaining and not self.enable_chunked_prefill:
            return 0
        if not self.kv.allocate(seq, num_new, cached):
            return 0
        self.waiting.mark_admitted(seq)
        if seq.num_computed_tokens == 0 and seq.num_preemptions == 0:
            seq.request.num_cached_tokens = max(
                seq.request.num_cached_tokens, len(cached) * self.kv.block_size
            )
        seq.num_computed_tokens = computed
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return num_new

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Advance computed-token counts after the runner executed ``output``."""
        for item in output.scheduled:
            seq_of(item).num_computed_tokens = item.start + item.num_new_tokens

    def release_parked(self, parent: Sequence) -> None:
        """Sibling samples of ``parent`` share its prompt blocks and join the waiting queue."""
        for seq in [s for s in self.parked if s.request is parent.request]:
            self.parked.remove(seq)
            seq.num_computed_tokens = self.kv.share_prefix(seq, parent)
            seq.status = SeqStatus.WAITING
            self.waiting.push_front(seq)

    def finish(self, seq: Sequence) -> None:
        # A sequence preempted while its last token was in flight finishes from `waiting`.
        self.remove(seq)
        seq.status = SeqStatus.FINISHED
