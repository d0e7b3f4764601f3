"""Step inputs as one buffer: a pytree of 4-byte host arrays <-> one i32 array and its layout.

Each step sends its model inputs (the ``Batch`` and the pending-token sources) and its sampler
inputs (``SamplingInputs``) to the device. Sent as they are, that is one host-to-device copy
per array, about 20 a step, each with its own fixed cost; packed, it is one copy per program.
The program unpacks with static slices and bitcasts, which XLA folds into the consumers.

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
    def size(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.leaves)


def pack(tree: Any) -> tuple[np.ndarray, Layout]:
    """One i32 buffer holding every leaf of ``tree`` (numpy arrays of 4-byte dtypes), and
    the layout that ``unpack`` needs to take it apart."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    for array in arrays:
        if array.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte dtypes, got {array.dtype} {array.shape}")
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in arrays]
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buffer, Layout(treedef, tuple((a.shape, a.dtype.str) for a in arrays))


def write_rows(buffer: np.ndarray, layout: Layout, leaf: int, rows: np.ndarray) -> None:
    """Overwrite the leading rows of leaf ``leaf`` of a packed ``buffer`` with ``rows`` (a
    4-byte array of the leaf's row shape), in place: one copy, from ``rows`` to the buffer."""
    shape, _ = layout.leaves[leaf]
    if rows.shape[1:] != shape[1:] or rows.shape[0] > shape[0] or rows.dtype.itemsize != 4:
        raise ValueError(f"rows {rows.dtype}{list(rows.shape)} do not fit leaf {list(shape)}")
    offset = sum(math.prod(s) for s, _ in layout.leaves[:leaf])
    buffer[offset : offset + rows.size] = rows.reshape(-1).view(np.int32)


def unpack(buffer: jax.Array, layout: Layout) -> Any:
    """The pytree ``pack`` packed, from its buffer (on the device, under jit)."""
    leaves = []
    offset = 0
    for shape, dtype in layout.leaves:
        size = math.prod(shape)
        part = jax.lax.slice(buffer, (offset,), (offset + size,))
        if np.dtype(dtype) != np.int32:
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        leaves.append(part.reshape(shape))
        offset += size
    return jax.tree.unflatten(layout.treedef, leaves)
