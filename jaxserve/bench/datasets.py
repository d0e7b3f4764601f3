"""Benchmark workloads: the prompts `jaxserve bench serve` replays.

A `DatasetSpec` (built from the command line) goes in, a list of `SampleRequest` comes out and is
sent by the load generator in `serve.py`, one request per sample, in order.

- ``random``: prompts of exactly the requested number of tokens. For the completions endpoint a
  prompt is a list of token ids (the OpenAI completions API accepts ``prompt: list[int]``) drawn
  uniformly from ``[token_low, token_high)``; the defaults 10..500 exist in any real vocabulary
  and avoid the special tokens most tokenizers keep at the bottom of the id range. The chat
  endpoint only takes text, so there a prompt is that many random common English words (about
  one token per word; the server's ``usage.prompt_tokens`` gives the exact count).
- ``jsonl:PATH``: one JSON object per line with ``prompt`` (a string, or a list of token ids for
  the completions endpoint) and an optional ``max_tokens`` or ``output_len``. Lines are replayed in
  file order, cycling when the file has fewer lines than ``num_prompts``.
- ``prefix-repetition``: ``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each request
  one of them (in turn) plus a random suffix of the random input length; exercises prefix caching.

Lengths are uniform in ``[L * (1 - r), L * (1 + r)]`` for ``--random-range-ratio r``. Everything
is deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

DATASET_NAMES = ("random", "jsonl", "prefix-repetition")

# Common English words, mostly one token each in BPE vocabularies: the text stand-in for random
# token ids on the chat endpoint.
_WORDS = tuple(
    """
    time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book
    eye job word business issue side kind head house service friend father power hour game line
    end member law car city name team minute idea kid body information back parent face others
    level office door health person art war history party result change morning reason research
    girl guy moment air teacher force education open small large early young important few public
    bad same able green river stone light paper table window garden music letter market field
    """.split()
)


class DatasetError(ValueError):
    """A dataset specification or file that cannot produce benchmark requests."""


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One prompt to send, and how many tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int | None  # tokens when known in advance (token-id prompts), else None
    output_len: int  # max_tokens sent with the request


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What to generate; validated so that a bad flag fails before any request is sent."""

    name: str  # "random", "jsonl" or "prefix-repetition"
    num_prompts: int
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 1
    token_low: int = 10
    token_high: int = 500
    as_text: bool = False  # True for the chat endpoint: words instead of token ids
    path: str | None = None  # the JSONL file for name="jsonl"
    seed: int = 0
    # A sweep draws fresh prompts for each rate (its index here), so that no rate is served
    # from the prefix cache that an earlier rate filled; None: the plain seed.
    rate_index: int | None = None

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise DatasetError(f"dataset={self.name!r} must be one of {', '.join(DATASET_NAMES)}")
        if self.name == "jsonl" and not self.path:
            raise DatasetError("dataset='jsonl' needs a path: use --dataset jsonl:PATH")
        for field in ("num_prompts", "input_len", "output_len", "num_prefixes"):
            value = getattr(self, field)
            if value < 1:
                raise DatasetError(f"{field}={value} must be >= 1")
        if self.prefix_len < 0:
            raise DatasetError(f"prefix_len={self.prefix_len} must be >= 0")
        if not 0.0 <= self.range_ratio < 1.0:
            raise DatasetError(f"range_ratio={self.range_ratio} must be in [0, 1)")
        if not 0 <= self.token_low < self.token_high:
            raise DatasetError(
                f"token_low={self.token_low}, token_high={self.token_high}: "
                "need 0 <= token_low < token_high"
            )

    @classmethod
    def parse(cls, dataset: str, **kwargs: object) -> DatasetSpec:
        """Builds a spec from the ``--dataset`` value (``random``, ``jsonl:PATH``, ...)."""
        name, _, path = dataset.partition(":")
        if name == "jsonl":
            return cls(name=name, path=path, **kwargs)  # type: ignore[arg-type]
        if path:
            raise DatasetError(f"dataset={dataset!r}: only jsonl takes a ':PATH'")
        return cls(name=name, **kwargs)  # type: ignore[arg-type]


def sample_requests(spec: DatasetSpec) -> list[SampleRequest]:
    """The ``spec.num_prompts`` requests of a benchmark, in sending order."""
    if spec.name == "jsonl":
        assert spec.path is not None
        return _jsonl_requests(spec, Path(spec.path))
    rng = np.random.default_rng(
        spec.seed if spec.rate_index is None else [spec.seed, spec.rate_index]
    )
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, spec.num_prompts)  # i64[N]
    output_lens = _lengths(rng, spec.output_len, spec.range_ratio, spec.num_prompts)  # i64[N]
    prefixes: list[list[int]] = []
    if spec.name == "prefix-repetition":
        prefixes = [_token_ids(rng, spec, spec.prefix_len) for _ in range(spec.num_prefixes)]
    requests = []
    for i in range(spec.num_prompts):
        ids = _token_ids(rng, spec, int(input_lens[i]))
        if prefixes:
            ids = prefixes[i % len(prefixes)] + ids
        if spec.as_text:
            prompt: str | list[int] = " ".join(_WORDS[t % len(_WORDS)] for t in ids)
            prompt_len = None
        else:
            prompt, prompt_len = ids, len(ids)
        requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def _lengths(rng: np.random.Generator, length: int, ratio: float, num: int) -> np.ndarray:
    low = max(1, int(length * (1.0 - ratio)))
    high = max(low, int(length * (1.0 + ratio)))
    return rng.integers(low, high, size=num, endpoint=True)  # i64[num]


def _token_ids(rng: np.random.Generator, spec: DatasetSpec, num: int) -> list[int]:
    return rng.integers(spec.token_low, spec.token_high, size=num).tolist()


def _jsonl_requests(spec: DatasetSpec, path: Path) -> list[SampleRequest]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"dataset jsonl:{path}: cannot read the file: {e}") from e
    rows = []
    for line_number, line in enumerate(lines, start=1):
        if line.strip():
            rows.append(_parse_row(spec, path, line_number, line))
    if not rows:
        raise DatasetError(f"dataset jsonl:{path}: the file has no requests")
    return [rows[i % len(rows)] for i in range(spec.num_prompts)]


def _parse_row(spec: DatasetSpec, path: Path, line_number: int, line: str) -> SampleRequest:
    where = f"dataset jsonl:{path} line {line_number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(row, dict) or "prompt" not in row:
        raise DatasetError(f"{where}: expected an object with a 'prompt' field")
    prompt = row["prompt"]
    is_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise DatasetError(f"{where}: prompt must be a non-empty string or list of token ids")
    if is_ids and spec.as_text:
        raise DatasetError(f"{where}: the chat endpoint needs a text prompt, not token ids")
    output_len = row.get("max_tokens", row.get("output_len", spec.output_len))
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise DatasetError(f"{where}: max_tokens/output_len={output_len!r} must be an int >= 1")
    return SampleRequest(prompt, len(prompt) if is_ids else None, output_len)
