"""GrammarCompiler: a request's ``StructuredOutputsParams`` -> a compiled grammar, cached.

The grammar engine is llguidance (docs/structured_outputs.md says why): it builds a token
matcher from a JSON schema, a regex, a list of choices or a Lark / GBNF grammar over the
model's tokenizer, and fills packed token bitmasks in numpy. A compiled grammar is a matcher
in its start state; each sequence that uses it gets a copy (``structured_outputs.py``).

The server asks for a request's grammar before it submits the request (``compile_async``, which
waits without holding a thread); ``EngineCore.add_request`` then finds it in the cache (the
offline ``LLM`` compiles there, blocking, with ``compile``). What reaches llguidance is bounded
(docs/security.md): a source of at most ``max_grammar_bytes``, compiled on the big-stack workers
of ``compile_queue.py`` within ``timeout_s``, GBNF converted in a process of its own (gbnf.py),
and a grammar that cannot take its first tokens within llguidance's limits refused here rather
than in a step. Every refusal is a ``GrammarError`` naming the field; a timeout is never cached.
The cache is bounded in bytes: each grammar is charged its native memory as it compiles.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import threading
import time
from typing import Any

import numpy as np

from jaxserve.engine.compile_queue import CompileQueue, Job
from jaxserve.engine.gbnf import ConversionError, gbnf_to_lark, is_gbnf
from jaxserve.engine.native_memory import resident_bytes
from jaxserve.engine.request_checks import RequestError
from jaxserve.json_limits import (
    MAX_GRAMMAR_ENGINE_DEPTH,
    JsonLimitError,
    grammar_schema,
)
from jaxserve.sampling_params import DEFAULT_MAX_GRAMMAR_BYTES, StructuredOutputsParams

_LOG = logging.getLogger(__name__)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 1 << 30
ERROR_CACHE_BYTES = 4096  # what a cached refusal is counted as
# NOTE: a compile is charged the most of its source's size, the resident memory it added and its
# seconds at this rate: what llguidance keeps grows with its build time. Resident growth misses
# what a compile takes from memory the process already holds (freed by an evicted grammar), so
# the rate must cover the fastest build per byte kept. Measured on one core of a 2-core CI-class
# host: a 60,000-character literal choice 24-31 MB in 0.046-0.060 s (400-530 MB/s, the fastest),
# a{100000} 40 MB in 0.09 s, JSON schemas 2 MB in 6 ms, a 3,000-way regex 1.6 MB in 14 ms. Twice
# the fastest leaves room for a faster core; a slower or busy one is overcharged (the cache holds
# fewer). Exact accounting (mallinfo2) cost 20-25 ms a call in a served process (native_memory.py).
BYTES_PER_COMPILE_SECOND = 1 << 30


class GrammarError(RequestError):
    """An invalid or too costly constraint; ``field`` names the ``StructuredOutputsParams``
    field (json, json_object, regex, choice, grammar), ``param`` the same under
    ``structured_outputs``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, param=f"structured_outputs.{field}")
        self.field = field


class _Timeout(GrammarError):
    """A compile that missed its deadline: refused, never cached."""


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(field, source): what makes two constraints the same grammar."""
    if spec.json is not None:
        return "json", spec.json
    if spec.json_object:
        return "json_object", ""
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice)
    assert spec.grammar is not None  # StructuredOutputsParams sets exactly one
    return "grammar", spec.grammar


@dataclasses.dataclass(frozen=True)
class GrammarLimits:
    """What a constraint may cost (the server's ``--grammar-*`` flags)."""

    timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    cache_bytes: int = DEFAULT_CACHE_BYTES

    @classmethod
    def of(cls, config: Any) -> GrammarLimits:
        """An ``EngineConfig``'s limits."""
        timeout_s = config.grammar_compile_timeout_s
        return cls(timeout_s, config.max_grammar_bytes, config.grammar_cache_bytes)


@dataclasses.dataclass(eq=False)
class _Entry:
    future: concurrent.futures.Future  # (matcher, native bytes), or the GrammarError
    job: Job | None  # while it compiles: a later caller extends its deadline
    num_bytes: int = 0  # native memory the compiled grammar keeps (0 while compiling)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; thread-safe."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: GrammarLimits | None = None,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits or GrammarLimits()
        self._tokenizer: Any = None  # llguidance.LLTokenizer, made on first use (~1 s)
        self._tokenizer_error: str | None = None  # why it cannot be made (then never tried again)
        self._lock = threading.RLock()  # a done callback may run inside _request
        self._tokenizer_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()
        self.cache_bytes = 0  # the finished entries' num_bytes
        self._queue = CompileQueue()

    def grammar_tokenizer(self, field: str) -> Any:
        """The llguidance tokenizer over the model's vocabulary (ids past the tokenizer's own
        are never allowed), made on a compile worker on first use; ``GrammarError`` naming
        ``field`` if llguidance cannot read the model's tokenizer (made once, tried once)."""
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                import llguidance.hf

                # Only ids the tokenizer has can end a constrained output (a dummy model's
                # config may name an EOS past a small stand-in tokenizer).
                size = len(self._hf_tokenizer)
                eos = [t for t in self.eos_token_ids if t < size] or None
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                    )
                except Exception as exc:  # noqa: BLE001  the same for every constraint
                    self._tokenizer_error = short_error(str(exc))
                    _LOG.warning("Structured outputs are off: %s", self._tokenizer_error)
        if self._tokenizer_error is not None:
            raise GrammarError(
                field,
                "constraints need a tokenizer the grammar engine can read; this model's "
                f"could not be read ({self._tokenizer_error})",
            )
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams, client: str = "") -> Any:
        """The compiled grammar (an ``llguidance.LLMatcher`` in its start state, to be copied,
        never advanced), waited for; ``GrammarError`` if the constraint is invalid, too large,
        or not compiled within ``limits.timeout_s``."""
        future, key = self._request(spec, client)
        try:
            return future.result(timeout=self.limits.timeout_s + 1.0)[0]
        except concurrent.futures.TimeoutError:  # the deadline watch fails it first
            raise self._timeout(key[0]) from None
        except GrammarError as exc:
            raise _fresh(exc) from None

    async def compile_async(self, spec: StructuredOutputsParams, client: str = "") -> Any:
        """``compile`` for an event loop: waits without holding a thread, and a caller that is
        cancelled (its client left) leaves the compile to the others waiting for it."""
        future, key = self._request(spec, client)
        try:
            matcher, _ = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.limits.timeout_s + 1.0
            )
        except TimeoutError:
            raise self._timeout(key[0]) from None
        except GrammarError as exc:
            raise _fresh(exc) from None
        return matcher

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        with self._lock:
            entry = self._cache.get(grammar_key(spec))
            return entry is not None and entry.future.done()

    def close(self) -> None:
        self._queue.close()

    # -- the cache ----------------------------------------------------------------------------

    def _request(
        self, spec: StructuredOutputsParams, client: str
    ) -> tuple[concurrent.futures.Future, tuple[str, str]]:
        key = grammar_key(spec)
        field, source = key
        if len(source) > self.limits.max_bytes or len(source.encode()) > self.limits.max_bytes:
            raise GrammarError(field, self._too_large(field, len(source.encode())))
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                job = self._queue.submit(
                    client,
                    len(source),
                    lambda job: self._build(job, key),
                    self.limits.timeout_s,
                    lambda: self._timeout(field),
                )
                # NOTE: the callback holds the key, not the entry: an evicted entry is then freed
                # at once (its matcher holds tens of MB of native memory, which the cyclic
                # collector, counting Python objects, would leave for a long while).
                entry = self._cache[key] = _Entry(job.future, job)
                job.future.add_done_callback(functools.partial(self._finished, key))
            elif entry.job is not None:
                self._queue.extend(entry.job, self.limits.timeout_s)
            self._cache.move_to_end(key)
        return entry.future, key

    def _build(self, job: Job, key: tuple[str, str]) -> tuple[Any, int]:
        """On a compile worker: the matcher, and the native bytes it keeps."""
        field, source = key
        tokenizer = self.grammar_tokenizer(field)
        grammar = llguidance_grammar(field, source, job)
        if len(grammar) > self.limits.max_bytes:  # a GBNF grammar's Lark, or a choice's
            raise GrammarError(field, self._too_large(field, len(grammar)))
        start, resident = time.perf_counter(), resident_bytes()
        matcher = _matcher(tokenizer, field, grammar)
        seconds, grown = time.perf_counter() - start, resident_bytes() - resident
        return matcher, max(len(source), grown, int(seconds * BYTES_PER_COMPILE_SECOND))

    def _finished(self, key: tuple[str, str], future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None and not isinstance(error, GrammarError):
            _LOG.error("Compiling a %s constraint failed: %r", key[0], error)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
                return
            entry.job = None
            if isinstance(error, _Timeout) or (error and not isinstance(error, GrammarError)):
                del self._cache[key]  # a timeout or a failure of ours: the next request tries
                return
            entry.num_bytes = ERROR_CACHE_BYTES if error else future.result()[1]
            self.cache_bytes += entry.num_bytes
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used finished grammars until the cache fits (under the
        lock); sequences using a dropped grammar keep their own copies."""
        for key in list(self._cache):
            if self.cache_bytes <= self.limits.cache_bytes:
                return
            entry = self._cache[key]
            if entry.num_bytes:
                del self._cache[key]
                self.cache_bytes -= entry.num_bytes

    def _timeout(self, field: str) -> GrammarError:
        return _Timeout(
            field,
            f"compiling the {field} constraint took longer than {self.limits.timeout_s:g} s "
            "(--grammar-compile-timeout)",
        )

    def _too_large(self, field: str, num_bytes: int) -> str:
        return (
            f"the {field} constraint is {num_bytes:,} bytes; the limit is "
            f"{self.limits.max_bytes:,} (--max-grammar-bytes)"
        )


def _fresh(error: GrammarError) -> GrammarError:
    """A copy of a cached refusal for one caller to raise: raising the cached one would hang
    each caller's frames (and the request body they hold) on it until the next raise."""
    return type(error)(error.field, str(error))


def llguidance_grammar(field: str, source: str, job: Job | None = None) -> str:
    """The llguidance grammar of one constraint (not yet checked against the tokenizer); a
    GBNF grammar is converted in a child process that ``job``'s cancellation kills."""
    import llguidance

    # NOTE: compact JSON (no free whitespace between tokens): a model cannot spend its
    # whole budget on blank space, and outputs parse the same.
    options: Any = {"whitespace_flexible": False}
    try:
        if field == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, options)
        if field == "json":
            try:
                schema = json.loads(source)  # RecursionError: too deep, below
            except ValueError as exc:
                raise GrammarError("json", f"the JSON schema is not valid JSON: {exc}") from None
            # true -> {}, false refused, depth and integer bounds as llguidance reads them
            # (two bounds below -2**63 crashed it); the server has done the same already
            text = grammar_schema(schema, "the JSON schema", MAX_GRAMMAR_ENGINE_DEPTH)
            return llguidance.LLMatcher.grammar_from_json_schema(text, options)
        if field == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if field == "choice":
            choices = json.loads(source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choice", "choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", choices)
        if is_gbnf(source):
            source = gbnf_to_lark(source, job.on_cancel if job else lambda kill: None)
        return llguidance.LLMatcher.grammar_from_lark(source)
    except JsonLimitError as exc:
        raise GrammarError(field, str(exc)) from None
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, GrammarError):
            raise
        noun = {"json": "JSON schema", "grammar": "grammar"}.get(field, field)
        message = str(exc) if isinstance(exc, ConversionError) else short_error(str(exc))
        raise GrammarError(field, f"the {noun} is not valid: {message}") from None


def _matcher(tokenizer: Any, field: str, grammar: str) -> Any:
    """The compiled matcher, its first mask computed (the lexer's work, here rather than in a
    step); refused if a copy cannot take the first token that mask allows within llguidance's
    limits (``a{1000000}``, a 20,000-way rule): such a grammar would otherwise fail at the
    first token of a step. One token: the H200's schema compile went from 1.3 to 5.6 ms p50
    with four, and every such grammar measured failed at the first."""
    import llguidance

    # NOTE: non-verbose errors: a verbose one carries the grammar and the parser's state, which
    # must reach neither the client nor the log.
    limits = llguidance.LLParserLimits(verbose_errors=False)
    try:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        probe = matcher.deep_copy()
        if not matcher.is_error() and not matcher.is_stopped():
            mask = np.frombuffer(matcher.compute_bitmask(), np.uint8)
            allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little"))
            if allowed.size:
                probe.consume_token(int(allowed[0]))
    except BaseException as exc:  # noqa: BLE001  llguidance's Rust panics are BaseExceptions
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(field, f"invalid {field} constraint: {short_error(str(exc))}") from None
    for state in (matcher, probe):
        if state.is_error():
            error = short_error(state.get_error())
            words = "invalid" if state is matcher else "too complex to follow"
            raise GrammarError(field, f"{words} {field} constraint: {error}")
    return matcher


def short_error(error: str, limit: int = 300) -> str:
    """An llguidance error without its ``<non-verbose/>`` marker, at most ``limit`` chars."""
    error = error.replace("<non-verbose/>", "").strip()
    return error if len(error) <= limit else error[: limit - 3] + "..."
