"""How a model scores a (query, document) pair: ``ScoreHead``, and the decoder reranker's
configuration and prompt (Qwen3-Reranker's). Plain Python and numpy: the server and the engine
read it without JAX.

Two kinds of model score pairs (``PoolingParams(task="score")``):

- a cross-encoder (``BertForSequenceClassification``, ``XLMRobertaForSequenceClassification``
  with one label, ``models/encoder/``): the pair is tokenized as a text pair, the encoder's
  classification head gives one logit on the first token (on the device:
  ``runner/encoder_runner.py``), and the score is the activation sentence-transformers'
  ``CrossEncoder`` applies (``EncoderConfig.score_activation``, sigmoid by default);
- a decoder reranker in Qwen3-Reranker's style: a causal LM asked, in a fixed chat prompt,
  whether the document answers the query. Its score is the probability of "yes" against "no"
  at the last token: softmax over the two logits, i.e. sigmoid(logit_yes - logit_no), the
  last token's hidden state times the difference of the two tokens' rows of the LM head. vLLM
  serves it with ``hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
  "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}`` (it turns the
  two rows into that one-row classifier when it loads); ``reranker_tokens`` reads the same keys
  from ``--hf-overrides`` or from config.json itself.

A sequence classifier (``task="classify"``: ``/classify``, ``LLM.classify``) answers the
probability of each label from the same logits: ``class_probs``.

``EngineCore`` makes the head at start-up and ``engine/pooler.py`` applies it on the host, once
per request, to what the runner returned (``RunnerOutput.pooled`` / ``.classified``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Keys of --hf-overrides (vLLM's ``hf_overrides``) that are served: a decoder reranker's.
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")

# Qwen3-Reranker's prompt, as its model card builds it.
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_RERANK_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)


class ScoringConfigError(ValueError):
    """A reranker configuration (``--hf-overrides``, config.json) the engine cannot serve."""


def check_hf_overrides(overrides: dict[str, Any]) -> None:
    """``ScoringConfigError`` naming a key of ``--hf-overrides`` that is not served."""
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ScoringConfigError(
            f"--hf-overrides: {', '.join(unknown)} not served; the keys served are "
            f"{', '.join(HF_OVERRIDE_KEYS)} (a decoder reranker's)"
        )


def reranker_tokens(
    raw: dict[str, Any], overrides: dict[str, Any] | None
) -> tuple[str, str] | None:
    """("no", "yes")-style token strings of a decoder reranker, from config.json ``raw`` with
    ``overrides`` on top; None when the model is not one. A ``*ForSequenceClassification``
    architecture with ``classifier_from_token`` of two tokens and ``is_original_qwen3_reranker``
    makes one; anything else naming ``classifier_from_token`` is refused, naming the key."""
    merged = {**raw, **(overrides or {})}
    tokens = merged.get("classifier_from_token")
    if tokens is None:
        return None
    architectures = merged.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ScoringConfigError(
            f"classifier_from_token={tokens!r} needs architectures naming a "
            f"*ForSequenceClassification (got {architectures!r}), as vLLM's hf_overrides do"
        )
    if not (
        isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)
    ):
        raise ScoringConfigError(
            f'classifier_from_token={tokens!r} must be two token strings, as ["no", "yes"]'
        )
    if merged.get("is_original_qwen3_reranker") is not True:
        raise ScoringConfigError(
            "classifier_from_token is served for Qwen3-Reranker-style models only: set "
            '"is_original_qwen3_reranker": true'
        )
    return tokens[0], tokens[1]


def reranker_prompt(query: str, document: str, instruction: str | None) -> tuple[str, str, str]:
    """(prefix, body, suffix) of Qwen3-Reranker's prompt for one pair; each part is tokenized
    alone, without special tokens, and the ids concatenated, as its model card does."""
    body = (
        f"<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n<Query>: {query}\n"
        f"<Document>: {document}"
    )
    return QWEN3_RERANKER_PREFIX, body, QWEN3_RERANKER_SUFFIX


@dataclasses.dataclass(frozen=True)
class ScoreHead:
    """What turns a request's pooled outputs into its score, on the host."""

    kind: str  # "classifier" (a cross-encoder's logits) or "token_difference" (a reranker's)
    activation: str = "sigmoid"  # "sigmoid", "identity" or "tanh"
    # token_difference: f32[H], the LM head's row of the "yes" token minus the "no" token's
    weight: np.ndarray | None = None
    description: str = ""

    def score(
        self,
        last: np.ndarray,  # f32[H]  the last token's hidden state
        classified: np.ndarray | None,  # f32[L]  a classifier's logits
        use_activation: bool,
    ) -> float:
        if self.kind == "classifier":
            assert classified is not None, "a cross-encoder's step returned no logits"
            logit = float(classified[0])
        else:
            assert self.weight is not None
            logit = float(np.dot(np.asarray(last, np.float64), self.weight))
        if not use_activation or self.activation == "identity":
            return logit
        if self.activation == "tanh":
            return float(np.tanh(logit))
        return float(1.0 / (1.0 + np.exp(-logit)))


def class_probs(logits: np.ndarray, use_activation: bool = True) -> np.ndarray:
    """A sequence classifier's answer from its logits (f32[L]): the probability of each label,
    softmax over the labels (sigmoid for a single label), as vLLM's classify pooler gives it;
    ``use_activation=False``: the logits themselves."""
    logits = np.asarray(logits, np.float64)
    if not use_activation:
        return logits.astype(np.float32)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (exp / exp.sum(axis=-1, keepdims=True)).astype(np.float32)


def token_difference_head(rows: np.ndarray, tokens: tuple[str, str]) -> ScoreHead:
    """A reranker's head from the LM head's rows of its two tokens (f32[2, H]: "no", "yes")."""
    rows = np.asarray(rows, np.float64)
    return ScoreHead(
        "token_difference",
        "sigmoid",
        rows[1] - rows[0],
        f"decoder reranker: sigmoid(logit[{tokens[1]!r}] - logit[{tokens[0]!r}]) at the last token",
    )
