"""Per-client rate limits: requests per minute and tokens per minute (``--rate-limit-rpm``,
``--rate-limit-tpm``).

A client is its API key when the server checks one, else its address (as uvicorn reports it;
behind a proxy, set the limits there). Each limit is a token bucket holding one minute's
allowance that refills continuously, so a client may burst up to the per-minute limit and then
proceeds at the steady rate. ``app.py`` charges one request when a generation route is entered,
before its body is read; ``RateLimitedContext`` charges the tokens once the prompts are
tokenized, before anything reaches the engine: every prompt's tokens plus ``n`` (or
``best_of``) times its ``max_tokens``, reserved then and not refunded when a sample stops early.
Past either limit the answer is 429 ``rate_limit_exceeded`` with ``Retry-After``, the whole
seconds until the charge would fit.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from jaxserve.engine.interfaces import EngineClient
from jaxserve.engine.outputs import RequestOutput
from jaxserve.server.api.errors import APIError
from jaxserve.server.context import EventStreamResponse, ServingContext
from jaxserve.server.generation import Generation
from jaxserve.server.guard.auth import client_key
from jaxserve.server.settings import ServerSettings

# Buckets kept at most; the least recently used is forgotten first (a fresh, full bucket).
MAX_CLIENTS = 10_000
# Retry-After for a charge larger than a whole minute's allowance (it can never fit).
RETRY_NEVER_S = 60


class RateLimitError(APIError):
    """A 429 from a rate limit; ``reason`` ("requests" or "tokens") labels the metric."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(
            429,
            message,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
        )
        self.reason = reason


@dataclasses.dataclass
class Bucket:
    level: float  # what is left to spend
    updated: float  # clock() at the last refill


class TokenBucket:
    """One per-minute limit over every client: ``spend`` succeeds or says how long to wait."""

    def __init__(
        self,
        per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute={per_minute} must be >= 1")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # refilled per second
        self.clock = clock
        self.max_clients = max_clients
        self.buckets: collections.OrderedDict[str, Bucket] = collections.OrderedDict()

    def spend(self, client: str, amount: int) -> float:
        """Take ``amount`` from ``client``'s bucket: 0.0 if it fit, else seconds to wait."""
        now = self.clock()
        bucket = self.buckets.pop(client, None) or Bucket(self.capacity, now)
        bucket.level = min(self.capacity, bucket.level + (now - bucket.updated) * self.rate)
        bucket.updated = now
        self.buckets[client] = bucket  # most recently used last
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        if amount > self.capacity:
            return math.inf
        if amount > bucket.level:
            return (amount - bucket.level) / self.rate
        bucket.level -= amount
        return 0.0


class RateLimiter:
    """The server's limits; either may be None (unlimited)."""

    def __init__(
        self,
        rpm: int | None,
        tpm: int | None,
        uses_api_key: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requests = TokenBucket(rpm, clock) if rpm is not None else None
        self.tokens = TokenBucket(tpm, clock) if tpm is not None else None
        self.uses_api_key = uses_api_key

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> RateLimiter | None:
        if settings.rate_limit_rpm is None and settings.rate_limit_tpm is None:
            return None
        return cls(settings.rate_limit_rpm, settings.rate_limit_tpm, settings.api_key is not None)

    def client_of(self, request: Request) -> str:
        return client_key(request, self.uses_api_key)

    def charge_request(self, request: Request) -> None:
        if self.requests is None:
            return
        wait_s = self.requests.spend(self.client_of(request), 1)
        if wait_s:
            raise RateLimitError(
                f"Rate limit reached: {int(self.requests.capacity)} requests per minute. "
                f"Retry in {math.ceil(wait_s)} s.",
                "requests",
                wait_s,
            )

    def charge_tokens(self, request: Request, num_tokens: int) -> None:
        if self.tokens is None:
            return
        limit = int(self.tokens.capacity)
        wait_s = self.tokens.spend(self.client_of(request), num_tokens)
        if wait_s == math.inf:
            raise RateLimitError(
                f"Request too large: it needs {num_tokens} tokens (prompt + n * max_tokens) "
                f"and the limit is {limit} tokens per minute. Reduce the prompt, n or "
                "max_tokens.",
                "tokens",
                RETRY_NEVER_S,
            )
        if wait_s:
            raise RateLimitError(
                f"Rate limit reached: {limit} tokens per minute (this request needs "
                f"{num_tokens}). Retry in {math.ceil(wait_s)} s.",
                "tokens",
                wait_s,
            )


def generation_cost(generation: Generation) -> int:
    """Tokens a generation may use: each prompt, plus each sample's ``max_tokens``."""
    return sum(
        len(r.prompt_token_ids) + r.params.num_samples * (r.params.max_tokens or 0)
        for r in generation.requests
    )


class RateLimitedContext(ServingContext):
    """``ServingContext`` that charges a generation's tokens before it reaches the engine."""

    def __init__(
        self, engine: EngineClient, settings: ServerSettings, limiter: RateLimiter
    ) -> None:
        super().__init__(engine, settings)
        self.limiter = limiter

    async def collect(self, generation: Generation, request: Request) -> list[RequestOutput | None]:
        self.limiter.charge_tokens(request, generation_cost(generation))
        return await super().collect(generation, request)

    async def stream(
        self, generation: Generation, request: Request, events: Any
    ) -> EventStreamResponse:
        self.limiter.charge_tokens(request, generation_cost(generation))
        return await super().stream(generation, request, events)
