"""The data-parallel load balancer: which replica (engine) serves a request.

``DataParallelEngine`` asks ``pick`` for every request and reports its end with ``release``; the
balancer keeps the load of each replica (the sequences it routed there and that have not
finished: running, waiting, or not yet admitted) and, for the ``prefix`` policy, a bounded
table of where each prompt prefix was last sent. Nothing here reads a device or an engine.

The ``prefix`` rule, as SGLang's cache-aware router and vLLM's external prefix-aware routers do
it on whole KV blocks: the prompt's full blocks of ``block_size`` token ids (at most
``MAX_MATCH_BLOCKS``) are hashed as a chain, as the engine's prefix cache does (salted by
``cache_salt``); the replica that last took the longest matching chain is preferred, as its
prefix cache most likely holds those blocks, unless its load exceeds the least loaded
replica's by more than ``max(MIN_LOAD_GAP, LOAD_GAP_FRACTION x that load)``; otherwise, and for a
prompt no replica has seen, the least loaded replica (ties go round robin) takes it. Either
way the prompt's blocks are then recorded for the replica that took it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

# Prefix blocks looked up and recorded per prompt: enough for long system prompts and
# few-shot preambles, without hashing a whole long context.
MAX_MATCH_BLOCKS = 64
# Block hashes remembered (least recently used out); each maps to one replica.
MAX_TABLE_BLOCKS = 1 << 18
# The preferred replica keeps a prompt while its load is at most the least loaded replica's
# plus max(MIN_LOAD_GAP, LOAD_GAP_FRACTION x that load) sequences.
MIN_LOAD_GAP = 4
LOAD_GAP_FRACTION = 0.5


def prefix_block_hashes(
    prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """The chained hash of each of the prompt's first full blocks (at most MAX_MATCH_BLOCKS):
    hash i covers tokens [0, (i + 1) x block_size), so equal hashes mean equal prefixes."""
    num_blocks = min(len(prompt_token_ids) // block_size, MAX_MATCH_BLOCKS)
    parent = hashlib.sha256((cache_salt or "").encode()).digest()
    hashes = []
    for i in range(num_blocks):
        block = prompt_token_ids[i * block_size : (i + 1) * block_size]
        digest = hashlib.sha256(parent)
        digest.update(b",".join(str(int(t)).encode() for t in block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class Balancer:
    """Routes requests over ``num_replicas`` replicas by ``policy``: ``prefix`` (the rule in
    the module's docstring), ``least-loaded`` or ``round-robin``."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix") -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.loads = [0] * num_replicas  # sequences routed and not finished, per replica
        self.num_prefix_routed = [0] * num_replicas  # requests sent where their prefix was
        self._next = 0  # round robin, and the tie-break of least loaded
        self._table: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def pick(
        self,
        prompt_token_ids: Sequence[int],
        num_seqs: int = 1,
        cache_salt: str | None = None,
    ) -> int:
        """The replica for a request of ``num_seqs`` sequences; its load counts them until
        ``release``."""
        if self.policy == "round-robin":
            replica = self._round_robin()
        elif self.policy == "least-loaded":
            replica = self._least_loaded()
        else:
            replica = self._by_prefix(
                prefix_block_hashes(prompt_token_ids, self.block_size, cache_salt)
            )
        self.loads[replica] += num_seqs
        return replica

    def release(self, replica: int, num_seqs: int = 1) -> None:
        self.loads[replica] -= num_seqs

    def _round_robin(self) -> int:
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        return replica

    def _least_loaded(self) -> int:
        """The least loaded replica; among equals, the first from the round-robin cursor."""
        order = [(self._next + i) % self.num_replicas for i in range(self.num_replicas)]
        replica = min(order, key=lambda r: self.loads[r])
        self._next = (replica + 1) % self.num_replicas
        return replica

    def _by_prefix(self, hashes: list[bytes]) -> int:
        preferred = self._longest_match(hashes)
        least = min(self.loads)
        gap = max(MIN_LOAD_GAP, LOAD_GAP_FRACTION * least)
        if preferred is not None and self.loads[preferred] - least <= gap:
            replica = preferred
            self.num_prefix_routed[replica] += 1
        else:
            replica = self._least_loaded()
        for block_hash in hashes:
            self._table[block_hash] = replica
            self._table.move_to_end(block_hash)
        while len(self._table) > MAX_TABLE_BLOCKS:
            self._table.popitem(last=False)
        return replica

    def _longest_match(self, hashes: list[bytes]) -> int | None:
        """The replica recorded for the longest prefix of ``hashes`` in the table, or None."""
        for block_hash in reversed(hashes):
            replica = self._table.get(block_hash)
            if replica is not None:
                return replica
        return None
