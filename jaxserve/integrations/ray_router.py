"""Prefix-aware request routing for the Ray Serve deployment (``request_router=prefix``).

``PrefixRequestRouter`` is a Ray Serve ``RequestRouter``: it runs inside each caller's
``DeploymentHandle`` (another deployment, a driver, or Ray's HTTP proxy) and picks the replica
of every request. For a request whose first argument carries prompt token ids (a
``PromptRequest``, sent to ``JaxserveReplica.generate`` through a handle) it applies the rule of
the data-parallel balancer (``jaxserve/engine/balancer.py``): the prompt's full KV blocks are
hashed as a chain, the replica that last took the longest matching chain is preferred unless its
queue (Ray's cached queue length of the replica) exceeds the shortest by more than the
balancer's load gap, and the prompt's blocks are recorded for the replica that took it. Other
requests (HTTP requests through Ray's proxy, whose body the router never sees) go to the less
loaded of two random replicas, as Ray's default router does.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from jaxserve.engine.balancer import (
    LOAD_GAP_FRACTION,
    MAX_TABLE_BLOCKS,
    MIN_LOAD_GAP,
    prefix_block_hashes,
)


@dataclasses.dataclass
class PromptRequest:
    """A request for ``JaxserveReplica.generate`` through a Ray Serve handle: token ids in,
    streamed token ids out (greedy unless ``temperature`` > 0)."""

    prompt_token_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    cache_salt: str | None = None


def request_prompt(pending_request: PendingRequest | None) -> PromptRequest | None:
    """The ``PromptRequest`` a pending request carries as its first argument, if any."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, PromptRequest) else None


class PrefixRequestRouter(FIFOMixin, RequestRouter):
    """Routes a ``PromptRequest`` to the replica that last took its longest prefix (the
    module's docstring); every other request to the less loaded of two random replicas."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``request_router_kwargs``: ``block_size``, the engine's KV block size."""
        self.block_size = int(kwargs.get("block_size", 16))
        self.table: collections.OrderedDict[bytes, ReplicaID] = collections.OrderedDict()
        self.num_prefix_routed = 0

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        request = request_prompt(pending_request)
        if request is None:
            return []
        return prefix_block_hashes(request.prompt_token_ids, self.block_size, request.cache_salt)

    def _queue_len(self, replica: RunningReplica) -> int:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if queue_len is None else queue_len

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranked tiers: the prefix's replica alone first (when its queue is within the load
        gap), then the others; Ray takes the least loaded replica of the first tier that has
        room."""
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        preferred = None
        for block_hash in reversed(self._hashes(pending_request)):
            preferred = by_id.get(self.table.get(block_hash))  # type: ignore[arg-type]
            if preferred is not None:
                break
        others = [r for r in candidate_replicas if r is not preferred]
        two = random.sample(others, min(2, len(others)))
        if preferred is None:
            return [two]
        least = min(self._queue_len(r) for r in candidate_replicas)
        if self._queue_len(preferred) - least <= max(MIN_LOAD_GAP, LOAD_GAP_FRACTION * least):
            self.num_prefix_routed += 1
            return [[preferred], two] if two else [[preferred]]
        return [two + [preferred]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Record the prompt's blocks for the replica that took it."""
        for block_hash in self._hashes(pending_request):
            self.table[block_hash] = replica_id
            self.table.move_to_end(block_hash)
        while len(self.table) > MAX_TABLE_BLOCKS:
            self.table.popitem(last=False)
