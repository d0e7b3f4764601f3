"""GrammarCompiler: a request's ``StructuredOutputsParams`` -> a compiled grammar, cached.

The grammar engine is llguidance (docs/structured_outputs.md says why): it builds a token
matcher from a JSON schema, a regex, a list of choices or a Lark / GBNF grammar over the
model's tokenizer, and fills packed token bitmasks in numpy. A compiled grammar is a matcher
in its start state; each sequence that uses it gets a copy (``structured_outputs.py``).

The server compiles a request's grammar on its host-work thread before it submits the request
(``EngineClient.compile_grammar``); ``EngineCore.add_request`` then finds it in the cache (the
offline ``LLM`` compiles there, on the caller's thread). Compiling runs on this module's own
threads, so a caller waits at most ``timeout_s``: a grammar that takes longer is refused, as
is any invalid input, with a ``GrammarError`` naming the field.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
from typing import Any

from jaxserve.engine.request_checks import RequestError
from jaxserve.sampling_params import StructuredOutputsParams

DEFAULT_COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 512  # compiled grammars kept (least recently used goes first)


class GrammarError(RequestError):
    """An invalid or too costly constraint; ``field`` names the ``StructuredOutputsParams``
    field (json, json_object, regex, choice, grammar), ``param`` the same under
    ``structured_outputs``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, param=f"structured_outputs.{field}")
        self.field = field


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


def llguidance_grammar(field: str, source: str) -> str:
    """The llguidance grammar of one constraint (not yet checked against the tokenizer)."""
    import llguidance

    # NOTE: compact JSON (no free whitespace between tokens): a model cannot spend its
    # whole budget on blank space, and outputs parse the same.
    options: Any = {"whitespace_flexible": False}
    if field == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, options)
    if field == "json":
        try:
            schema = json.loads(source)
        except ValueError as exc:
            raise GrammarError("json", f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("json", "the JSON schema must be an object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(source, options)
    if field == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if field == "choice":
        choices = json.loads(source)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice", "choice must be a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", choices)
    try:
        return llguidance.grammar_from("grammar", source)  # Lark, or GBNF converted to it
    except ValueError as exc:
        raise GrammarError("grammar", f"the grammar is not valid: {exc}") from None


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; thread-safe."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._tokenizer: Any = None  # llguidance.LLTokenizer, made on first use (~1 s)
        self._lock = threading.Lock()
        # key -> the compile (its result: a matcher in the start state, or a GrammarError)
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-grammar")

    @property
    def tokenizer(self) -> Any:
        """The llguidance tokenizer over the model's vocabulary (ids past the tokenizer's own
        are never allowed)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                # Only ids the tokenizer has can end a constrained output (a dummy model's
                # config may name an EOS past a small stand-in tokenizer).
                size = len(self._hf_tokenizer)
                eos = [t for t in self.eos_token_ids if t < size] or None
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (an ``llguidance.LLMatcher`` in its start state, to be copied,
        never advanced); ``GrammarError`` if the constraint is invalid or compiling it takes
        longer than ``timeout_s``."""
        tokenizer = self.tokenizer
        key = grammar_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(_build, tokenizer, *key)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            error = GrammarError(
                key[0], f"compiling the {key[0]} constraint took longer than {self.timeout_s:g} s"
            )
            refused: concurrent.futures.Future = concurrent.futures.Future()
            refused.set_exception(error)
            with self._lock:  # refused from now on, even once the compile ends
                if key in self._cache:
                    self._cache[key] = refused
            raise error from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _build(tokenizer: Any, field: str, source: str) -> Any:
    import llguidance

    grammar = llguidance_grammar(field, source)
    try:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask's lexer work, here rather than in a step
    except BaseException as exc:  # noqa: BLE001  llguidance's Rust panics are BaseExceptions
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(field, f"invalid {field} constraint: {exc}") from None
    if matcher.is_error():
        raise GrammarError(field, f"invalid {field} constraint: {matcher.get_error().strip()}")
    return matcher
