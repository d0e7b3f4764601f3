"""The runner's host-side step inputs: rows made once per sequence, fixed shapes per variant."""

from __future__ import annotations

import numpy as np

from jaxserve.engine.request import Request, Sequence
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.input_builder import InputBuilder
from jaxserve.runner.sampling import EVERYTHING, SamplerFlags
from jaxserve.runner.step import ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS, SamplingParams

VOCAB = 100


def builder(compact_samplers: bool = False) -> InputBuilder:
    buckets = Buckets.of(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32, block_size=4)
    return InputBuilder(
        buckets,
        block_size=4,
        max_model_len=32,
        max_num_seqs=4,
        num_slots=64,
        vocab_size=VOCAB,
        eos_token_ids=(2,),
        compact_samplers=compact_samplers,
    )


def one_sequence(params: SamplingParams) -> Sequence:
    request = Request("r", None, [10, 11, 12], params, arrival_time=0.0)
    seq = Sequence("r", request, 0, seed=1, block_ids=[0])
    request.seqs.append(seq)
    return seq


def step_inputs(inputs: InputBuilder, seq: Sequence, is_new: bool, use_mask: bool = False):
    start = seq.num_tokens - 1
    output = SchedulerOutput([ScheduledSeq(seq, 1, start, is_new)], 1)
    inputs.update_states(output)
    batch, rows = inputs.build_batch(output)
    flags = inputs.sampler_flags(rows, np.asarray(batch.kv_lens), use_mask=use_mask)
    return flags, inputs.sampling_inputs([seq], rows, np.asarray(batch.kv_lens), flags)


def test_logit_bias_and_held_stop_ids_fill_fixed_width_rows() -> None:
    inputs = builder()
    params = SamplingParams(logit_bias={5: 2.0, 9: -1.0}, min_tokens=2, stop_token_ids=[7])
    seq = one_sequence(params)
    flags, sampling = step_inputs(inputs, seq, is_new=True)
    width = MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS + 1
    assert flags.adjust_logits and sampling.bias_ids.shape[1] == width
    assert sampling.history_ids.shape == (sampling.bias_ids.shape[0], 32)
    row = dict(zip(sampling.bias_ids[0].tolist(), sampling.bias_values[0].tolist(), strict=True))
    assert row.pop(VOCAB) == 0.0  # padding entries point past the vocabulary
    assert row == {5: 2.0, 9: -1.0, 2: -1e9, 7: -1e9}  # EOS and stop id held back
    seq.output_token_ids += [40, 41]  # min_tokens reached: only the logit bias is left
    seq.num_computed_tokens = seq.num_tokens - 1
    flags, sampling = step_inputs(inputs, seq, is_new=False)
    row = dict(zip(sampling.bias_ids[0].tolist(), sampling.bias_values[0].tolist(), strict=True))
    row.pop(VOCAB)
    assert row == {5: 2.0, 9: -1.0}


def test_plain_requests_send_no_bias_and_no_history() -> None:
    flags, sampling = step_inputs(builder(), one_sequence(SamplingParams(temperature=0)), True)
    assert flags == SamplerFlags(all_greedy=True)
    assert sampling.bias_ids.shape[1] == 0 and sampling.history_ids.shape[1] == 0
    assert flags in SamplerFlags.variants()


def test_compact_samplers_map_every_combination_to_one_of_three() -> None:
    """--sampler-variants compact: greedy and plain sampling keep their own programs; anything
    else (top-k/top-p, penalties, logprobs, a constraint) runs the one that does everything."""
    assert builder(compact_samplers=True).sampler_variants == SamplerFlags.compact_variants()
    cases = [
        (dict(temperature=0), False, SamplerFlags(all_greedy=True)),
        (dict(temperature=0.8), False, SamplerFlags()),
        (dict(temperature=0.8, top_p=0.5), False, EVERYTHING),
        (dict(temperature=0, logprobs=2), False, EVERYTHING),
        (dict(temperature=0.8, presence_penalty=0.5), False, EVERYTHING),
        (dict(temperature=0), True, EVERYTHING),
    ]
    for fields, use_mask, expected in cases:
        seq = one_sequence(SamplingParams(**fields))
        flags, sampling = step_inputs(builder(compact_samplers=True), seq, True, use_mask)
        assert flags == expected, (fields, flags)
        if flags.use_mask:  # a mask that allows everything until a constraint writes its row
            assert (sampling.token_mask == -1).all()


def test_every_flag_combination_a_step_can_ask_for_is_a_compiled_variant() -> None:
    """Warm-up compiles SamplerFlags.variants(); a step must never ask for another."""
    grid = [
        dict(temperature=t, top_k=k, top_p=p, logprobs=lp, presence_penalty=pp, min_tokens=m)
        for t in (0, 0.8)
        for k in (-1, 5)
        for p in (1.0, 0.5)
        for lp in (None, 3)
        for pp in (0.0, 0.5)
        for m in (0, 2)
    ]
    for fields in grid:
        for use_mask in (False, True):
            seq = one_sequence(SamplingParams(**fields))
            flags, _ = step_inputs(builder(), seq, True, use_mask=use_mask)
            assert flags in SamplerFlags.variants(), (fields, flags)
            # a constrained step sorts only when some sampled row asks for top-k or top-p
            wants_sort = fields["temperature"] > 0 and (fields["top_k"] > 0 or fields["top_p"] < 1)
            assert flags.use_sort == wants_sort and flags.use_mask == use_mask, (fields, flags)
