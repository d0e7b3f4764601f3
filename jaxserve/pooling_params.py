"""PoolingParams: what one pooling request (an embedding, a score of a pair, or a text's class
probabilities) asks of the engine, beside ``SamplingParams`` for generation; validated where it
is made.

Made by the server (``/v1/embeddings``; ``/v1/score`` and ``/v1/rerank`` with ``task="score"``;
``/classify`` with ``task="classify"``) and by ``LLM.embed``, ``LLM.score`` and
``LLM.classify``; checked against the model (its hidden size, its Matryoshka dimensions) by
``models/pooling.py``'s ``PoolingConfig.check`` when the engine takes the request;
read on the host when the request's last prompt chunk has run.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sampling_params import SamplingParamsError

# "embed": an embedding; "score": the relevance score of a (query, document) pair, from a
# cross-encoder's classifier or a decoder reranker's "yes" / "no" logits (models/scoring.py);
# "classify": a sequence classifier's probability of each label (``/classify``, ``LLM.classify``).
POOLING_TASKS = ("embed", "score", "classify")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    # Keep only the first ``dimensions`` values (a Matryoshka model's), then normalize again;
    # None: the model's hidden size.
    dimensions: int | None = None
    # Scale the embedding to unit length; None: as the model's sentence-transformers config
    # says (a Normalize module), and True for a decoder without one (vLLM's default).
    normalize: bool | None = None
    # A score (or a classification) through the model's activation (sigmoid for one label,
    # softmax over several); False: the raw logits.
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise SamplingParamsError(
                "task", f"task={self.task!r} must be one of {', '.join(POOLING_TASKS)}"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
        ):
            raise SamplingParamsError(
                "dimensions", f"dimensions={self.dimensions!r} must be an integer"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamsError(
                "dimensions", f"dimensions={self.dimensions} must be at least 1"
            )
