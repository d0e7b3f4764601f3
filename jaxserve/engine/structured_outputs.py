"""StructuredOutputs: each constrained sequence's grammar matcher, and the step's token masks.

Owns the per-sequence grammar state (docs/architecture.md). A request's compiled grammar
(``grammar.py``) comes with ``add_request``; a sequence gets its own copy when the scheduler
first runs it (``ScheduledSeq.is_new``), replaying the tokens it already has (after a
preemption), and loses it when the scheduler names it preempted or finished, or when its
request retires. In the output path the engine feeds each token read back to
``accept_token``, which says when the grammar is complete (the sequence then stops); before
the sampler of a step runs, ``token_masks`` packs each sequence's allowed tokens. With
``reasoning_end`` set, a sequence's tokens reach its matcher only once those ids have been
generated. Requests without a constraint have no entry and cost nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.engine.request import Request, Sequence, seq_of
from jaxserve.runner.step import SchedulerOutput


@dataclasses.dataclass
class _SeqGrammar:
    matcher: Any  # llguidance.LLMatcher: the tokens accepted so far
    reasoning_end: tuple[int, ...]  # ids that open the constrained part; () = from the start
    recent: list[int] = dataclasses.field(default_factory=list)  # the last len(end) tokens

    @property
    def is_active(self) -> bool:
        return not self.reasoning_end

    def accept(self, token: int) -> None:
        if self.is_active:
            if not self.matcher.consume_token(token):
                raise RuntimeError(
                    f"token {token} broke the constraint: {self.matcher.get_error()}"
                )
            return
        self.recent = (self.recent + [token])[-len(self.reasoning_end) :]
        if tuple(self.recent) == self.reasoning_end:
            self.reasoning_end = ()  # what follows is constrained


class StructuredOutputs:
    def __init__(self, vocab_size: int) -> None:
        self.mask_width = -(-vocab_size // 32)  # i32 words of one packed row
        self._grammars: dict[str, Any] = {}  # request_id -> its compiled grammar
        self._seqs: dict[str, _SeqGrammar] = {}  # seq_id -> its matcher
        self._executor: Any = None  # llguidance.LLExecutor, made with the first mask

    @property
    def num_matchers(self) -> int:
        return len(self._seqs)

    def add_request(self, request: Request, grammar: Any) -> None:
        self._grammars[request.request_id] = grammar

    def free(self, request: Request) -> None:
        if self._grammars.pop(request.request_id, None) is not None:
            for seq in request.seqs:
                self._seqs.pop(seq.seq_id, None)

    def is_constrained(self, sched: SchedulerOutput) -> bool:
        """Whether a sequence that samples in this step has a matcher."""
        return bool(self._seqs) and any(
            item.completes_sequence and item.seq.seq_id in self._seqs for item in sched.scheduled
        )

    def update_states(self, sched: SchedulerOutput) -> None:
        """Free the matchers of preempted and finished sequences, then make new sequences'."""
        if not self._grammars:
            return
        for seq_id in (*sched.preempted_seq_ids, *sched.finished_seq_ids):
            self._seqs.pop(seq_id, None)
        for item in sched.scheduled:
            seq = seq_of(item)
            grammar = self._grammars.get(seq.request.request_id)
            if item.is_new and grammar is not None and seq.seq_id not in self._seqs:
                spec = seq.params.structured_outputs
                state = _SeqGrammar(grammar.deep_copy(), spec.reasoning_end if spec else ())
                for token in seq.output_token_ids[: seq.num_resolved_outputs]:
                    state.accept(token)  # a resumed sequence's tokens so far
                self._seqs[seq.seq_id] = state

    def accept_token(self, seq: Sequence, token: int) -> bool:
        """Advance ``seq``'s matcher by the token read back; True when the grammar is complete
        (nothing more may follow)."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return False
        state.accept(token)
        return state.is_active and state.matcher.is_stopped()

    def token_masks(self, sched: SchedulerOutput) -> np.ndarray:
        """i32[num_scheduled, W]: each scheduled sequence's allowed next tokens, packed (bit
        v % 32 of word v // 32); every bit set for a sequence without an active matcher."""
        import llguidance
        import llguidance.numpy

        masks = np.full((len(sched.scheduled), self.mask_width), -1, np.int32)
        rows = []
        for i, item in enumerate(sched.scheduled):
            state = self._seqs.get(item.seq.seq_id)
            if item.completes_sequence and state is not None and state.is_active:
                if not state.matcher.is_stopped():
                    rows.append((state.matcher, i))
        if rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, masks)
        return masks
