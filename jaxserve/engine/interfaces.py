"""The typed interfaces between layers: what the engine needs from a model runner (``Runner``)
and what the HTTP server needs from an engine (``EngineClient``).

``ModelRunner`` and ``AsyncEngine`` implement them; tests pass fakes that do too. Nothing in
``jaxserve.server`` reaches past ``EngineClient`` into the engine's internals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import EngineConfig
from jaxserve.runner.capacity import Capacity
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_aborted: int
    num_steps: int


class Runner(Protocol):
    """What the engine needs from a model runner (``ModelRunner``; tests pass a fake)."""

    num_blocks: int
    capacity: Capacity
    multihost: bool

    @property
    def ready_tokens(self) -> int: ...  # the largest step whose programs have all compiled

    def warmup(self) -> int: ...
    # A dispatched step is the runner's own handle (``InFlight``), passed back as it is.
    # ``defer_sampling``: queue the forward pass only; the engine fills the constrained
    # sequences' rows of ``token_mask_buffer`` (i32[>= num_scheduled, ceil(V / 32)], every bit
    # set), then ``dispatch_sampler`` queues the sampler with it.
    def dispatch(
        self, output: SchedulerOutput, previous: Any = None, defer_sampling: bool = False
    ) -> Any: ...
    def token_mask_buffer(self, step: Any) -> Any: ...
    def dispatch_sampler(self, step: Any) -> None: ...
    def collect(self, step: Any) -> RunnerOutput: ...
    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...
    def shutdown(self) -> None: ...


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Tokenizer
    max_model_len: int
    dead_error: BaseException | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def is_alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def num_unfinished(self) -> int: ...

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def compile_grammar(self, params: SamplingParams, client: str = "") -> None:
        """Compile (and cache) ``params.structured_outputs`` ahead of ``generate``, sharing the
        compile workers fairly between ``client``s; ``RequestError`` naming the field if it is
        invalid, too large or too slow."""
        ...
