"""Host-side step inputs: ``SchedulerOutput`` -> padded numpy arrays for one shape bucket.

Plain Python and numpy, no device work, so the per-step host cost can be measured alone
(benchmarks/host_overhead.py). Each running sequence owns a row of persistent tables (its
page table and its sampling parameters): the builder creates the row when the scheduler names
the sequence new, extends its page table as it gains blocks, and frees it when the scheduler
names it preempted or finished. A step gathers the rows it needs with one fancy index, so the
per-sequence Python work of a decode step is a few attribute reads.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jaxserve.models.batch import Batch
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.sampling import (
    NUM_TOP_LOGPROBS,
    ROW_FIELDS,
    SamplerFlags,
    SamplingInputs,
    mask_width,
    row_values,
)
from jaxserve.runner.step import PENDING_TOKEN, SchedulerOutput, StepSequence
from jaxserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS


class Need(enum.IntEnum):
    """The columns of ``InputBuilder.needs``: what a sequence asks of the sampler."""

    SORT = 0  # top-k or top-p
    PENALTIES = 1  # presence, frequency or repetition
    BIAS = 2  # a logit bias of its own
    LOGPROBS = 3
    NOISE = 4  # temperature > 0: a sampled, not greedy, token


@dataclasses.dataclass
class _Row:
    index: int  # the row of the persistent tables
    num_synced_blocks: int = 0  # leading block ids already written to its page table
    # Its logit bias, and the ids min_tokens holds back, as arrays made once: a step copies
    # them, so the host's cost per step stays small whatever the request asked for.
    bias_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    bias_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    held_stop_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))


class InputBuilder:
    """Per-sequence rows, and the padded arrays of one step in its shape bucket."""

    def __init__(
        self,
        buckets: Buckets,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_slots: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        compact_samplers: bool = False,
        enable_lora: bool = False,
    ) -> None:
        """``compact_samplers``: every step's sampler is one of
        ``SamplerFlags.compact_variants()`` (``SamplerFlags.compacted``); ``enable_lora``: each
        step carries every token's adapter slot (``lora_token_slots``)."""
        self.buckets = buckets
        self.block_size = block_size
        self.compact_samplers = compact_samplers
        self.max_model_len = max_model_len
        # Bias entries a sequence can need: its logit_bias, and its stop ids while min_tokens
        # holds them back.
        self.bias_width = MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS + len(eos_token_ids)
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # A row for each running sequence and one padding row, which is never written.
        num_rows = max_num_seqs + 1
        self.pad_row = num_rows - 1
        self._free_rows = list(range(num_rows - 2, -1, -1))
        self._rows: dict[str, _Row] = {}  # seq_id -> its row
        self.block_table = np.zeros((num_rows, buckets.pages_per_seq), np.int32)
        self.sampling = {
            name: np.full(num_rows, neutral, dtype) for name, (dtype, neutral) in ROW_FIELDS.items()
        }
        self.min_tokens = np.zeros(num_rows, np.int32)
        self.prompt_len = np.zeros(num_rows, np.int32)
        self.needs = np.zeros((num_rows, len(Need)), bool)  # per row: what its sampler needs
        self.enable_lora = enable_lora
        self.lora_slot = np.zeros(num_rows, np.int32)  # per row: its adapter's slot, 0: none
        self._every_token_masks: dict[tuple[int, bool], np.ndarray] = {}  # see ``_every_token``

    # -- rows ------------------------------------------------------------------------------

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def update_states(self, output: SchedulerOutput) -> None:
        """Free the rows of preempted and finished sequences, then give new ones a row."""
        for seq_id in (*output.preempted_seq_ids, *output.finished_seq_ids):
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row.index)
        for item in output.scheduled:
            if item.is_new:
                self._add_row(item.seq)

    def _add_row(self, seq: StepSequence) -> None:
        if seq.seq_id in self._rows:
            raise RuntimeError(f"sequence {seq.seq_id!r} is new but already has a row")
        row = self._free_rows.pop()
        p = seq.params
        for name, value in row_values(p, seq.seed).items():
            self.sampling[name][row] = value
        self.min_tokens[row] = p.min_tokens
        self.prompt_len[row] = seq.num_prompt_tokens
        self.lora_slot[row] = seq.lora_slot
        wants_logprobs = p.logprobs is not None or (p.best_of or 0) > p.n
        needs = self.needs[row]
        needs[Need.SORT] = p.top_k > 0 or p.top_p < 1.0
        needs[Need.PENALTIES] = p.has_penalties
        needs[Need.BIAS] = bool(p.logit_bias)
        needs[Need.LOGPROBS] = wants_logprobs
        needs[Need.NOISE] = p.temperature > 0
        state = self._rows[seq.seq_id] = _Row(row)
        if p.logit_bias:
            state.bias_ids = np.array([int(t) for t, _ in p.logit_bias], np.int32)
            state.bias_values = np.array([float(v) for _, v in p.logit_bias], np.float32)
        if p.min_tokens > 0:  # no stop token may end the sequence early
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            state.held_stop_ids = np.array(sorted(stop_ids), np.int32)

    def _sync(self, seq: StepSequence) -> int:
        """The sequence's row, its page table extended to its current blocks."""
        row = self._rows[seq.seq_id]
        blocks = seq.block_ids
        synced = row.num_synced_blocks
        if len(blocks) != synced:
            self.block_table[row.index, synced : len(blocks)] = blocks[synced:]
            row.num_synced_blocks = len(blocks)
        return row.index

    def padding_step(
        self, num_tokens: int, flags: SamplerFlags | None = None
    ) -> tuple[Batch, SamplingInputs]:
        """Host inputs of a step of padding only, in the bucket of ``num_tokens``, shaped for
        the sampler variant ``flags``."""
        num_seqs = self.buckets.seq_bucket(num_tokens)
        batch = Batch.padding(num_tokens, num_seqs, self.buckets.pages_per_seq, self.num_slots)
        adjust = flags is not None and flags.adjust_logits
        inputs = SamplingInputs.padding(
            num_seqs,
            self.vocab_size,
            self.bias_width if adjust else 0,
            self.max_model_len if adjust else 0,
            use_mask=flags is not None and flags.use_mask,
        )
        return batch, inputs

    # -- one step --------------------------------------------------------------------------

    def build_batch(self, output: SchedulerOutput) -> tuple[Batch, np.ndarray]:
        """Padded host arrays for the scheduled tokens, and each sequence's row (i32[S])."""
        items = output.scheduled
        num_seqs = len(items)
        num_tokens = output.num_batched_tokens
        t_pad = self.buckets.token_bucket(num_tokens)
        s_pad = self.buckets.seq_bucket(t_pad)
        bs = self.block_size

        rows = np.full(s_pad, self.pad_row, np.int32)
        rows[:num_seqs] = [self._sync(item.seq) for item in items]
        starts = np.zeros(s_pad, np.int32)
        starts[:num_seqs] = [item.start for item in items]
        q_lens = np.zeros(s_pad, np.int32)
        q_lens[:num_seqs] = [item.num_new_tokens for item in items]
        cu_q_lens = np.zeros(s_pad + 1, np.int32)
        np.cumsum(q_lens, out=cu_q_lens[1:])

        input_ids = np.zeros(t_pad, np.int32)
        if num_tokens == num_seqs:  # decode only: each sequence's last token
            input_ids[:num_seqs] = [item.seq.last_token_id for item in items]
        else:
            flat: list[int] = []
            for item in items:
                drafts = item.draft_token_ids  # verified after the sequence's own tokens
                stop = item.start + item.num_new_tokens - len(drafts)
                flat += item.seq.token_ids(item.start, stop) + drafts
            input_ids[:num_tokens] = flat
        # Token t belongs to sequence seq_of[t] at position starts + (t - cu_q_lens).
        seq_of = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens[:num_seqs])
        positions = np.zeros(t_pad, np.int32)
        positions[:num_tokens] = (
            starts[seq_of] + np.arange(num_tokens, dtype=np.int32) - cu_q_lens[seq_of]
        )
        slot_mapping = np.full(t_pad, self.num_slots, np.int32)
        pos = positions[:num_tokens]
        slot_mapping[:num_tokens] = self.block_table[rows[seq_of], pos // bs] * bs + pos % bs

        page_indices = self.block_table[rows]
        page_indices[num_seqs:] = 0
        host: dict[str, Any] = dict(  # numpy stands in for device arrays until device_put
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            kv_lens=starts + q_lens,
            page_indices=page_indices,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([num_seqs], np.int32),
            logits_indices=self._logits_indices(output, cu_q_lens, s_pad),
        )
        return Batch(**host), rows

    @staticmethod
    def _logits_indices(output: SchedulerOutput, cu_q_lens: np.ndarray, s_pad: int) -> np.ndarray:
        """The rows of the step's hidden states the sampler takes (i32[s_pad]): each
        sequence's last; a sequence with k drafted tokens, its last k + 1 (the positions that
        verify each draft and the one after them), in ``SchedulerOutput.sample_rows`` order.
        The scheduler keeps them within s_pad (``Scheduler.max_sample_rows``)."""
        last = np.maximum(cu_q_lens[1:] - 1, 0)
        if not output.has_drafts:
            return last
        indices = np.zeros(s_pad, np.int32)
        chosen: list[int] = []
        for i, item in enumerate(output.scheduled):
            end = int(cu_q_lens[i + 1])
            chosen.extend(range(end - item.num_sampled, end))
        if len(chosen) > s_pad:
            raise ValueError(f"{len(chosen)} sampled positions exceed the step's {s_pad} rows")
        indices[: len(chosen)] = chosen
        return indices

    def sampled_positions(
        self, output: SchedulerOutput, rows: np.ndarray, kv_lens: np.ndarray
    ) -> tuple[list[StepSequence], np.ndarray, np.ndarray, list[list[int]]]:
        """Per row of the sampler: its sequence, its table row, the position of the token it
        samples, and the drafted tokens before that position (a step without drafts: one row
        per sequence, none before). Row j of a sequence with drafts samples the token after
        its j-th draft, under the penalties, ``min_tokens`` and mask those drafts give it."""
        seqs = [item.seq for item in output.scheduled]
        if not output.has_drafts:
            return seqs, rows, kv_lens, [[] for _ in seqs]
        num_rows = rows.shape[0]
        out_seqs: list[StepSequence] = []
        out_rows = np.full(num_rows, self.pad_row, np.int32)
        positions = np.zeros(num_rows, np.int32)
        before: list[list[int]] = []
        r = 0
        for i, item in enumerate(output.scheduled):
            k = len(item.draft_token_ids)
            for j in range(k + 1):
                out_seqs.append(item.seq)
                out_rows[r] = rows[i]
                positions[r] = kv_lens[i] - k + j
                before.append(item.draft_token_ids[:j])
                r += 1
        return out_seqs, out_rows, positions, before

    def lora_token_slots(self, host_batch: Batch, rows: np.ndarray) -> np.ndarray | None:
        """Each token's adapter slot (i32[T], 0 for the base model and padding), or None
        without ``enable_lora``."""
        if not self.enable_lora:
            return None
        num_tokens = host_batch.input_ids.shape[0]
        slots = np.zeros(num_tokens, np.int32)
        per_token = np.repeat(self.lora_slot[rows], np.diff(np.asarray(host_batch.cu_q_lens)))
        slots[: per_token.size] = per_token
        return slots

    def sampler_flags(
        self, rows: np.ndarray, kv_lens: np.ndarray, use_mask: bool = False
    ) -> SamplerFlags:
        """The step's sampler variant; ``use_mask``: some sequence is constrained."""
        needs = self.needs[rows].any(axis=0)
        # min_tokens still holds back EOS for a sequence with fewer outputs than its minimum.
        num_out = kv_lens - self.prompt_len[rows]
        min_tokens = self.min_tokens[rows]
        holds_eos = bool(np.any((min_tokens > 0) & (num_out < min_tokens)))
        adjust_logits = bool(needs[Need.PENALTIES]) or bool(needs[Need.BIAS]) or holds_eos
        num_logprobs = NUM_TOP_LOGPROBS if needs[Need.LOGPROBS] else -1
        sampled = bool(needs[Need.NOISE])
        flags = SamplerFlags(
            use_sort=bool(needs[Need.SORT]) and sampled,  # greedy rows never sort
            adjust_logits=adjust_logits,
            num_logprobs=num_logprobs,
            all_greedy=not sampled and not use_mask,
            use_mask=use_mask,
        )
        return flags.compacted() if self.compact_samplers else flags

    @property
    def sampler_variants(self) -> tuple[SamplerFlags, ...]:
        """Every variant ``sampler_flags`` can return: what warm-up compiles."""
        if self.compact_samplers:
            return SamplerFlags.compact_variants()
        return SamplerFlags.variants()

    def sampling_inputs(
        self,
        seqs: Seq[StepSequence],
        rows: np.ndarray,
        kv_lens: np.ndarray,
        flags: SamplerFlags,
        drafted: Seq[list[int]] | None = None,
    ) -> SamplingInputs:
        """The step's sampler inputs: rows gathered from the tables; with ``adjust_logits``,
        bias entries and penalty histories in their fixed widths (one shape per variant); with
        ``use_mask``, a token mask that allows every token (``ModelRunner.sample`` packs the
        engine's mask over its leading rows)."""
        num_rows = rows.shape[0]
        vocab = self.vocab_size
        width = self.bias_width if flags.adjust_logits else 0
        length = self.max_model_len if flags.adjust_logits else 0
        host: dict[str, Any] = {name: table[rows] for name, table in self.sampling.items()}
        host["positions"] = kv_lens  # a token is sampled at position kv_len
        host["bias_ids"] = bias_ids = np.full((num_rows, width), vocab, np.int32)
        host["bias_values"] = bias_values = np.zeros((num_rows, width), np.float32)
        host["history_ids"] = history = np.full((num_rows, length), vocab, np.int32)
        host["num_prompt_tokens"] = self.prompt_len[rows]
        host["token_mask"] = self._every_token(num_rows, flags.use_mask)
        if flags.adjust_logits:
            for i, seq in enumerate(seqs):
                row = self._rows[seq.seq_id]
                n = len(row.bias_ids)
                bias_ids[i, :n], bias_values[i, :n] = row.bias_ids, row.bias_values
                before = drafted[i] if drafted is not None else []  # drafts before its token
                if len(seq.output_token_ids) + len(before) < seq.params.min_tokens:
                    m = n + len(row.held_stop_ids)
                    bias_ids[i, n:m], bias_values[i, n:m] = row.held_stop_ids, -1e9
                if seq.params.has_penalties:  # its steps are synchronous: no pending token
                    tokens = (seq.prompt_token_ids + seq.output_token_ids + before)[:length]
                    history[i, : len(tokens)] = tokens
        return SamplingInputs(**host)  # numpy stands in for device arrays until device_put

    def _every_token(self, num_rows: int, use_mask: bool) -> np.ndarray:
        """i32[num_rows, W] with every bit set (W = 0 without ``use_mask``), made once per
        number of rows and never written: the sampler's inputs are packed from it."""
        key = (num_rows, use_mask)
        mask = self._every_token_masks.get(key)
        if mask is None:
            width = mask_width(self.vocab_size) if use_mask else 0
            mask = self._every_token_masks[key] = np.full((num_rows, width), -1, np.int32)
            mask.flags.writeable = False
        return mask

    def pending_sources(
        self, output: SchedulerOutput, host_batch: Batch, sampled_row: dict[str, int] | None
    ) -> np.ndarray | None:
        """For each input token, the row of the previous step's sampled ids that holds it
        (``PENDING_TOKEN`` inputs), else -1 (i32[T]); None when no input is pending.
        ``sampled_row`` maps a sequence to its row in the previous step's samples."""
        pending = np.flatnonzero(np.asarray(host_batch.input_ids) == PENDING_TOKEN)
        if pending.size == 0:
            return None
        if sampled_row is None:
            raise RuntimeError("a pending input token without the step that samples it")
        owners = np.searchsorted(np.asarray(host_batch.cu_q_lens), pending, side="right") - 1
        source = np.full(host_batch.input_ids.shape[0], -1, np.int32)
        source[pending] = [sampled_row[output.scheduled[i].seq.seq_id] for i in owners]
        return source

    @staticmethod
    def draft_sources(output: SchedulerOutput, host_batch: Batch) -> np.ndarray:
        """For each input token, where ``output.device_drafts`` holds it (row s's draft j at
        s * W + j of the drafts laid out flat), else -1 (i32[T]): a sequence's drafts are the
        last ``len(draft_token_ids)`` of its tokens in the step."""
        drafts = output.device_drafts
        assert drafts is not None
        width = drafts.ids.shape[1]
        cu_q_lens = np.asarray(host_batch.cu_q_lens)
        source = np.full(host_batch.input_ids.shape[0], -1, np.int32)
        for i, item in enumerate(output.scheduled):
            k = len(item.draft_token_ids)
            if k:
                end = int(cu_q_lens[i + 1])
                first = drafts.rows[item.seq.seq_id] * width
                source[end - k : end] = np.arange(first, first + k, dtype=np.int32)
        return source

    def prompt_logprob_targets(
        self, output: SchedulerOutput, host_batch: Batch
    ) -> tuple[np.ndarray | None, dict[str, tuple[int, int]]]:
        """The next prompt token of every row that needs a prompt logprob, and each
        sequence's (offset, count) among the rows; None when no sequence asked."""
        wanted = [
            (i, item)
            for i, item in enumerate(output.scheduled)
            if item.seq.params.prompt_logprobs is not None
            and item.seq.index == 0  # samples of one request share the prompt
            and item.start < item.seq.num_prompt_tokens - 1
        ]
        if not wanted:
            return None, {}
        next_ids = np.zeros(host_batch.input_ids.shape[0], np.int32)
        spans = {}
        for i, item in wanted:
            seq = item.seq
            offset = int(host_batch.cu_q_lens[i])
            # Row for position p scores prompt token p + 1 (prompt tokens only).
            stop = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            n = stop - item.start
            next_ids[offset : offset + n] = seq.prompt_token_ids[item.start + 1 : stop + 1]
            spans[seq.seq_id] = (offset, n)
        return next_ids, spans
