"""SamplingParams: how one request is decoded; validated where it is made.

Limits are checked here, before anything is allocated, with errors that name the field and
the limit (the server turns them into 400s with ``param`` set). Checks that need the model
(vocabulary size for ``logit_bias`` and ``stop_token_ids``; ``top_k`` clamped to it) are in
``for_vocab``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any, NoReturn

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 1024  # each generated token is looked up in them
MAX_TEMPERATURE = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_RANGE = (-(2**63), 2**64)
# The largest constraint source compiled (a JSON schema, regex, choice list or grammar): the
# default of the engine's max_grammar_bytes (--max-grammar-bytes), which the compiler checks.
DEFAULT_MAX_GRAMMAR_BYTES = 256 * 1024
MAX_CHOICES = 1024
# vLLM's older spellings of a structured_outputs field (SamplingParams keywords and request
# fields alike).
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _fail(param: str, message: str) -> NoReturn:
    raise SamplingParamsError(param, message)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``structured_outputs``): exactly one
    of ``json`` (a JSON schema, serialized), ``json_object``, ``regex``, ``choice`` or
    ``grammar`` (EBNF/GBNF or Lark). ``reasoning_end`` holds token ids that end a reasoning
    section: when set, the constraint applies only after they have been generated. With
    ``reasoning_start`` (one id) too, the section is optional: the first token may be that id
    (then the constraint waits for ``reasoning_end``), or any the constraint allows."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning_end: tuple[int, ...] = ()
    reasoning_start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None]
        kinds += [self.choice is not None, self.grammar is not None]
        if sum(kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, json_object, regex, choice "
                f"or grammar ({sum(kinds)} set)",
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise SamplingParamsError(
                    f"structured_outputs.{name}", f"{name} must be a non-empty string"
                )
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not 1 <= len(self.choice) <= MAX_CHOICES:
                raise SamplingParamsError(
                    "structured_outputs.choice",
                    f"choice must be a list of 1 to {MAX_CHOICES} strings",
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError(
                    "structured_outputs.choice", "choice entries must be non-empty strings"
                )
        for name in ("reasoning_end", "reasoning_start"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(_is_int(t) and t >= 0 for t in ids):
                raise SamplingParamsError(
                    f"structured_outputs.{name}", f"{name} must be a list of token ids"
                )

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """From a mapping as clients send it (``json`` may be a schema object, ``choice``,
        ``reasoning_end`` and ``reasoning_start`` lists), or as it is."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, Mapping):
            raise SamplingParamsError("structured_outputs", "structured_outputs must be an object")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise SamplingParamsError(
                f"structured_outputs.{unknown[0]}",
                f"unknown structured_outputs field {unknown[0]!r}; known: {sorted(fields)}",
            )
        kwargs = {k: v for k, v in value.items() if v is not None}
        schema = kwargs.get("json")
        if isinstance(schema, dict | bool):
            kwargs["json"] = json.dumps(schema)
        for name in ("choice", "reasoning_end", "reasoning_start"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        if kwargs.get("json_object") is False:
            del kwargs["json_object"]
        elif "json_object" in kwargs and kwargs["json_object"] is not True:
            raise SamplingParamsError(
                "structured_outputs.json_object", "json_object must be a boolean"
            )
        return cls(**kwargs)


def _with_structured_outputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``structured_outputs`` as a ``StructuredOutputsParams``, from a mapping or from vLLM's
    older ``guided_*`` keywords."""
    guided = {GUIDED_ALIASES[k]: v for k, v in kwargs.items() if k in GUIDED_ALIASES}
    guided = {k: v for k, v in guided.items() if v is not None}
    kwargs = {k: v for k, v in kwargs.items() if k not in GUIDED_ALIASES}
    if guided:
        if kwargs.get("structured_outputs") is not None:
            raise SamplingParamsError(
                "structured_outputs", "send structured_outputs or the guided_* fields, not both"
            )
        kwargs["structured_outputs"] = guided
    if kwargs.get("structured_outputs") is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams.of(kwargs["structured_outputs"])
    return kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(self, **kwargs: Any) -> None:
        # Accept lists / dicts / a single stop string, as vLLM's SamplingParams does.
        fields = {f.name: f for f in dataclasses.fields(self)}
        kwargs = _with_structured_outputs(kwargs)
        for name, value in kwargs.items():
            if name not in fields:
                raise SamplingParamsError(name, f"unknown sampling parameter {name!r}")
            if name == "stop" and isinstance(value, str):
                value = (value,)
            elif name in ("stop", "stop_token_ids") and value is not None:
                value = tuple(value)
            elif name == "logit_bias" and value is not None:
                items = value.items() if isinstance(value, dict) else value
                value = tuple((k, v) for k, v in items)
            if value is None and name in ("stop", "stop_token_ids", "logit_bias"):
                value = ()
            object.__setattr__(self, name, value)
        for name, f in fields.items():
            if name not in kwargs:
                object.__setattr__(self, name, f.default)
        self._validate()

    def _validate(self) -> None:
        """Each field's type and range; the first field out of range is the error."""
        self._check_sampling()
        self._check_lengths()
        self._check_stops()
        self._check_logprobs_and_penalties()
        self._check_logit_bias()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"{name} must be a boolean")

    def _check_sampling(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", f"n={self.n!r} must be an integer in [1, {MAX_N}]")
        if self.best_of is not None:
            if not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N:
                _fail("best_of", f"best_of={self.best_of!r} must be an integer in [n, {MAX_N}]")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            _fail(
                "temperature", f"temperature={self.temperature!r} must be in [0, {MAX_TEMPERATURE}]"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            _fail("top_k", f"top_k={self.top_k!r} must be -1 (disabled) or at least 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", f"min_p={self.min_p!r} must be in [0, 1]")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            _fail("seed", f"seed={self.seed!r} must be an integer in [-2**63, 2**64)")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"max_tokens={self.max_tokens!r} must be a positive integer")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"min_tokens={self.min_tokens!r} must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
            )

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail(
                "stop", f"stop has {len(self.stop)} entries; at most {MAX_STOP_STRINGS} are allowed"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", f"stop entries must be non-empty strings, got {s!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail(
                "stop_token_ids",
                f"stop_token_ids has {len(self.stop_token_ids)} entries; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed",
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _fail(
                    "stop_token_ids", f"stop_token_ids entry {t!r} must be a non-negative integer"
                )

    def _check_logprobs_and_penalties(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, f"{name}={value!r} must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, f"{name}={value!r} must be in [-2, 2]")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= 10:
            _fail("repetition_penalty", f"repetition_penalty={rp!r} must be in (0, 10]")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail("logit_bias", f"logit_bias has more than {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token, bias in self.logit_bias:
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                _fail("logit_bias", f"logit_bias key {token!r} is not a token id")
            if token_id < 0:
                _fail("logit_bias", f"logit_bias token id {token_id} must be non-negative")
            if not _is_number(bias) or not -100 <= bias <= 100:
                _fail(
                    "logit_bias",
                    f"logit_bias value {bias!r} for token {token} must be in [-100, 100]",
                )

    def for_vocab(self, vocab_size: int) -> SamplingParams:
        """Checks that need the model: token ids must lie inside the vocabulary. Returns the
        params with ``top_k`` clamped to it (a top-k of the whole vocabulary keeps every token,
        as vLLM treats it), so no client-sized integer reaches a device array."""
        for token, _ in self.logit_bias:
            if int(token) >= vocab_size:
                raise SamplingParamsError(
                    "logit_bias",
                    f"logit_bias token id {token} is out of vocabulary (size {vocab_size})",
                )
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise SamplingParamsError(
                    "stop_token_ids",
                    f"stop_token_ids entry {t} is out of vocabulary (size {vocab_size})",
                )
        if self.top_k >= vocab_size:
            return self.replace(top_k=-1)
        return self

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """``stop_token_ids`` for the per-token lookup (up to 1,024 ids, each generated token)."""
        return frozenset(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated for this request (best_of when it exceeds n)."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def replace(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return SamplingParams(**values)
