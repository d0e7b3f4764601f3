"""StructuredOutputs: each constrained sequence's grammar matcher, and the step's token masks.

Owns the per-sequence grammar state (docs/architecture.md). A request's compiled grammar
(``grammar.py``) comes with ``add_request``; a sequence gets its own copy when the scheduler
first runs it (``ScheduledSeq.is_new``), replaying the tokens it already has (after a
preemption), and loses it when the scheduler names it preempted or finished, or when its
request retires. In the output path the engine feeds a step's tokens, all at once, to
``accept_tokens``, which says which grammars are complete (those sequences then stop) and
which token broke its grammar; then ``start_masks`` fills the next step's allowed tokens into
a packed mask of its own on a worker thread while the engine handles the rest of the step's
output, and the engine hands the mask (the future's result) to ``Runner.sample``. With
``reasoning_end`` set, a sequence's tokens reach its matcher only once those ids have been
generated; with ``reasoning_start`` too, the reasoning section is the model's choice: the first
token may be that id (then the grammar waits for ``reasoning_end``) or any the grammar allows
(then it holds from the first token). Requests without a constraint have no entry and cost nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import sys
from typing import Any

import numpy as np

from jaxserve.engine.grammar import short_error
from jaxserve.engine.request import Request, Sequence, seq_of
from jaxserve.engine.spec_decode import accepted_run
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.units import cdiv


@dataclasses.dataclass
class _SeqGrammar:
    matcher: Any  # llguidance.LLMatcher: the tokens accepted so far
    reasoning_end: tuple[int, ...]  # ids that open the constrained part; () = from the start
    # The one id that may open a reasoning section as the first token, the grammar holding
    # otherwise (None: no choice left; reasoning_end alone says whether it waits).
    may_open: int | None = None
    opened_end: tuple[int, ...] = ()  # the reasoning_end of a section ``may_open`` opened
    recent: list[int] = dataclasses.field(default_factory=list)  # the last len(end) tokens

    @classmethod
    def of(cls, matcher: Any, spec: StructuredOutputsParams | None) -> _SeqGrammar:
        end = spec.reasoning_end if spec is not None else ()
        if spec is not None and end and len(spec.reasoning_start) == 1:  # the model's choice
            return cls(matcher, (), may_open=spec.reasoning_start[0], opened_end=end)
        return cls(matcher, end)

    @property
    def is_active(self) -> bool:
        return not self.reasoning_end

    def opens_reasoning(self, token: int) -> bool:
        """The first token decides: ``may_open`` starts a reasoning section (True), any other
        is the grammar's."""
        opening, self.may_open = self.may_open, None
        if opening is not None and token == opening:
            self.reasoning_end = self.opened_end
            return True
        return False

    def watch(self, token: int) -> None:
        """A token of the unconstrained part: the constraint starts after ``reasoning_end``."""
        self.recent = (self.recent + [token])[-len(self.reasoning_end) :]
        if tuple(self.recent) == self.reasoning_end:
            self.reasoning_end = ()  # what follows is constrained

    def replay(self, token: int) -> None:
        if self.opens_reasoning(token):
            return
        if not self.is_active:
            self.watch(token)
        elif not self.matcher.consume_token(token):
            error = short_error(self.matcher.get_error())
            raise RuntimeError(f"token {token} broke the constraint: {error}")


@dataclasses.dataclass
class Accepted:
    """What a step's tokens did to the grammars: complete ones, and tokens a grammar refused."""

    complete: set[str] = dataclasses.field(default_factory=set)  # seq ids
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # seq id -> why
    # A verify step's sequence (speculative decoding) whose grammar completed, or refused a
    # token, inside its run: the tokens it keeps, up to that one (seq id -> count).
    cut: dict[str, int] = dataclasses.field(default_factory=dict)


# NOTE: while a mask fills, the interpreter hands the GIL between threads every 0.1 ms instead of
# every 5 ms: the worker needs the GIL only to enter llguidance (which then releases it), and at
# the default interval it waited for the engine thread's Python to finish, so the fill ran after
# the output work instead of beside it (H200, batch 64: 1.47 ms waited of a 1.34 ms fill).
MASK_SWITCH_INTERVAL_S = 1e-4


class StructuredOutputs:
    def __init__(self, vocab_size: int) -> None:
        self.mask_width = cdiv(vocab_size, 32)  # i32 words of one packed row
        self._grammars: dict[str, Any] = {}  # request_id -> its compiled grammar
        self._seqs: dict[str, _SeqGrammar] = {}  # seq_id -> its matcher
        self._executor: Any = None  # llguidance.LLExecutor, made with the first mask
        # NOTE: one worker: the mask of step n + 1 fills (llguidance's Rust releases the GIL and
        # spreads the rows over its own threads) while the engine thread turns step n's tokens
        # into outputs; only one mask is ever in flight.
        self._mask_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending_mask: concurrent.futures.Future[np.ndarray] | None = None
        self._masks = np.zeros((0, self.mask_width), np.int32)  # i32[rows, W], reused
        self._switch_interval = sys.getswitchinterval()

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
                state = _SeqGrammar.of(grammar.deep_copy(), seq.params.structured_outputs)
                for token in seq.output_token_ids[: seq.num_resolved_outputs]:
                    state.replay(token)  # a resumed sequence's tokens so far
                self._seqs[seq.seq_id] = state

    def accept_step(self, sched: SchedulerOutput, result: RunnerOutput) -> Accepted:
        """A step's sampled tokens through the grammars of the sequences that have one (not
        those of a request whose part of the step failed: it ends). A sequence that verified
        drafts takes its accepted run, token by token (``_accept_run``)."""
        if not self._seqs:
            return Accepted()
        scheduled = sched.scheduled
        failed = {seq_of(i).request.request_id for i in scheduled if i.seq.seq_id in result.failed}
        tokens = []
        runs = []
        for item, row in zip(scheduled, sched.sample_rows(), strict=True):
            seq = seq_of(item)
            if item.completes_sequence and not seq.is_finished:
                if seq.request.request_id in failed:
                    continue
                if item.draft_token_ids:
                    runs.append((seq, accepted_run(item.draft_token_ids, result.token_ids, row)))
                else:
                    tokens.append((seq, int(result.token_ids[row])))
        accepted = self.accept_tokens(tokens)
        for seq, run in runs:
            self._accept_run(seq, run, accepted)
        return accepted

    def _accept_run(self, seq: Sequence, run: list[int], accepted: Accepted) -> None:
        """A verify step's tokens through the sequence's grammar, in order, up to the one that
        completes it or that it refuses (``Accepted.cut``). Its drafts were cut to what the
        grammar takes (``cut_drafts``) and each position sampled under its mask, so a refusal
        is a bug, reported as without speculation."""
        state = self._seqs.get(seq.seq_id)
        if state is None or not state.is_active:
            return
        for j, token in enumerate(run):
            if not state.matcher.consume_token(token):
                error = short_error(state.matcher.get_error())
                accepted.errors[seq.seq_id] = f"token {token} broke the constraint: {error}"
            elif state.matcher.is_stopped():
                accepted.complete.add(seq.seq_id)
            else:
                continue
            accepted.cut[seq.seq_id] = j + 1
            return

    def cut_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts cut at the first token the sequence's grammar refuses (speculative decoding:
        nothing the grammar refuses is verified). A sequence whose constraint has not started
        (a reasoning section, or the choice to open one) drafts nothing."""
        if not self._seqs:
            return drafts
        for seq_id, draft in drafts.items():
            state = self._seqs.get(seq_id)
            if state is None:
                continue
            if not state.is_active or state.may_open is not None or state.matcher.is_stopped():
                drafts[seq_id] = []
            else:
                drafts[seq_id] = draft[: state.matcher.validate_tokens(draft)]
        return drafts

    def accept_tokens(self, tokens: list[tuple[Sequence, int]]) -> Accepted:
        """Advance the matchers of these sequences by the tokens read back, in one parallel
        call; which grammars are now complete (nothing more may follow) and which refused."""
        accepted = Accepted()
        active = []
        for seq, token in tokens:
            state = self._seqs.get(seq.seq_id)
            if state is None:
                continue
            if state.opens_reasoning(token):
                continue
            if state.is_active:
                active.append((seq.seq_id, state, token))
            else:
                state.watch(token)
        if not active:
            return accepted
        oks = self.executor.consume_token_par([(state.matcher, t) for _, state, t in active])
        for (seq_id, state, token), ok in zip(active, oks, strict=True):
            if not ok:
                error = short_error(state.matcher.get_error())
                accepted.errors[seq_id] = f"token {token} broke the constraint: {error}"
            elif state.matcher.is_stopped():
                accepted.complete.add(seq_id)
        return accepted

    def start_masks(self, sched: SchedulerOutput) -> concurrent.futures.Future[np.ndarray]:
        """The token masks of a step, filled on the worker thread: i32[num_scheduled, W], row
        i the allowed next tokens (bit v % 32 of word v // 32) of scheduled sequence i; rows
        without an active matcher allow every token, and a row whose first token may open a
        reasoning section also allows that id. The array is this object's own, valid until
        the next ``start_masks``; the future raises what the fill raised."""
        rows: list[tuple[Any, int]] = []
        openings: list[tuple[int, int]] = []
        free_rows: list[int] = []
        drafted: list[tuple[Any, int, list[int]]] = []
        for item, i in zip(sched.scheduled, sched.sample_rows(), strict=True):
            state = self._seqs.get(item.seq.seq_id)
            drafts = item.draft_token_ids
            if item.completes_sequence and state is not None and state.is_active:
                if drafts:  # a row per position, the grammar advanced through the drafts
                    free_rows.extend(range(i, i + len(drafts) + 1))
                    drafted.append((state.matcher, i, list(drafts)))
                    continue
                if not state.matcher.is_stopped():
                    rows.append((state.matcher, i))
                    if state.may_open is not None:
                        openings.append((i, state.may_open))
                    continue
            free_rows.extend(range(i, i + len(drafts) + 1))
        if self._mask_worker is None:
            self._mask_worker = concurrent.futures.ThreadPoolExecutor(1, "token-masks")
        pending = self._pending_mask
        assert pending is None or pending.done(), "one mask at a time"
        num_rows = sum(item.num_sampled for item in sched.scheduled)
        if len(self._masks) < num_rows:
            self._masks = np.zeros((num_rows, self.mask_width), np.int32)
        masks = self._masks[:num_rows]
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(MASK_SWITCH_INTERVAL_S)
        fill = functools.partial(self._fill, rows, openings, free_rows, masks, drafted)
        self._pending_mask = self._mask_worker.submit(fill)
        return self._pending_mask

    def _fill(
        self,
        rows: list[tuple[Any, int]],
        openings: list[tuple[int, int]],
        free_rows: list[int],
        masks: np.ndarray,
        drafted: list[tuple[Any, int, list[int]]],
    ) -> np.ndarray:
        import llguidance.numpy

        try:
            masks[free_rows] = -1  # llguidance writes every word of the other rows
            if rows:
                llguidance.numpy.fill_next_token_bitmask_par(self.executor, rows, masks)
            if drafted:  # rows past a completed grammar stay open: those tokens are cut
                fill = llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens
                fill(self.executor, drafted, masks)
            words = masks.view(np.uint32)
            for row, token in openings:
                words[row, token // 32] |= np.uint32(1 << (token % 32))
            return masks
        finally:  # the fill is done: the engine thread keeps the GIL as long as it likes
            sys.setswitchinterval(self._switch_interval)

    @property
    def executor(self) -> Any:  # llguidance.LLExecutor
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def close(self) -> None:
        if self._mask_worker is not None:
            self._mask_worker.shutdown()
