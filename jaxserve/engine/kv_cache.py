"""The KV block pool: fixed-size blocks, ref counts, prefix caching, LRU eviction.

The scheduler asks ``KVCacheManager`` for blocks; the runner turns each sequence's
``block_ids`` into the page table the attention kernel reads. A block that is full of known
tokens gets a chained SHA-256 hash (parent hash, its token ids, extra keys such as a tenant
salt); freed blocks keep their hash and stay hittable until they are reused, least recently
freed first.

Sliding windows: when every layer of the model has a window of W tokens, a running sequence
whose next rows start at position p reads no KV before p - W + 1, so the blocks wholly before it
go back to the pool (they stay hittable in the prefix cache like any freed block). Their entries
in ``block_ids`` become ``NULL_BLOCK``, so the list keeps one entry per block of positions and the
page table keeps its layout. A hybrid model (global layers too) keeps every block: one pool
serves all layers.

KV-cache events (``kv_events.py``): given a ``KVEventLog``, the pool records a ``BlockStored``
for each run of blocks whose hashes enter the prefix cache, a ``BlockRemoved`` for each cached
block evicted, and an ``AllBlocksCleared`` when a reset leaves nothing cached.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    external_block_hash,
)
from jaxserve.engine.request import Sequence
from jaxserve.units import cdiv

NONE_HASH = b"\x00" * 32
# NOTE: the page-table entry of a block released behind the sliding window. The attention never
# uses it: the reference gathers it and masks every position in it (kv_pos <= row_pos - window),
# with zero weight on its (finite) values; the GPU and TPU kernels start at the KV tile holding
# the window's first position, so they fetch only pages of the tile that straddles it, masked
# the same way. The runner keeps the ids it already copied (a block that may now hold another
# sequence's K/V: finite, masked), and copies this one for entries released before it saw them
# (a prefix-cache hit behind the window).
NULL_BLOCK = 0


def hash_block(parent_hash: bytes, token_ids: Seq[int], extra_key: str | None = None) -> bytes:
    h = hashlib.sha256(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key:
        h.update(extra_key.encode())
    return h.digest()


class BlockPool:
    """Blocks with ref counts; free blocks in LRU order; hash -> cached block id."""

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        # With events: the published hash of each cached block (block id -> hash).
        self.events = events
        self.external_hashes: dict[int, int] = {}
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        # Free blocks, least recently freed first (dict keeps insertion order).
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks)
        )
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free)} free")
        out = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
            self.block_hashes[block_id] = None
        if self.events is not None and block_id in self.external_hashes:
            removed = BlockRemoved([self.external_hashes.pop(block_id)])
            self.events.pending.append(removed)

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix hit or a shared prompt block)."""
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: Seq[int]) -> None:
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register the block under ``block_hash``; False if it or the hash already is."""
        if self.block_hashes[block_id] is None and block_hash not in self.cached:
            self.block_hashes[block_id] = block_hash
            self.cached[block_hash] = block_id
            return True
        return False

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> None:
        num_events = len(self.events.pending) if self.events is not None else 0
        for block_id in list(self.free):
            self._evict(block_id)
        if self.events is not None and not self.cached:
            # Nothing is cached any more: one AllBlocksCleared says it for every block.
            del self.events.pending[num_events:]
            self.events.pending.append(AllBlocksCleared())


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        """``sliding_window``: the window of a model whose every layer slides (blocks behind
        it are released while a sequence runs); None keeps every block. ``events``: where the
        pool records KV-cache events; None records none."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, events)
        # With events, per sequence: the published hashes of its leading full blocks.
        self._external_hashes: dict[str, list[int]] = {}
        # Per sequence: hashes of its leading full blocks (the hash chain), and how many of its
        # blocks are registered in the prefix cache.
        self._hashes: dict[str, list[bytes]] = {}
        self._num_hashed: dict[str, int] = {}
        # Per sequence: how many of its leading blocks were released behind the window.
        self._num_released: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks the sequence holds a reference to (its released ones not counted)."""
        return len(seq.block_ids) - self._num_released.get(seq.seq_id, 0)

    def _first_needed_block(self, start: int) -> int:
        """The first block that rows from position ``start`` on can read."""
        if self.sliding_window is None:
            return 0
        return max(0, start - self.sliding_window + 1) // self.block_size

    def _release_behind_window(self, seq: Sequence, start: int) -> None:
        """Release the blocks wholly behind the window of rows from ``start`` on."""
        done = self._num_released.get(seq.seq_id, 0)
        end = min(self._first_needed_block(start), len(seq.block_ids))
        if end <= done:
            return
        self.pool.release(seq.block_ids[done:end])
        seq.block_ids[done:end] = [NULL_BLOCK] * (end - done)
        self._num_released[seq.seq_id] = end

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        salt = seq.request.prefix_cache_key
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else NONE_HASH
            hashes.append(hash_block(parent, seq.token_ids(i * bs, (i + 1) * bs), salt))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks (at least one token stays
        uncomputed, so the last token is always recomputed to produce logits)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(seq, num_full):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after the cached prefix).

        Returns False when the pool cannot hold them; then it has only released (all-sliding
        models) the blocks behind the window, which no later step of the sequence reads.
        """
        bs = self.block_size
        if not cached and self.sliding_window is not None:
            self._release_behind_window(seq, seq.num_computed_tokens)
        if cached:
            total = max(seq.num_computed_tokens, len(cached) * bs) + num_new_tokens
            need = cdiv(total, bs) - len(seq.block_ids) - len(cached)
            # Cached blocks sitting in the free list are taken out of it by touch().
            reclaimed = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
            if need > self.pool.num_free - reclaimed:
                return False
            for block_id in cached:
                self.pool.touch(block_id)
            seq.block_ids.extend(cached)
        else:
            total = seq.num_computed_tokens + num_new_tokens
            need = cdiv(total, bs) - len(seq.block_ids)
            if need > self.pool.num_free:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        if cached:
            self._release_behind_window(seq, max(seq.num_computed_tokens, len(cached) * bs))
        # (most decode steps fill no block: nothing new to hash, so no call)
        if self.enable_prefix_caching and total // bs > self._num_hashed.get(seq.seq_id, 0):
            self._cache_full_blocks(seq, total)
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that will be full of known tokens after this step."""
        # Pending tokens are not known yet: their block is hashed once they are.
        num_full = min(num_tokens, seq.num_known_tokens) // self.block_size
        done = max(self._num_hashed.get(seq.seq_id, 0), self._num_released.get(seq.seq_id, 0))
        if num_full <= done:
            return
        hashes = self._block_hashes(seq, num_full)
        stored = [i for i in range(done, num_full) if self.pool.cache(seq.block_ids[i], hashes[i])]
        self._num_hashed[seq.seq_id] = num_full
        if stored and self.pool.events is not None:
            self._record_stored(seq, stored)

    def _record_stored(self, seq: Sequence, stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached blocks of ``seq``."""
        events = self.pool.events
        assert events is not None
        external = self._external_block_hashes(seq, stored[-1] + 1)
        salt = seq.request.cache_salt
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            for i in run:
                self.pool.external_hashes[seq.block_ids[i]] = external[i]
            event = BlockStored(
                block_hashes=[external[i] for i in run],
                parent_block_hash=external[run[0] - 1] if run[0] else None,
                token_ids=seq.token_ids(run[0] * bs, (run[-1] + 1) * bs),
                block_size=bs,
                extra_keys=[[salt] if salt and i == 0 else None for i in run],
                sliding_window=self.sliding_window,
            )
            events.pending.append(event)

    def _external_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The published hashes of the sequence's first ``num_blocks`` blocks (``kv_events``);
        a cache salt enters the first block's, as vLLM's extra keys carry it."""
        events = self.pool.events
        assert events is not None
        hashes = self._external_hashes.setdefault(seq.seq_id, [])
        salt = seq.request.cache_salt
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else events.root_hash
            extra = [salt] if salt and i == 0 else None
            hashes.append(external_block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs), extra))
        return hashes

    def share_prefix(self, child: Sequence, parent: Sequence) -> int:
        """Give ``child`` references to ``parent``'s full prompt blocks; returns tokens shared.

        The partial last block (and always the last prompt token) is recomputed by the child.
        Under a sliding window the child takes only the blocks its window reads; if the parent
        already released one of those, the child shares nothing and computes its prompt.
        """
        num_shared = (child.num_prompt_tokens - 1) // self.block_size
        first = self._first_needed_block(num_shared * self.block_size)
        if first < self._num_released.get(parent.seq_id, 0):
            num_shared = first = 0
        for block_id in parent.block_ids[first:num_shared]:
            self.pool.touch(block_id)
        child.block_ids = [NULL_BLOCK] * first + parent.block_ids[first:num_shared]
        self._num_hashed.pop(child.seq_id, None)
        self._num_released[child.seq_id] = first
        return num_shared * self.block_size

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU evicts a sequence's end before its shared prefix.
        num_released = self._num_released.pop(seq.seq_id, 0)
        self.pool.release(seq.block_ids[num_released:][::-1])
        seq.block_ids = []
        self._num_hashed.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._external_hashes.pop(seq.seq_id, None)

    def forget_hashes(self, seq: Sequence) -> None:
        self._hashes.pop(seq.seq_id, None)
        self._external_hashes.pop(seq.seq_id, None)
