"""Whether a draft model can propose tokens for a target (``method: draft_model``).

A draft model is another decoder of the same tokenizer, run with ``decoder.forward`` over its
own KV cache; its proposals are token ids the target verifies, so the two must mean the same
thing by every id: the same vocabulary size in their configs, and tokenizers that agree on a
sample of ids (each id's token string) and on the ids of a sample text. The start-up code
(engine) calls ``check_draft`` with both configs and tokenizers before loading any weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jaxserve.config import ConfigError, ModelConfig

# Encoded by both tokenizers: code, prose, digits, whitespace runs and non-ASCII text.
SAMPLE_TEXT = "def main(argv):\n    return 42  # The answer, naïvement: 'ß' → ok\n\nHello, world!"
NUM_SAMPLED_IDS = 512


class DraftTokenizer(Protocol):
    """What ``check_draft`` reads of a tokenizer (``engine.tokenizer.Tokenizer``'s methods, and
    those of a Hugging Face tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]: ...


def sampled_ids(vocab_size: int, num: int = NUM_SAMPLED_IDS) -> list[int]:
    """``num`` ids spread evenly over [0, vocab_size), the first and last included."""
    if vocab_size <= num:
        return list(range(vocab_size))
    return sorted({round(i * (vocab_size - 1) / (num - 1)) for i in range(num)})


def check_draft(
    target_config: ModelConfig,
    draft_config: ModelConfig,
    target_tokenizer: DraftTokenizer,
    draft_tokenizer: DraftTokenizer,
    target_name: str = "the target model",
    draft_name: str = "the draft model",
) -> None:
    """A ``ConfigError`` naming both models unless the draft speaks the target's vocabulary."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"speculative draft_model: {draft_name} has vocab_size={draft_config.vocab_size}, "
            f"{target_name} vocab_size={target_config.vocab_size}: a draft must share the "
            "target's tokenizer"
        )
    ids = sampled_ids(_tokenizer_size(target_tokenizer, target_config.vocab_size))
    target_tokens = target_tokenizer.convert_ids_to_tokens(ids)
    draft_tokens = draft_tokenizer.convert_ids_to_tokens(ids)
    for token_id, mine, theirs in zip(ids, target_tokens, draft_tokens, strict=True):
        if mine != theirs:
            raise ConfigError(
                f"speculative draft_model: token id {token_id} is {mine!r} in {target_name}'s "
                f"tokenizer but {theirs!r} in {draft_name}'s: a draft must share the target's "
                "tokenizer"
            )
    target_ids = target_tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    draft_ids = draft_tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    if target_ids != draft_ids:
        raise ConfigError(
            f"speculative draft_model: {target_name}'s tokenizer encodes a sample text as "
            f"{target_ids[:12]}..., {draft_name}'s as {draft_ids[:12]}...: a draft must share "
            "the target's tokenizer"
        )


def _tokenizer_size(tokenizer: DraftTokenizer, vocab_size: int) -> int:
    """The ids the tokenizer names (at most the model's vocab_size, which may be padded)."""
    size = getattr(tokenizer, "vocab_size", None)
    return min(size, vocab_size) if isinstance(size, int) and size > 0 else vocab_size
