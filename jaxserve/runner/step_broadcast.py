"""Multi-host steps: process 0 announces each step, the other processes join it.

Process 0 runs the scheduler; before each step its runner broadcasts a ``StepHeader`` (the
shapes and sampler variant of the step, fixed-size integers) and then the padded step inputs.
A follower (``follow``) builds placeholders of the announced shapes, receives process 0's
values into them and runs the same jitted step on its devices. A header of all zeros (``STOP``)
ends the followers. The collectives are in ``distributed.py``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.models.batch import Batch
from jaxserve.runner.distributed import broadcast_ints, broadcast_step_inputs
from jaxserve.runner.sampling import SamplerFlags, SamplingInputs

if TYPE_CHECKING:
    from jaxserve.runner.runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """What a follower needs to know before it can receive a step's inputs."""

    num_tokens: int  # the token bucket (0: stop)
    num_bias: int  # logit-bias columns
    output_len: int  # penalty history columns (generated tokens)
    prompt_len: int  # penalty history columns (prompt tokens)
    flags: SamplerFlags
    has_prompt_logprobs: bool

    SIZE = 8  # integers on the wire

    @classmethod
    def of(
        cls, batch: Batch, inputs: SamplingInputs, flags: SamplerFlags, next_ids: np.ndarray | None
    ) -> StepHeader:
        return cls(
            num_tokens=batch.input_ids.shape[0],
            num_bias=inputs.bias_ids.shape[1],
            output_len=inputs.output_ids.shape[1],
            prompt_len=inputs.prompt_ids.shape[1],
            flags=flags,
            has_prompt_logprobs=next_ids is not None,
        )

    def encode(self) -> list[int]:
        f = self.flags
        bits = int(f.use_sort) | int(f.use_penalties) << 1 | int(f.use_bias) << 2
        return [
            self.num_tokens,
            self.num_bias,
            self.output_len,
            self.prompt_len,
            f.num_logprobs,
            bits,
            int(f.all_greedy),
            int(self.has_prompt_logprobs),
        ]

    @classmethod
    def decode(cls, values: tuple[int, ...] | list[int]) -> StepHeader:
        num_tokens, num_bias, out_len, prompt_len, num_logprobs, bits, greedy, has_lp = values
        flags = SamplerFlags(
            use_sort=bool(bits & 1),
            use_penalties=bool(bits & 2),
            use_bias=bool(bits & 4),
            num_logprobs=num_logprobs,
            all_greedy=bool(greedy),
        )
        return cls(num_tokens, num_bias, out_len, prompt_len, flags, bool(has_lp))


STOP = [0] * StepHeader.SIZE


def announce(header: StepHeader, step_inputs: tuple) -> tuple:
    """On process 0: send the header, then the inputs; returns them as every process has them."""
    broadcast_ints(header.encode(), StepHeader.SIZE)
    return broadcast_step_inputs(step_inputs)


def stop_followers() -> None:
    broadcast_ints(STOP, StepHeader.SIZE)


def follow(runner: ModelRunner) -> None:
    """On processes other than 0: join every step process 0 runs, until it stops."""
    while True:
        values = broadcast_ints(None, StepHeader.SIZE)
        if values[0] == 0:
            return
        header = StepHeader.decode(values)
        batch, _ = runner.inputs.padding_step(header.num_tokens)
        inputs = SamplingInputs.padding(
            batch.logits_indices.shape[0],
            runner.inputs.vocab_size,
            header.num_bias,
            header.output_len,
            header.prompt_len,
        )
        next_ids = np.zeros(header.num_tokens, np.int32) if header.has_prompt_logprobs else None
        batch, inputs, next_ids = broadcast_step_inputs((batch, inputs, next_ids))
        runner.device_step(batch, inputs, header.flags, next_ids)
