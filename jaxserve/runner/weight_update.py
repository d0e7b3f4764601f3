"""New weights for a running model: a pytree laid out as the served ``Weights``, checked leaf by
leaf against them before anything changes, then brought to their dtype and sharding on the
device.

The compiled programs take the weights as an argument, so new weights of the same shapes,
dtypes and shardings run in the same executables: nothing compiles. A leaf that already has
the served dtype and sharding is used as it is (no copy); another is cast and placed on the
device. ``ModelRunner.update_weights`` and ``load_weights_from`` call this; the engine swaps
them in between steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.layers import Weights


class WeightsUpdateError(ValueError):
    """New weights that do not fit the served model, named leaf by leaf; nothing changed."""


def checked_weights(served: Weights, new: Any) -> Weights:
    """``new`` as the model serves it: each leaf cast to the served leaf's dtype and placed in
    its sharding. ``WeightsUpdateError`` names every leaf missing, extra or of another shape
    (paths as ``jax.tree_util.keystr`` writes them: ``.layers[0].wq``)."""
    served_leaves, treedef = jax.tree_util.tree_flatten_with_path(served)
    new_leaves = jax.tree_util.tree_flatten_with_path(new)[0]  # anything else: one leaf
    served_by_path = {jax.tree_util.keystr(path): leaf for path, leaf in served_leaves}
    new_by_path = {jax.tree_util.keystr(path): leaf for path, leaf in new_leaves}
    # The surprising first: a leaf at no weight's path, then shapes, then what is missing.
    problems = [
        f"{path or 'the whole tree'}: not a weight of this model"
        for path in new_by_path
        if path not in served_by_path
    ]
    for path, leaf in new_by_path.items():
        old = served_by_path.get(path)
        if old is not None and tuple(jnp.shape(leaf)) != tuple(old.shape):
            problems.append(f"{path}: shape {tuple(jnp.shape(leaf))}, the model's is {old.shape}")
    problems += [f"{path}: missing" for path in served_by_path if path not in new_by_path]
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise WeightsUpdateError(f"{len(problems)} weights do not fit the model: {shown}")
    leaves = [
        _as_served(new_by_path[jax.tree_util.keystr(path)], old) for path, old in served_leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _as_served(new: Any, old: Any) -> jax.Array:
    """``new`` with ``old``'s dtype and sharding; ``new`` itself when it has both. An array
    the runner placed on its default device without committing it to one (one device) stays
    uncommitted where ``new`` is: a jitted program compiles again for a committed one."""
    committed = getattr(old, "committed", True)
    if isinstance(new, jax.Array) and new.dtype == old.dtype and new.sharding == old.sharding:
        return new
    return place(jnp.asarray(new).astype(old.dtype), old.sharding, committed)


def place(value: Any, sharding: jax.sharding.Sharding, committed: bool) -> jax.Array:
    """``value`` on the device(s) of ``sharding``; on the default device, uncommitted, where
    ``committed`` is False (as the loader leaves one device's weights)."""
    return jax.device_put(value, sharding) if committed else jax.device_put(value)
