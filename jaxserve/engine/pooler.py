"""Pooler: what a pooling request's prompt chunks returned so far, and its embedding at the end.

A pooling request's prompt runs in chunks like a prefill (``--runner pooling``). For each chunk
the runner returns, in ``RunnerOutput.pooled``, the sum of the chunk's hidden states, its first
token's and its last token's (f32). ``EngineCore`` hands each to ``add_chunk``; the pooler sums
them for mean pooling, keeps the first chunk's first token for CLS and the final chunk's last
token for last-token pooling, and ``embedding`` finishes the vector on the host
(``models/pooling.py``: pick, truncate to ``dimensions``, normalize). It owns that state, keyed
by ``seq_id``, from the first chunk to ``free`` (the request retires).

A score (``PoolingParams(task="score")``) is made here too, by the model's ``ScoreHead``
(``models/scoring.py``): from a cross-encoder's logits (``RunnerOutput.classified``, given to
``score``) or from the last token's hidden state (a decoder reranker). A classification
(``task="classify"``) is the probability of each label from the classifier's logits
(``classify``, ``models/scoring.class_probs``).

NOTE: truncation and normalization run here, on the host, not on the device: a request's
vector is a few thousand floats, once, and its ``dimensions`` and ``normalize`` then never
reach a compiled program (one pooling program per token bucket, whatever the requests ask).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.models.pooling import PoolingConfig
from jaxserve.models.scoring import ScoreHead, class_probs
from jaxserve.pooling_params import PoolingParams


@dataclasses.dataclass
class _Chunks:
    sum_hidden: np.ndarray  # f32[H]
    first: np.ndarray  # f32[H]  the prompt's first token's (from the chunk that starts at 0)
    last: np.ndarray  # f32[H]  the last chunk's last token's
    num_tokens: int  # summed so far


class Pooler:
    def __init__(self, config: PoolingConfig, score_head: ScoreHead | None = None) -> None:
        self.config = config
        self.score_head = score_head  # None: the model cannot score pairs
        self._seqs: dict[str, _Chunks] = {}

    def add_chunk(
        self,
        seq_id: str,
        start: int,  # the chunk's first position in the prompt
        num_tokens: int,
        pooled: np.ndarray,  # f32[3, H]: the chunk's sum, first token's, last token's
    ) -> None:
        """Fold one chunk in. A chunk at position 0 starts over (a sequence preempted and run
        again from its start, or the first chunk); one after a prefix-cache hit (last-token
        pooling only) starts the state where it starts."""
        state = self._seqs.get(seq_id)
        if state is None or start == 0:
            self._seqs[seq_id] = _Chunks(pooled[0].copy(), pooled[1].copy(), pooled[2], num_tokens)
            return
        state.sum_hidden += pooled[0]
        state.num_tokens += num_tokens
        state.last = pooled[2]

    def embedding(self, seq_id: str, params: PoolingParams) -> np.ndarray:
        """The finished embedding of a sequence whose last chunk has been added."""
        state = self._seqs[seq_id]
        return self.config.embedding(
            state.sum_hidden, state.first, state.last, state.num_tokens, params
        )

    def score(
        self, seq_id: str, params: PoolingParams, classified: np.ndarray | None = None
    ) -> float:
        """The finished score of a sequence whose last chunk has been added; ``classified``:
        a cross-encoder's logits of it (f32[L])."""
        assert self.score_head is not None, "a score request to a model that cannot score"
        state = self._seqs[seq_id]
        return self.score_head.score(state.last, classified, params.use_activation)

    def classify(self, params: PoolingParams, classified: np.ndarray | None) -> np.ndarray:
        """A sequence classifier's probability of each label (f32[L]) from its logits
        (``classified``, the row of the sequence's last step)."""
        assert classified is not None, "a classify request's step returned no logits"
        return class_probs(classified, params.use_activation)

    def free(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)
