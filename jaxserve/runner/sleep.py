"""Sleep and wake, as vLLM's sleep mode spells them: the device memory a model holds, given up
between a training loop's rollouts and taken back, without compiling anything again.

Level 1 copies the weights to host memory and frees the KV cache; level 2 frees both (waking
makes the weights again as the start-up made them: loaded from the model's directory, or the
same random ones). Level 1's copy is in pinned host memory where the backend has it, so that
each way is one DMA (``to_host``); else in numpy arrays. The compiled programs keep their
executables: the arrays made on waking have the shapes, dtypes and shardings they were compiled
for, committed as the served weights always are (``weight_update.committed``). The KV cache
wakes empty, so the engine forgets its prefix cache when the model sleeps.

``ModelRunner`` holds a ``SleepState``; these functions change only it and what they return.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from jaxserve.models.loading.load_progress import format_bytes

_LOG = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


@dataclasses.dataclass
class SleepState:
    """What is asleep: ``level`` 0 when nothing is."""

    level: int = 0
    weights_asleep: bool = False
    kv_cache_asleep: bool = False
    host_weights: Any = None  # level 1: the weights in host memory (``to_host``), until they wake
    placements: Any = None  # per weight, its sharding: to put it back where it was

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
    """The sharding of each array of ``tree``: where ``to_device`` puts it back."""
    return jax.tree.map(lambda a: a.sharding, tree)


def to_host(tree: Any) -> Any:
    """The arrays of ``tree`` in host memory, in one ``device_put``: pinned host memory where
    the backend has it (the copy back is then a DMA, not a copy through pageable memory: waking
    the Llama-3-8B shape from numpy arrays took 7.6 s on an H200), else numpy arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    try:
        pinned = [leaf.sharding.with_memory_kind("pinned_host") for leaf in leaves]
        host = jax.block_until_ready(jax.device_put(leaves, pinned))
    except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as exc:
        _LOG.info("The weights sleep in pageable host memory (no pinned host memory: %s)", exc)
        host = jax.device_get(leaves)
    return jax.tree.unflatten(treedef, host)


def to_device(host: Any, shardings: Any) -> Any:
    """``to_host``'s arrays back on the device(s), each in its sharding, in one ``device_put``
    (committed: the served weights are, ``weight_update.committed``)."""
    leaves, treedef = jax.tree.flatten(host)
    return jax.tree.unflatten(treedef, jax.device_put(leaves, jax.tree.leaves(shardings)))


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


def log_asleep(
    level: int, seconds: float, copied: float, held: tuple[int, int], host_weights: Any
) -> None:
    """The sleep's line (as vLLM says how long it took and what it freed): ``held``, the
    weights' and the KV cache's device bytes; ``copied``, the seconds until the weights were
    in host memory (level 1)."""
    weights, kv_cache = held
    if level == 1:
        leaves = jax.tree.leaves(host_weights)
        sharding = getattr(leaves[0], "sharding", None) if leaves else None  # (numpy: none)
        pinned = sharding is not None and sharding.memory_kind == "pinned_host"
        where = "pinned host memory" if pinned else "host memory"
        what = f"{format_bytes(weights)} of weights copied to {where} in {copied:.2f} s"
    else:
        what = f"{format_bytes(weights)} of weights dropped"
    _LOG.info(
        "Asleep (level %d) in %.2f s: %s, the KV cache's %s freed",
        level,
        seconds,
        what,
        format_bytes(kv_cache),
    )


def log_awake(woken: list[tuple[str, float]], still_asleep: bool) -> None:
    """The wake's line: what came back and how long each took to be on the device."""
    if not woken:
        return
    parts = ", ".join(f"{what} in {seconds:.2f} s" for what, seconds in woken)
    total = sum(seconds for _, seconds in woken)
    _LOG.info("%s in %.2f s: %s", "Partly awake" if still_asleep else "Awake", total, parts)
