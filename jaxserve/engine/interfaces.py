"""The typed interfaces between layers: what the engine needs from a model runner (``Runner``)
and what the HTTP server needs from an engine (``EngineClient``).

``ModelRunner`` and ``AsyncEngine`` implement them; tests pass fakes that do too. Nothing in
``jaxserve.server`` reaches past ``EngineClient`` into the engine's internals. Importing this
module loads no jax: the runner's types that need it are named for the type checker only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import EngineConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.step import RunnerOutput, SchedulerOutput
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.runner.capacity import Capacity
    from jaxserve.runner.in_flight import InFlight


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can be served (``EngineClient.generate``)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its cap (the server answers 429 with Retry-After)."""


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
    # KV-cache blocks in the pool (vllm:cache_config_info's num_gpu_blocks); 0: not known.
    num_gpu_blocks: int = 0
    # LoRA (vllm:lora_requests_info): the adapters of running and of waiting requests, and the
    # device slots; empty / 0 with LoRA off.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Speculative decoding (vllm:spec_decode_*; engine/spec_decode.py SpecDecodeStats): drafts
    # verified, tokens drafted, drafts accepted, and accepted drafts by position in the draft;
    # spec_decode False: speculation is off (those series are not exported).
    spec_decode: bool = False
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class Runner(Protocol):
    """What the engine needs from a model runner (``ModelRunner``; tests pass a fake).

    A step crosses in three calls, as vLLM v1's ``execute_model`` then ``sample_tokens``:
    ``dispatch`` queues its forward pass, ``sample`` its sampler (with the step's token mask
    when ``SchedulerOutput.is_constrained``), ``collect`` waits for its tokens."""

    num_blocks: int
    capacity: Capacity
    multihost: bool

    @property
    def weights(self) -> object: ...  # the served weights, a pytree (``models/layers.Weights``)

    @property
    def ready_tokens(self) -> int: ...  # the largest step whose programs have all compiled

    @property
    def compile_seconds(self) -> float: ...  # warm-up's, before the engine serves

    def warmup(self) -> int: ...
    # ``previous``: the step dispatched just before, not yet collected (asynchronous scheduling)
    def dispatch(self, output: SchedulerOutput, previous: InFlight | None = None) -> InFlight: ...
    # ``token_mask``: i32[num_scheduled, ceil(V / 32)], row i the tokens sequence i may take
    # (bit v % 32 of word v // 32); None: no constraint. Copied before ``sample`` returns.
    def sample(self, step: InFlight, token_mask: np.ndarray | None) -> None: ...
    def collect(self, step: InFlight) -> RunnerOutput: ...
    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...  # all three, unconstrained
    # The kept states' rows of a sequence start ``delta`` positions further (a verify step
    # scheduled before the one ahead of it was read back: ``runner/verify_ahead.py``).
    def shift_states(self, seq_id: str, delta: int) -> None: ...
    # New weights, served from the next step (``runner/weight_update.py``): a pytree laid out
    # as ``weights`` or named as Hugging Face or flax.nnx name them (``layout``), or a
    # checkpoint of this model, safetensors or converted (orbax) (returns the load's seconds).
    def update_weights(self, weights: object, layout: str = "auto") -> None: ...
    def load_weights_from(self, model_dir: str | Path) -> float: ...
    # Sleep mode (``runner/sleep.py``): level 1 keeps the weights in host memory, 2 drops them.
    @property
    def is_sleeping(self) -> bool: ...
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: tuple[str, ...]) -> None: ...
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
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput]: ...

    def encode(
        self,
        prompt_token_ids: Sequence[int],
        params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        group_id: str | None = None,
        token_type_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[RequestOutput]:
        """A pooling request (an engine started with ``runner="pooling"``): one finished
        output whose ``embedding`` is set (``score`` with ``params.task == "score"``;
        ``token_type_ids``: an encoder text pair's). ``RequestError`` (a ``ValueError`` naming the
        field) for a request it cannot take, a generation engine's included."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (``ValueError`` naming what does not fit)."""
        ...

    async def remove_lora(self, lora_int_id: int) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def update_weights_from_disk(self, model_path: str | Path) -> float:
        """Serve the checkpoint in ``model_path`` (this model's tensors; safetensors or
        converted with orbax): running sequences finish first, waiting ones start on the new
        weights; the load's seconds.
        ``ValueError`` / ``OSError`` naming the tensor or file that does not fit, and nothing
        changes."""
        ...

    @property
    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int) -> None:
        """Give the model's device memory up (sleep mode) once the running sequences finish;
        ``RuntimeError`` where sleep mode is off, ``ValueError`` for a level not 1 or 2."""
        ...

    async def wake_up(self, tags: tuple[str, ...]) -> None:
        """Take back the memory of ``tags`` (some of "weights", "kv_cache")."""
        ...

    @property
    def is_paused(self) -> bool: ...

    async def pause(self, mode: str = "wait") -> None:
        """Stop generating until ``resume``: ``"wait"`` for the running sequences, ``"abort"``
        them, or ``"keep"`` them in place; ``ValueError`` for another mode."""
        ...

    async def resume(self) -> None: ...

    async def compile_grammar(self, params: SamplingParams, client: str = "") -> None:
        """Compile (and cache) ``params.structured_outputs`` ahead of ``generate``, sharing the
        compile workers fairly between ``client``s; ``RequestError`` naming the field if it is
        invalid, too large or too slow."""
        ...
