"""Sleep and wake, as vLLM's sleep mode spells them: the device memory a model holds, given up
between a training loop's rollouts and taken back, without compiling anything again.

Level 1 copies the weights to host memory and frees the KV cache; level 2 frees both (waking
makes the weights again as the start-up made them: loaded from the model's directory, or the
same random ones). The compiled programs keep their executables: the arrays made on waking
have the shapes, dtypes and shardings they were compiled for. The KV cache wakes empty, so the
engine forgets its prefix cache when the model sleeps.

``ModelRunner`` holds a ``SleepState``; these functions change only it and what they return.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


@dataclasses.dataclass
class SleepState:
    """What is asleep: ``level`` 0 when nothing is."""

    level: int = 0
    weights_asleep: bool = False
    kv_cache_asleep: bool = False
    host_weights: Any = None  # level 1: the weights in host memory (numpy), until they wake
    placements: Any = None  # per weight (sharding, committed): to put it back where it was

    def check_sleep(self, level: int) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level={level} must be 1 (weights to host memory) or 2 (dropped)")
        if self.level:
            raise RuntimeError(f"the model is asleep already (level {self.level})")

    @staticmethod
    def check_tags(tags: tuple[str, ...]) -> None:
        unknown = [tag for tag in tags if tag not in WAKE_TAGS]
        if unknown or not tags:
            raise ValueError(f"tags={list(tags)} must name some of {', '.join(WAKE_TAGS)}")


def abstract(tree: Any) -> Any:
    """The shapes, dtypes and shardings of a tree of device arrays (what was compiled for)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def placements(tree: Any) -> Any:
    """(sharding, committed) of each array of ``tree``: where ``place`` puts it back."""
    return jax.tree.map(lambda a: (a.sharding, a.committed), tree)


def free(tree: Any) -> None:
    """Give the device memory of the arrays of ``tree`` back now (they are the runner's own:
    the KV cache)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def device_bytes(*trees: Any) -> int:
    """Bytes of the live device arrays in ``trees`` (shapes alone count nothing)."""
    return sum(
        leaf.nbytes
        for tree in trees
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array) and not leaf.is_deleted()
    )
