"""The hand-off of one step between the engine and the runner, in both directions.

Down: the scheduler's ``SchedulerOutput`` names every sequence of the step and its lifecycle,
the way vLLM v1's does: ``ScheduledSeq.is_new`` for a sequence the runner has not seen (first
scheduled, or again after a preemption), ``preempted_seq_ids`` and ``finished_seq_ids`` for the
ones whose runner state (a persistent row) must go. The runner creates and frees its own state
from these; the engine never touches it. Up: ``RunnerOutput``, the sampled tokens of the step
(and logprobs when asked), copied to the host.

The types live here, below the engine, so the runner imports nothing from ``jaxserve.engine``;
the engine's ``Sequence`` satisfies ``StepSequence`` structurally.

Asynchronous scheduling (docs/architecture.md): an output token that a dispatched step will
sample, not yet read back, is ``PENDING_TOKEN`` in the host's token lists. A step whose input
is a pending token takes it, on the device, from the previous step's sampled ids.

Speculative decoding with a model drafter: its drafts may stay on the device (``DeviceDrafts``).
The host schedules the verify step with ``PENDING_TOKEN`` in their place, the step takes them
from the drafter's output on the device, and the host reads their values once it reads the
step back: one wait a step instead of two.

A pooling runner (``--runner pooling``) runs prompts only: a step's sequences are prompt chunks,
nothing is sampled, and ``RunnerOutput.pooled`` carries what pooling needs of each chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from jaxserve.sampling_params import SamplingParams

PENDING_TOKEN = -1


class StepSequence(Protocol):
    """What the runner reads of a scheduled sequence (and never writes)."""

    @property
    def seq_id(self) -> str: ...
    @property
    def index(self) -> int: ...  # the sample index; sample 0 prefills the shared prompt
    @property
    def seed(self) -> int: ...  # u32 seed of its sampling key
    @property
    def params(self) -> SamplingParams: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...  # may end in PENDING_TOKEN entries
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def last_token_id(self) -> int: ...
    @property
    def lora_slot(self) -> int: ...  # its adapter's device slot, 0: the base model
    def token_ids(self, start: int, stop: int) -> list[int]: ...
    @property
    def token_type_ids(self) -> list[int] | None: ...  # an encoder pair's (tokenizer's); or None


@dataclasses.dataclass
class ScheduledSeq:
    seq: StepSequence
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    is_new: bool = False  # the runner has no state for it yet (first run, or after preemption)
    # Speculative decoding: tokens drafted after the sequence's last one, verified in this
    # step; they are the last len(draft_token_ids) of its num_new_tokens, and the step
    # samples a token at each of its last len + 1 positions (``SchedulerOutput.sample_rows``).
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    # True when this step reaches the end of the known tokens (a token gets sampled); fixed
    # when scheduled, since the sequence may gain a pending token before the step is read.
    completes_sequence: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        known = self.num_new_tokens - len(self.draft_token_ids)
        self.completes_sequence = self.start + known == self.seq.num_tokens

    @property
    def num_sampled(self) -> int:
        """Tokens sampled for it in this step: one per draft and one more (a sequence that
        does not complete samples one all the same, discarded, as every row of the sampler)."""
        return len(self.draft_token_ids) + 1


@dataclasses.dataclass(eq=False)  # a handle on device values: equal only to itself
class DeviceDrafts:
    """A drafter's tokens left on the device for the verify step to read: the scheduler got
    ``placeholders`` (their count, each ``PENDING_TOKEN``), the runner feeds the values to the
    step on the device (``ModelRunner.dispatch``), and ``fill`` gives the host their values
    after the step is read back, before anything compares them with the sampled tokens."""

    ids: Any  # i32[S, W] on the device: row s holds the drafts of rows' sequence s
    rows: dict[str, int]  # seq id -> its row of ``ids``
    k: int  # drafts each sequence offers (at most W)

    def placeholders(self) -> dict[str, list[int]]:
        return {seq_id: [PENDING_TOKEN] * self.k for seq_id in self.rows}

    def on_host(self) -> dict[str, list[int]]:
        """seq id -> its drafts' values (one copy to the host: it waits for the drafter)."""
        values = np.asarray(self.ids)
        return {seq_id: values[row, : self.k].tolist() for seq_id, row in self.rows.items()}

    def fill(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Each scheduled sequence's drafts, as many as it verifies, with their values (after
        the step that read them, the drafter's program is done)."""
        drafts = self.on_host()
        for item in scheduled:
            if item.draft_token_ids and item.seq.seq_id in drafts:
                item.draft_token_ids = drafts[item.seq.seq_id][: len(item.draft_token_ids)]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_batched_tokens: int
    preempted_seq_ids: list[str] = dataclasses.field(default_factory=list)
    # Finished or aborted since the previous step: their runner state is freed.
    finished_seq_ids: list[str] = dataclasses.field(default_factory=list)
    # A sequence that samples in this step follows a grammar (set by the engine): the step's
    # sampler takes a token mask, which ``Runner.sample`` receives once the host has built it.
    is_constrained: bool = False
    # The drafts' values on the device (set by the engine), their places in ``scheduled``
    # held by ``PENDING_TOKEN``; None: every draft is on the host.
    device_drafts: DeviceDrafts | None = None
    # Set by the engine when the step's sampled tokens were counted in its sequences before
    # it was read back (asynchronous scheduling: ``Sequence.add_pending``, one for each row
    # a sequence samples, as if every draft were accepted).
    tokens_in_flight: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_drafts(self) -> bool:
        return any(item.draft_token_ids for item in self.scheduled)

    def sample_rows(self) -> list[int]:
        """Each scheduled sequence's first row in the step's sampled tokens (``RunnerOutput``):
        one row per sequence, and one more per drafted token (its row i + j samples the token
        after draft j)."""
        rows, row = [], 0
        for item in self.scheduled:
            rows.append(row)
            row += item.num_sampled
        return rows


@dataclasses.dataclass
class RunnerOutput:
    # i32[R]  one sampled token per scheduled sequence, in order, and one more per drafted
    # token (``SchedulerOutput.sample_rows``); the logprobs' rows are the same
    token_ids: np.ndarray
    logprobs: np.ndarray | None = None  # f32[S]
    ranks: np.ndarray | None = None  # i32[S]
    top_ids: np.ndarray | None = None  # i32[S, K]
    top_logprobs: np.ndarray | None = None  # f32[S, K]
    # seq_id -> (logprob[n], rank[n], top_ids[n, K], top_lp[n, K]) for the chunk's next tokens
    prompt_logprobs: dict[str, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)
    # f32[S, 3, H], a pooling runner's (``--runner pooling``; its token_ids are empty: it never
    # samples): per scheduled sequence, the sum of its hidden states in this step, its first
    # token's and its last token's (``programs.pool_step``)
    pooled: np.ndarray | None = None
    # f32[S, L], an encoder sequence classifier's (a cross-encoder, ``runner/encoder_runner.py``):
    # per scheduled sequence, the logits of its classification head on its first token
    classified: np.ndarray | None = None
    # seq_id -> error, for sequences whose part of the step failed on the device (their prompt
    # logprobs ran out of memory, say): their requests fail, the rest of the batch carries on
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
