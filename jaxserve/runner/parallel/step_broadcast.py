"""The wire format of a multi-host step: what process 0 announces, what the others receive.

Process 0 runs the scheduler; before each step its runner broadcasts a ``StepHeader`` (the
shapes and sampler variant of the step, fixed-size integers, ``announce``) and then the padded
step inputs. A follower (``ModelRunner.follow``) reads the header (``next_header``), builds
placeholders of the announced shapes, receives process 0's values into them (``receive``) and
runs the same compiled step on its devices; a constrained step's token mask follows once the
host has built it (``share_token_mask``). A header of all zeros (``STOP``) ends the followers.
The collectives are in ``distributed.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.models.batch import Batch
from jaxserve.runner.parallel.distributed import broadcast_ints, broadcast_step_inputs
from jaxserve.runner.sampling import SamplerFlags


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """What a follower needs to know before it can receive a step's inputs: the token bucket
    and the sampler variant fix every input's shape."""

    num_tokens: int  # the token bucket (0: stop)
    flags: SamplerFlags
    has_prompt_logprobs: bool

    SIZE = 7  # integers on the wire

    @classmethod
    def of(cls, batch: Batch, flags: SamplerFlags, next_ids: np.ndarray | None) -> StepHeader:
        return cls(batch.input_ids.shape[0], flags, next_ids is not None)

    def encode(self) -> list[int]:
        f = self.flags
        return [
            self.num_tokens,
            int(f.use_sort),
            int(f.adjust_logits),
            f.num_logprobs,
            int(f.all_greedy),
            int(self.has_prompt_logprobs),
            int(f.use_mask),
        ]

    @classmethod
    def decode(cls, values: tuple[int, ...] | list[int]) -> StepHeader:
        num_tokens, use_sort, adjust, num_logprobs, greedy, has_lp, use_mask = values
        flags = SamplerFlags(
            bool(use_sort), bool(adjust), num_logprobs, bool(greedy), use_mask=bool(use_mask)
        )
        return cls(num_tokens, flags, bool(has_lp))


STOP = [0] * StepHeader.SIZE


def announce(header: StepHeader, step_inputs: tuple) -> tuple:
    """On process 0: send the header, then the inputs; returns them as every process has them."""
    broadcast_ints(header.encode(), StepHeader.SIZE)
    return broadcast_step_inputs(step_inputs)


def share_token_mask(token_mask: Any) -> Any:
    """The step's token mask (i32[S, W]), sent once the host has built it (process 0) or
    received into the placeholder (followers); a step with ``use_mask`` sends it after its
    forward pass has been queued."""
    return np.asarray(broadcast_step_inputs(token_mask))


def next_header() -> StepHeader | None:
    """On the other processes: the header of process 0's next step; None once it stops."""
    values = broadcast_ints(None, StepHeader.SIZE)
    return None if values[0] == 0 else StepHeader.decode(values)


def receive(placeholders: tuple) -> tuple:
    """On the other processes: the step inputs process 0 announced after the header, received
    into placeholders of their shapes."""
    return broadcast_step_inputs(placeholders)


def stop_followers() -> None:
    broadcast_ints(STOP, StepHeader.SIZE)
