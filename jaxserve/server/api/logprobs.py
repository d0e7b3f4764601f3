"""Logprobs in OpenAI's two shapes, from the engine's ``list[dict[token_id, Logprob]]``.

``/v1/completions`` wants ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
``/v1/chat/completions`` wants ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
Each engine entry holds the chosen token and the top-k alternatives; infinities become -9999.0
because JSON cannot carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.engine.outputs import Logprob
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.server.api.errors import finite


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The ``k`` most likely tokens of one position, most likely first."""
        return sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]

    def completion(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, Logprob] | None],
        num_top: int,
        offset: int,
    ) -> tuple[dict[str, list[Any]], int]:
        """Completions-shaped logprobs; ``offset`` is where the first token starts in the text.

        Returns the logprobs and the offset just past the last token. A ``None`` entry (the
        first prompt token, which nothing predicts) gives ``null`` logprobs.
        """
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            chosen = entry.get(token_id) if entry is not None else None
            text = self.token_text(token_id, chosen)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
            top_logprobs.append(
                {self.token_text(t, lp): finite(lp.logprob) for t, lp in self.top(entry, num_top)}
            )
        result: dict[str, list[Any]] = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
        return result, offset

    def chat(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], num_top: int
    ) -> list[dict[str, Any]]:
        """Chat-shaped ``logprobs.content`` entries."""
        content = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            chosen = entry.get(token_id)
            text = self.token_text(token_id, chosen)
            content.append(
                {
                    "token": text,
                    "logprob": finite(chosen.logprob) if chosen is not None else -9999.0,
                    "bytes": list(text.encode("utf-8", errors="replace")),
                    "top_logprobs": [
                        {
                            "token": (top_text := self.token_text(t, lp)),
                            "logprob": finite(lp.logprob),
                            "bytes": list(top_text.encode("utf-8", errors="replace")),
                        }
                        for t, lp in self.top(entry, num_top)
                    ],
                }
            )
        return content


def prompt_logprobs_json(
    entries: Sequence[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, token id -> {logprob, rank, token}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in entry.items()
        }
        for entry in entries
    ]
