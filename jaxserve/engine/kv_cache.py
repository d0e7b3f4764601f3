"""The KV block pool: fixed-size blocks, ref counts, prefix caching, LRU eviction.

The scheduler asks ``KVCacheManager`` for blocks; the runner turns each sequence's
``block_ids`` into the page table the attention kernel reads. A block that is full of known
tokens gets a chained SHA-256 hash (parent hash, its token ids, extra keys such as a tenant
salt); freed blocks keep their hash and stay hittable until they are reused, least recently
freed first.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence as Seq

import numpy as np

from jaxserve.engine.request import Sequence

NONE_HASH = b"\x00" * 32


def hash_block(parent_hash: bytes, token_ids: Seq[int], extra_key: str | None = None) -> bytes:
    h = hashlib.sha256(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key:
        h.update(extra_key.encode())
    return h.digest()


class BlockPool:
    """Blocks with ref counts; free blocks in LRU order; hash -> cached block id."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
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

    def cache(self, block_id: int, block_hash: bytes) -> None:
        if self.block_hashes[block_id] is None and block_hash not in self.cached:
            self.block_hashes[block_id] = block_hash
            self.cached[block_hash] = block_id

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free):
            self._evict(block_id)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Per sequence: hashes of its leading full blocks (the hash chain), and how many of its
        # blocks are registered in the prefix cache.
        self._hashes: dict[str, list[bytes]] = {}
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        salt = seq.request.cache_salt
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

        Returns False, changing nothing, when the pool cannot hold them.
        """
        bs = self.block_size
        if cached:
            total = max(seq.num_computed_tokens, len(cached) * bs) + num_new_tokens
            need = -(-total // bs) - len(seq.block_ids) - len(cached)
            # Cached blocks sitting in the free list are taken out of it by touch().
            reclaimed = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
            if need > self.pool.num_free - reclaimed:
                return False
            for block_id in cached:
                self.pool.touch(block_id)
            seq.block_ids.extend(cached)
        else:
            total = seq.num_computed_tokens + num_new_tokens
            need = -(-total // bs) - len(seq.block_ids)
            if need > self.pool.num_free:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, total)
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that will be full of known tokens after this step."""
        # Pending tokens are not known yet: their block is hashed once they are.
        num_full = min(num_tokens, seq.num_known_tokens) // self.block_size
        done = self._num_hashed.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(done, num_full):
            self.pool.cache(seq.block_ids[i], hashes[i])
        self._num_hashed[seq.seq_id] = num_full

    def share_prefix(self, child: Sequence, parent: Sequence) -> int:
        """Give ``child`` references to ``parent``'s full prompt blocks; returns tokens shared.

        The partial last block (and always the last prompt token) is recomputed by the child.
        """
        num_shared = (child.num_prompt_tokens - 1) // self.block_size
        for block_id in parent.block_ids[:num_shared]:
            self.pool.touch(block_id)
        child.block_ids = list(parent.block_ids[:num_shared])
        self._num_hashed.pop(child.seq_id, None)
        return num_shared * self.block_size

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU evicts a sequence's end before its shared prefix.
        self.pool.release(seq.block_ids[::-1])
        seq.block_ids = []
        self._num_hashed.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)

    def forget_hashes(self, seq: Sequence) -> None:
        self._hashes.pop(seq.seq_id, None)
