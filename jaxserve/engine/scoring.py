"""ScoringModel: whether the served model scores (query, document) pairs, and how a pair becomes
the prompt it scores: a text pair for a cross-encoder, Qwen3-Reranker's prompt for a decoder
reranker (``models/scoring.py``).

``EngineCore`` makes it at start-up from the model it serves; the server's ``/v1/score`` and
``/v1/rerank`` (``server/api/score_handler.py``) and ``LLM.score`` read it to refuse a model
that cannot score (their 400 says why) and to tokenize each pair, then send the ids (and a
cross-encoder's token type ids) as a pooling request with ``PoolingParams(task="score")``.
It also holds a sequence classifier's label names, which ``/classify`` and ``LLM.classify`` read
(``task="classify"``; a model without them is refused with ``classify_refusal``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models.scoring import reranker_prompt

CROSS_ENCODER = "cross_encoder"
RERANKER = "reranker"

SCORE_NEEDS_POOLING = (
    "this model is served for generation: /v1/score and /v1/rerank need a cross-encoder or a "
    "decoder reranker served with --runner pooling"
)
CANNOT_SCORE = (
    "this model cannot score pairs: it is an embedding model without a classification head "
    "(a cross-encoder is a *ForSequenceClassification model) and not a decoder reranker "
    "(--hf-overrides with classifier_from_token); use /v1/embeddings"
)


CLASSIFY_NEEDS_POOLING = (
    "this model is served for generation: /classify needs a sequence classifier "
    "(a *ForSequenceClassification encoder) served with --runner pooling"
)
CANNOT_CLASSIFY = (
    "this model cannot classify: it has no sequence-classification head (/classify serves "
    "BertForSequenceClassification and XLMRobertaForSequenceClassification models)"
)


@dataclasses.dataclass(frozen=True)
class ScoringModel:
    kind: str | None  # CROSS_ENCODER, RERANKER, or None: the model cannot score pairs
    refusal: str = CANNOT_SCORE  # why not, when kind is None
    # A sequence classifier's label names, in id order (``/classify``); empty: it cannot classify
    labels: tuple[str, ...] = ()
    classify_refusal: str = CANNOT_CLASSIFY  # why not, when labels is empty

    @property
    def can_score(self) -> bool:
        return self.kind is not None

    @property
    def can_classify(self) -> bool:
        return bool(self.labels)

    def tokenize_pair(
        self,
        tokenizer: Any,  # engine/tokenizer.Tokenizer
        query: str,
        document: str,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,  # keep at most this many tokens
    ) -> tuple[list[int], list[int] | None]:
        """(token ids, token type ids or None) of one pair, as the model was trained on it:
        ``tokenizer(query, document)`` for a cross-encoder (``[CLS] q [SEP] d [SEP]``, types 0
        then 1; truncated from the document), Qwen3-Reranker's prompt for a reranker (its
        leading tokens dropped past ``truncate_prompt_tokens``)."""
        hf = tokenizer.hf_tokenizer
        if self.kind == CROSS_ENCODER:
            kwargs: dict[str, Any] = {}
            if truncate_prompt_tokens is not None:
                kwargs = dict(truncation="only_second", max_length=truncate_prompt_tokens)
            encoded = hf(query, document, return_token_type_ids=True, **kwargs)
            ids = list(encoded["input_ids"])
            types = encoded.get("token_type_ids")
            return ids, list(types) if types is not None and any(types) else None
        if self.kind != RERANKER:
            raise ValueError(self.refusal)
        ids = []
        for part in reranker_prompt(query, document, instruction):
            ids += hf.encode(part, add_special_tokens=False)
        if truncate_prompt_tokens is not None and len(ids) > truncate_prompt_tokens:
            ids = ids[-truncate_prompt_tokens:]
        return ids, None
