"""Staged inputs: device buffers that keep their addresses from one call of a program to the next.

XLA runs a compiled program's kernels as command buffers (CUDA graphs) and records a graph
again, every command of it, wherever a buffer one of its commands reads or writes sits at
another address than at the last recording (``CommandBufferThunk``). A step that reads new
input buffers each call pays that recording in its launch: the Llama-3-8B batch-1 model step
launched in 0.90 ms from one input buffer and 1.48 ms from a new one each call on an H100
(``benchmarks/probes/launch_reuse.py``). ``Staging.stage`` copies a call's inputs, on the
device and in stream order, into buffers kept per key (the call's shape): the copy program
donates the last call's buffers, so its outputs live where they did. The copy is a small
program of its own, recorded again instead of the large one.

``JAXSERVE_STAGED_INPUTS=1`` turns it on for the model step and the drafters' chains; ``0``
(the default) leaves each call its own new buffers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jaxserve.runner.weight_update import committed

STAGED_INPUTS_ENV = "JAXSERVE_STAGED_INPUTS"


def staged_inputs() -> bool:
    """Whether ``STAGED_INPUTS_ENV`` asks for the programs' inputs to be staged."""
    return os.environ.get(STAGED_INPUTS_ENV, "0").strip() == "1"


def copy_into(held: tuple[jax.Array, ...], *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays`` copied into ``held`` (donated: the copies live where ``held`` did)."""
    del held  # kept (``keep_unused``) for its memory, which the copies take
    return arrays


class Staging:
    """Per key, the buffers a program reads its staged inputs from; ``put``: host arrays on
    the device(s) as the program's other inputs are (replicated under tensor parallelism)."""

    def __init__(self, put: Callable[[Any], Any]) -> None:
        self.enabled = staged_inputs()
        self._put = put
        self._copy = jax.jit(copy_into, donate_argnums=0, keep_unused=True)
        self._held: dict[Hashable, tuple[jax.Array, ...]] = {}

    def stage(self, key: Hashable, arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """``arrays`` in the buffers of ``key``, which keep their addresses from call to call
        (made at the key's first call); the last call of ``key`` read them, and may still be
        reading them: the copy runs after it on the device."""
        held = self._held.pop(key, None)
        if held is None:  # committed, as the copy's outputs are (else its second call
            # would compile it again)
            held = committed(self._put(tuple(np.zeros(a.shape, a.dtype) for a in arrays)))
        staged = self._copy(held, *arrays)
        self._held[key] = staged
        return staged
