"""KV-cache events as vLLM publishes them: what the block pool did to the prefix cache.

The block pool (``kv_cache.py``) records a ``BlockStored`` when a full block's hash enters the
prefix cache, a ``BlockRemoved`` when that block is evicted, and an ``AllBlocksCleared`` when
the whole cache is forgotten (prefix-cache reset, sleep, a weight update). ``EngineCore`` takes
the events of each step (``KVEventLog.take``) and hands them to the publisher
(``kv_event_publisher.py``), which encodes them with ``encode_batch`` into the msgpack bytes
vLLM's subscribers decode (llm-d's KV-cache indexer, Dynamo, the vLLM example subscriber).

Block hashes on the wire are not the pool's internal SHA-256 digests but 64-bit integers
computed as llm-d's precise prefix-cache scorer computes them from the prompt's tokens
(``external_block_hash``): the low 64 bits of SHA-256 over the canonical CBOR of
``[parent hash, token ids, extra keys]``, the first block's parent being the low 64 bits of
SHA-256 over the CBOR of ``$PYTHONHASHSEED`` ("" when unset). A router that hashes a prompt
the same way finds the blocks this engine holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's memory, whatever the accelerator
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]  # consecutive blocks of one sequence, first to last
    parent_block_hash: int | None  # the block before the first; None for a prompt's first
    token_ids: list[int]  # block_size tokens per block, concatenated
    block_size: int
    extra_keys: list[list[str] | None]  # per block: what its hash covers besides tokens
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str = MEDIUM_GPU
    sliding_window: int | None = None  # the model's window when every layer slides


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM_GPU


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


# -- block hashes (llm-d's computation) -------------------------------------------------------


def _cbor_head(major: int, value: int) -> bytes:
    """A canonical CBOR item head: the major type and its argument in the fewest bytes."""
    if value < 24:
        return bytes([major << 5 | value])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, value)
    raise ValueError(f"{value} does not fit a CBOR head")


def _cbor(value: Any) -> bytes:
    """Canonical CBOR of None, unsigned ints, strings and lists of them (all a hash needs)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value}: only unsigned integers are encoded")
        return _cbor_head(0, value)
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    items = list(value)
    return _cbor_head(4, len(items)) + b"".join(_cbor(item) for item in items)


def _low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def root_block_hash(seed: str | None = None) -> int:
    """The parent hash of a prompt's first block: from ``seed``, else ``$PYTHONHASHSEED``
    (vLLM's NONE_HASH seed, llm-d's ``hashSeed``), else ""."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", "")
    return _low64(_cbor(seed))


def external_block_hash(parent: int, token_ids: Sequence[int], extra: list[str] | None) -> int:
    """The published hash of one full block, as llm-d hashes a block of a prompt."""
    return _low64(_cbor([parent, [int(t) for t in token_ids], extra]))


# -- the events of one step -------------------------------------------------------------------


class KVEventLog:
    """Events recorded by the block pool on the engine thread, taken once per step."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.pending: list[KVCacheEvent] = []
        self.root_hash = root_block_hash()
        self.sliding_window = sliding_window

    def take(self) -> list[KVCacheEvent]:
        events, self.pending = self.pending, []
        return events


# -- the wire format --------------------------------------------------------------------------


def _event_map(event: KVCacheEvent) -> dict[str, Any]:
    """msgspec's encoding of vLLM's event struct: the tag under "type", then the fields in
    declaration order; fields with a default are left out when they hold it."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": event.extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": FULL_ATTENTION
            if event.sliding_window is None
            else SLIDING_WINDOW,
        }
        if event.sliding_window is not None:
            out["kv_cache_spec_sliding_window"] = event.sliding_window
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": 0,
        }
    return {"type": "AllBlocksCleared"}


def _event_array(event: KVCacheEvent) -> list[Any]:
    """The earlier array_like layout: the tag first, then the fields by position."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_batch(
    events: Sequence[KVCacheEvent],
    encoding: str = "map",
    data_parallel_rank: int = 0,
    ts: float | None = None,
) -> bytes:
    """vLLM's ``KVEventBatch`` as msgspec encodes it: an array ``[ts, events,
    data_parallel_rank]`` (ts a float64), each event a map (``encoding="map"``) or an array
    (``"array"``)."""
    encode = _event_map if encoding == "map" else _event_array
    batch = [time.time() if ts is None else ts, [encode(e) for e in events], data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)
