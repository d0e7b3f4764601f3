"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` per sample.

Shaped like vLLM's classes so notebook users know them. The async engine streams *deltas*
(new text, new token ids and their logprobs since the last output); ``LLM.generate`` and the
non-streaming server routes merge the deltas with ``RequestOutput.merge``. A pooling request
(``--runner pooling``) gets one finished ``RequestOutput`` whose ``embedding`` is set;
``LLM.embed`` hands it back as an ``EmbeddingRequestOutput``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


# One dict per generated (or prompt) token: token id -> Logprob (the chosen token + top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request
    # A pooling request's result, on its one (finished) output: f32[dimensions or hidden size]
    embedding: np.ndarray | None = None
    # A score request's result (``PoolingParams(task="score")``): the pair's relevance score
    score: float | None = None
    # A classify request's result (``PoolingParams(task="classify")``): f32[L], each label's
    # probability
    probs: np.ndarray | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Fold a streamed delta into this accumulated output."""
        by_index = {o.index: o for o in self.outputs}
        for d in delta.outputs:
            out = by_index.get(d.index)
            if out is None:
                out = CompletionOutput(
                    index=d.index, logprobs=[] if d.logprobs is not None else None
                )
                self.outputs.append(out)
                by_index[d.index] = out
            out.text += d.text
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.extend(d.logprobs)
            if d.cumulative_logprob is not None:
                out.cumulative_logprob = d.cumulative_logprob
            if d.finish_reason is not None:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finished = delta.finished
        self.metrics = delta.metrics or self.metrics
        self.error = delta.error or self.error
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.score is not None:
            self.score = delta.score
        if delta.probs is not None:
            self.probs = delta.probs


@dataclasses.dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: the embedding of one prompt."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ScoringOutput:
    """vLLM's ``ScoringOutput``: the score of one pair."""

    score: float


@dataclasses.dataclass
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: the probability of each label of one prompt."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt, as vLLM's class of the same name."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclasses.dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair, as vLLM's class of the same name."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt, as vLLM's class of the same name."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
