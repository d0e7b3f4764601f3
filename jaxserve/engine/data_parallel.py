"""DataParallelEngine: ``data_parallel_size`` engines on one host behind one ``EngineClient``.

``jaxserve serve --data-parallel-size N`` (and tests) build it with ``from_config``: replica
``r`` is an ``AsyncEngine`` of its own (scheduler, KV cache, engine thread) on the devices
``[r x TP, (r + 1) x TP)`` (``runner/parallel/mesh.replica_devices``). The server sees one
engine: ``generate`` asks the ``Balancer`` (``balancer.py``) for a replica and streams that
replica's outputs; ``abort`` finds the replica that holds the request; ``stats`` sums the
replicas (``replica_stats`` gives each one's); the weight, sleep and pause calls go to every
replica. The server stays unchanged, and like it this module loads no jax of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.balancer import Balancer
from jaxserve.engine.interfaces import EngineStats
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine_config import EngineConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

_LOG = logging.getLogger(__name__)


class DataParallelEngine:
    def __init__(self, replicas: Sequence[Any], balancer: Balancer) -> None:
        """``replicas``: started or startable engine clients of one model (AsyncEngines;
        tests may pass fakes), in rank order."""
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        self.balancer = balancer
        first = self.replicas[0]
        self.config: EngineConfig = first.config
        self.tokenizer = first.tokenizer
        self.max_model_len: int = first.max_model_len
        self._owner: dict[str, int] = {}  # request id -> the replica that serves it
        self._dead_error: BaseException | None = None

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_queued_requests: int | None = None
    ) -> DataParallelEngine:
        """Build ``config.data_parallel_size`` engines, one after another (each loads its
        weights and compiles on its own devices); ``max_queued_requests`` caps each
        replica's waiting queue."""
        replicas: list[AsyncEngine] = []
        try:
            for rank in range(config.data_parallel_size):
                _LOG.info("Data parallel replica %d of %d", rank, config.data_parallel_size)
                replica_config = dataclasses.replace(config, data_parallel_rank=rank)
                replicas.append(AsyncEngine.from_config(replica_config, max_queued_requests))
        except BaseException:
            for replica in replicas:
                replica.shutdown()
            raise
        from jaxserve.runner.capacity import data_parallel_lines

        for line in data_parallel_lines(replicas[0].core.runner.capacity, len(replicas)):
            _LOG.info(line)
        return cls(
            replicas, Balancer(len(replicas), config.block_size, config.data_parallel_balancer)
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    @property
    def is_alive(self) -> bool:
        """Every replica's loop runs (one dead replica turns /health 503: the process exits
        and its orchestrator restarts it, as with one engine)."""
        return self._dead_error is None and all(r.is_alive for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        """The first dead replica's error (or one set here)."""
        errors = [self._dead_error, *(replica.dead_error for replica in self.replicas)]
        return next((error for error in errors if error is not None), None)

    @dead_error.setter
    def dead_error(self, error: BaseException | None) -> None:
        self._dead_error = error

    @property
    def vocab_size(self) -> int:
        return int(self.replicas[0].vocab_size)

    @property
    def scoring(self) -> Any:
        """How the model scores pairs (``engine/scoring.py``): the same on every replica."""
        return self.replicas[0].scoring

    def num_unfinished(self) -> int:
        return sum(replica.num_unfinished() for replica in self.replicas)

    def replica_stats(self) -> list[EngineStats]:
        return [replica.stats() for replica in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' counts summed; KV-cache usage their mean (equal pools); the adapters
        of running and waiting requests in all, each named once; the slots of one replica."""
        each = self.replica_stats()
        summed: dict[str, Any] = {}
        for field in dataclasses.fields(EngineStats):
            values = [getattr(s, field.name) for s in each]
            if isinstance(values[0], tuple):
                summed[field.name] = tuple(dict.fromkeys(v for value in values for v in value))
            else:
                summed[field.name] = sum(values)
        summed["kv_cache_usage"] = summed["kv_cache_usage"] / len(each)
        summed["max_lora"] = each[0].max_lora
        summed["spec_decode"] = any(s.spec_decode for s in each)
        per_pos = [s.spec_accepted_per_pos for s in each]  # position by position
        width = max(map(len, per_pos))
        summed["spec_accepted_per_pos"] = tuple(
            sum(p[i] for p in per_pos if i < len(p)) for i in range(width)
        )
        return EngineStats(**summed)

    # -- requests --------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """The chosen replica's deltas (the balancer counts the request until it ends). An
        adapter's prompts hash apart from the base model's, as their KV blocks do."""
        salt = (
            cache_salt if lora_request is None else f"{cache_salt or ''}|{lora_request.cache_key}"
        )
        stream = lambda replica: replica.generate(  # noqa: E731
            prompt_token_ids,
            params,
            request_id,
            prompt,
            priority,
            cache_salt,
            group_id,
            **({"lora_request": lora_request} if lora_request is not None else {}),
        )
        routed = self._routed(request_id, prompt_token_ids, params.num_samples, salt, stream)
        async with contextlib.aclosing(routed) as outputs:  # closed with this generator
            async for output in outputs:
                yield output

    async def encode(
        self,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        group_id: str | None = None,
        token_type_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """A pooling request, on the replica the balancer picks."""
        stream = lambda replica: replica.encode(  # noqa: E731
            prompt_token_ids, params, request_id, prompt, priority, group_id, token_type_ids
        )
        routed = self._routed(request_id, prompt_token_ids, 1, None, stream)
        async with contextlib.aclosing(routed) as outputs:  # closed with this generator
            async for output in outputs:
                yield output

    async def _routed(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_seqs: int,
        salt: str | None,
        stream: Callable[[Any], AsyncGenerator[RequestOutput]],
    ) -> AsyncGenerator[RequestOutput]:
        rank = self.balancer.pick(prompt_token_ids, num_seqs, salt)
        self._owner[request_id] = rank
        try:
            async with contextlib.aclosing(stream(self.replicas[rank])) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._owner.pop(request_id, None)
            self.balancer.release(rank, num_seqs)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Loaded on every replica (a request for it may go to any)."""
        await asyncio.gather(*(r.add_lora(lora_request) for r in self.replicas))

    async def remove_lora(self, lora_int_id: int) -> None:
        await asyncio.gather(*(r.remove_lora(lora_int_id) for r in self.replicas))

    async def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            await self.replicas[rank].abort(request_id)

    async def compile_grammar(self, params: SamplingParams, client: str = "") -> None:
        """Compiled by every replica (each keeps its own cache; the request may go to any)."""
        await asyncio.gather(*(r.compile_grammar(params, client) for r in self.replicas))

    async def update_weights_from_disk(self, model_path: str | Path) -> float:
        seconds = await asyncio.gather(
            *(r.update_weights_from_disk(model_path) for r in self.replicas)
        )
        return max(seconds)

    @property
    def is_sleeping(self) -> bool:
        return any(replica.is_sleeping for replica in self.replicas)

    async def sleep(self, level: int) -> None:
        await asyncio.gather(*(replica.sleep(level) for replica in self.replicas))

    async def wake_up(self, tags: tuple[str, ...]) -> None:
        await asyncio.gather(*(replica.wake_up(tags) for replica in self.replicas))

    @property
    def is_paused(self) -> bool:
        return any(replica.is_paused for replica in self.replicas)

    async def pause(self, mode: str = "wait") -> None:
        await asyncio.gather(*(replica.pause(mode) for replica in self.replicas))

    async def resume(self) -> None:
        await asyncio.gather(*(replica.resume() for replica in self.replicas))
