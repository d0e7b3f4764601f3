"""InFlight: a step queued on the device and not yet read back, and its reading back.

Made by ``ModelRunner.dispatch``, which queues the step's forward pass; the engine hands it
to ``ModelRunner.sample`` (with the step's token mask, or None), which queues the sampler,
keeps it while it prepares the next step, and hands it back to ``ModelRunner.collect``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxserve.runner.programs import Forward, StepSamples, unpack_logprobs
from jaxserve.runner.sampling import SamplerFlags, SamplingInputs
from jaxserve.runner.step import RunnerOutput


@dataclasses.dataclass
class DeferredSampler:
    """What a step's sampler needs once its token mask is known."""

    forward: Forward  # the forward pass's output, on the device
    inputs: SamplingInputs  # on the host; token_mask [S, W] allows every token
    flags: SamplerFlags
    # A verify step scheduled ahead (``verify_ahead``): each sampler row's sequence (-1:
    # none) and each sequence's shift on the device, added to the rows' positions.
    shifted: tuple[np.ndarray, jax.Array] | None = None


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its device outputs, not yet read back."""

    out: StepSamples | None  # None until ``ModelRunner.sample`` queues the sampler
    prompt_out: tuple[jax.Array, ...] | None
    spans: dict[str, tuple[int, int]]  # seq_id -> (offset, count) of its prompt logprob rows
    sampled_row: dict[str, int]  # seq_id -> its row in out.token_ids, one per scheduled seq
    deferred: DeferredSampler | None = None
    # A pooling runner's step: f32[S_pad, 3, H] on the device (``programs.pool_step``), and
    # no sampler, ever.
    pooled: jax.Array | None = None
    # Sampled rows to read back; None: one per scheduled sequence (a step with drafted
    # tokens samples more: ``SchedulerOutput.sample_rows``).
    num_rows: int | None = None
    # An encoder's sequence classifier (a cross-encoder): f32[S_pad, L] logits on the device.
    classified: jax.Array | None = None
    # A step that verified drafts left on the device: seq_id -> (its first sampled row, the
    # drafts it verified, its first draft's index in ``drafts_feed``), and that feed; what
    # the next verify step, scheduled before this one is read back, is corrected from
    # (``verify_ahead``).
    verified: dict[str, tuple[int, int, int]] | None = None
    drafts_feed: jax.Array | None = None
    # Such a next step's shift of each of its sequences (i32[S_max] on the device), or None.
    shift: jax.Array | None = None

    @property
    def sampled_ids(self) -> Any:  # i32[S_max] on the device
        if self.out is None:
            raise RuntimeError("the step has not been sampled (ModelRunner.sample)")
        return self.out.token_ids

    def read_back(self) -> RunnerOutput:
        """Wait for the step and copy its sampled tokens (and logprobs) to the host."""
        out = self.out
        num = len(self.sampled_row) if self.num_rows is None else self.num_rows
        if self.pooled is not None:
            classified = None if self.classified is None else np.asarray(self.classified)[:num]
            return RunnerOutput(
                np.zeros(0, np.int32), pooled=np.asarray(self.pooled)[:num], classified=classified
            )
        if out is None:
            raise RuntimeError("the step has not been sampled (ModelRunner.sample)")
        result = RunnerOutput(token_ids=np.asarray(out.token_ids)[:num])
        if out.logprobs is not None:
            (result.logprobs, result.ranks, result.top_ids, result.top_logprobs) = unpack_logprobs(
                np.asarray(out.logprobs)[:num]
            )
        if self.prompt_out is not None:
            try:
                lp, ranks, top_ids, top_lp = (np.asarray(a) for a in self.prompt_out)
            except jax.errors.JaxRuntimeError as exc:  # out of device memory, say
                result.failed = dict.fromkeys(self.spans, f"prompt logprobs failed: {exc}")
                return result
            result.prompt_logprobs = {
                sid: (lp[o : o + n], ranks[o : o + n], top_ids[o : o + n], top_lp[o : o + n])
                for sid, (o, n) in self.spans.items()
            }
        return result
