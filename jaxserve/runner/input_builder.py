"""Host-side step inputs: ``SchedulerOutput`` -> padded numpy arrays for one shape bucket.

Plain Python and numpy, no device work, so the per-step host cost can be measured alone
(benchmarks/host_overhead.py). The runner puts the result on the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.engine.request import Sequence
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.models.batch import Batch
from jaxserve.runner.sampling import SamplerFlags, SamplingInputs

MIN_TOKEN_BUCKET = 16
NUM_TOP_LOGPROBS = 20  # the API's cap; one sampler variant serves every logprobs request


def next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class InputBuilder:
    """Shape buckets and the padded arrays of one step."""

    def __init__(
        self,
        *,
        block_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_slots: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.block_size = block_size
        self.pages_per_seq = -(-max_model_len // block_size)
        top = next_power_of_2(max_num_batched_tokens)
        self.token_buckets = [
            b for b in (1 << i for i in range(4, 31)) if MIN_TOKEN_BUCKET <= b <= max(top, 16)
        ]
        self.max_seq_bucket = next_power_of_2(max_num_seqs)
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def token_bucket(self, num_tokens: int) -> int:
        for bucket in self.token_buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_seq_bucket)

    def build_batch(self, output: SchedulerOutput) -> Batch:
        """Padded host arrays for the scheduled tokens (numpy, not yet on the device)."""
        num_tokens = output.num_batched_tokens
        t_pad = self.token_bucket(num_tokens)
        s_pad = self.seq_bucket(t_pad)
        bs = self.block_size
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, self.num_slots, np.int32)
        kv_lens = np.zeros(s_pad, np.int32)
        page_indices = np.zeros((s_pad, self.pages_per_seq), np.int32)
        cu_q_lens = np.full(s_pad + 1, num_tokens, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        offset = 0
        for i, item in enumerate(output.scheduled):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            end = offset + n
            blocks = seq.block_ids
            if n == 1:  # decode: plain ints are cheaper than array ops
                input_ids[offset] = seq.token_ids(start, start + 1)[0]
                positions[offset] = start
                slot_mapping[offset] = blocks[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + n, dtype=np.int32)
                input_ids[offset:end] = seq.token_ids(start, start + n)
                positions[offset:end] = pos
                slot_mapping[offset:end] = np.asarray(blocks, np.int32)[pos // bs] * bs + pos % bs
            kv_lens[i] = start + n
            page_indices[i, : len(blocks)] = blocks
            cu_q_lens[i] = offset
            logits_indices[i] = end - 1
            offset = end
        cu_q_lens[len(output.scheduled)] = offset
        return Batch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            page_indices=page_indices,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([len(output.scheduled)], np.int32),
            logits_indices=logits_indices,
        )

    def sampling_inputs(
        self, seqs: Seq[Sequence], num_rows: int, flags: SamplerFlags
    ) -> SamplingInputs:
        vocab = self.vocab_size
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        positions = np.zeros(num_rows, np.int32)
        presence = np.zeros(num_rows, np.float32)
        frequency = np.zeros(num_rows, np.float32)
        repetition = np.ones(num_rows, np.float32)
        bias_rows: list[list[tuple[int, float]]] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            temperature[i] = p.temperature
            top_k[i] = max(p.top_k, 0)
            top_p[i] = p.top_p
            min_p[i] = p.min_p
            seeds[i] = seq.seed
            positions[i] = seq.num_tokens
            presence[i] = p.presence_penalty
            frequency[i] = p.frequency_penalty
            repetition[i] = p.repetition_penalty
            if flags.use_bias:
                bias_rows.append(self.bias_entries(seq))
        num_bias = (
            next_power_of_2(max((len(r) for r in bias_rows), default=0)) if flags.use_bias else 0
        )
        bias_ids = np.full((num_rows, num_bias), vocab, np.int32)
        bias_values = np.zeros((num_rows, num_bias), np.float32)
        for i, row in enumerate(bias_rows):
            for j, (token, value) in enumerate(row):
                bias_ids[i, j], bias_values[i, j] = token, value
        if flags.use_penalties:
            out_len = next_power_of_2(max((len(s.output_token_ids) for s in seqs), default=1))
            prompt_len = next_power_of_2(max((s.num_prompt_tokens for s in seqs), default=1))
            output_ids = np.full((num_rows, out_len), vocab, np.int32)
            prompt_ids = np.full((num_rows, prompt_len), vocab, np.int32)
            for i, seq in enumerate(seqs):
                output_ids[i, : len(seq.output_token_ids)] = seq.output_token_ids
                prompt_ids[i, : seq.num_prompt_tokens] = seq.prompt_token_ids
        else:
            output_ids = np.zeros((num_rows, 0), np.int32)
            prompt_ids = np.zeros((num_rows, 0), np.int32)
        return SamplingInputs(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            positions=positions,
            bias_ids=bias_ids,
            bias_values=bias_values,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_ids=output_ids,
            prompt_ids=prompt_ids,
        )

    def bias_entries(self, seq: Sequence) -> list[tuple[int, float]]:
        p = seq.params
        entries = [(int(t), float(v)) for t, v in p.logit_bias]
        if len(seq.output_token_ids) < p.min_tokens:
            # min_tokens: no stop token may end the sequence early.
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(self.eos_token_ids)
            entries += [(t, -1e9) for t in sorted(stop_ids)]
        return entries

    @staticmethod
    def sampler_flags(seqs: Seq[Sequence]) -> SamplerFlags:
        use_sort = use_penalties = use_bias = False
        num_logprobs = -1
        for seq in seqs:
            p = seq.params
            use_sort |= p.top_k > 0 or p.top_p < 1.0
            use_penalties |= p.has_penalties
            use_bias |= bool(p.logit_bias) or len(seq.output_token_ids) < p.min_tokens
            if p.logprobs is not None or (p.best_of or 0) > p.n:
                num_logprobs = NUM_TOP_LOGPROBS
        return SamplerFlags(use_sort, use_penalties, use_bias, num_logprobs)
