"""Step inputs as one buffer: a pytree of 4-byte host arrays <-> one i32 array and its layout.

Each step sends its model inputs (the ``Batch`` and the pending-token sources) and its sampler
inputs (``SamplingInputs``) to the device. Sent as they are, that is one host-to-device copy
per array, about 20 a step, each with its own fixed cost; packed, it is one copy per program.
The program unpacks with static slices and bitcasts, which XLA folds into the consumers.

Each leaf starts on a 256-byte boundary (``ALIGN`` elements): XLA may hand a slice of the
buffer to a custom call as a pointer into it, and the Mosaic GPU kernels refuse an input that
is not 256-byte aligned ("Input buffer 1 is not 256-byte aligned", seen on the H200 when eight
sequences put the leaves after the first at odd offsets).

``pack`` runs on the host (numpy); ``unpack`` runs inside the jitted programs, with the
``Layout`` as a static argument: it is fixed by the shape bucket and the sampler variant, so it
adds no compiled programs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed pytree sits: its shape and dtype, in flattening order."""

    treedef: Any  # jax.tree_util.PyTreeDef (hashable)
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, numpy dtype string) per leaf

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each leaf starts in the buffer (i32 elements), each a multiple of ``ALIGN``."""
        starts, end = [], 0
        for shape, _ in self.leaves:
            starts.append(end)
            end += _aligned(math.prod(shape))
        return tuple(starts)

    @property
    def size(self) -> int:
        return sum(_aligned(math.prod(shape)) for shape, _ in self.leaves)


ALIGN = 64  # i32 elements: 256 bytes


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def pack(tree: Any) -> tuple[np.ndarray, Layout]:
    """One i32 buffer holding every leaf of ``tree`` (numpy arrays of 4-byte dtypes), and
    the layout that ``unpack`` needs to take it apart."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    for array in arrays:
        if array.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte dtypes, got {array.dtype} {array.shape}")
    layout = Layout(treedef, tuple((a.shape, a.dtype.str) for a in arrays))
    buffer = np.zeros(layout.size, np.int32)  # the gaps between leaves stay zero
    for array, offset in zip(arrays, layout.offsets, strict=True):
        flat = np.ascontiguousarray(array).reshape(-1).view(np.int32)
        buffer[offset : offset + flat.size] = flat
    return buffer, layout


def write_rows(buffer: np.ndarray, layout: Layout, leaf: int, rows: np.ndarray) -> None:
    """Overwrite the leading rows of leaf ``leaf`` of a packed ``buffer`` with ``rows`` (a
    4-byte array of the leaf's row shape), in place: one copy, from ``rows`` to the buffer."""
    shape, _ = layout.leaves[leaf]
    if rows.shape[1:] != shape[1:] or rows.shape[0] > shape[0] or rows.dtype.itemsize != 4:
        raise ValueError(f"rows {rows.dtype}{list(rows.shape)} do not fit leaf {list(shape)}")
    offset = layout.offsets[leaf]
    buffer[offset : offset + rows.size] = rows.reshape(-1).view(np.int32)


def unpack(buffer: jax.Array, layout: Layout) -> Any:
    """The pytree ``pack`` packed, from its buffer (on the device, under jit)."""
    leaves = []
    for (shape, dtype), offset in zip(layout.leaves, layout.offsets, strict=True):
        part = jax.lax.slice(buffer, (offset,), (offset + math.prod(shape),))
        if np.dtype(dtype) != np.int32:
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        leaves.append(part.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
