"""Draft models (``method: draft_model``): ``models/draft_check.check_draft`` and the fixture draft
``tests/fixtures/spec/draft`` (the demo model's first layer, trained on its greedy tokens by
``scripts/make_spec_fixtures.py``), run with ``decoder.forward`` like any model.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import default_model_dir
from jaxserve.models import decoder
from jaxserve.models.batch import make_kv_cache_for
from jaxserve.models.contiguous_batch import sequences_batch
from jaxserve.models.draft_check import check_draft, sampled_ids
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights

SPEC = Path(__file__).parent / "fixtures" / "spec"
DRAFT = SPEC / "draft"
LLAMA = Path(__file__).parent / "fixtures" / "models" / "llama"
PAGE = 16
TOLERANCE = 0.01


def greedy_tokens(model_dir: Path, sequences: list[list[int]]) -> np.ndarray:
    """The model's greedy next token at every position of the sequences (flattened)."""
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, jnp.float32)
    pages = -(-max(map(len, sequences)) // PAGE)
    batch = sequences_batch([(s, 0) for s in sequences], PAGE, pages)
    cache = make_kv_cache_for(config, len(sequences) * pages, PAGE, jnp.float32)
    _, hidden = decoder.forward(weights, cache, batch, config)
    return np.asarray(jnp.argmax(decoder.compute_logits(weights, hidden), -1))


def test_the_fixture_draft_fits_the_demo_model() -> None:
    demo = default_model_dir()
    check_draft(
        load_model_config(demo), load_model_config(DRAFT), Tokenizer(demo), Tokenizer(DRAFT)
    )


def test_a_draft_of_another_vocabulary_is_refused_naming_both() -> None:
    demo = default_model_dir()
    with pytest.raises(ConfigError, match=r"tiny-llama has vocab_size=320, demo vocab_size=4096"):
        check_draft(
            load_model_config(demo),
            load_model_config(LLAMA),
            Tokenizer(demo),
            Tokenizer(LLAMA),
            target_name="demo",
            draft_name="tiny-llama",
        )


class SwappedTokenizer:
    """The demo's tokenizer with two token strings swapped: same size, other ids."""

    def __init__(self, tokenizer: Tokenizer, a: int, b: int) -> None:
        self.tokenizer, self.a, self.b = tokenizer, a, b
        self.vocab_size = tokenizer.vocab_size

    def convert_ids_to_tokens(self, token_ids):
        swap = {self.a: self.b, self.b: self.a}
        return self.tokenizer.convert_ids_to_tokens([swap.get(i, i) for i in token_ids])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)


def test_a_draft_whose_tokenizer_means_other_tokens_is_refused() -> None:
    demo = default_model_dir()
    config, tokenizer = load_model_config(demo), Tokenizer(demo)
    a, b = sampled_ids(config.vocab_size)[100:102]
    with pytest.raises(ConfigError, match=rf"token id {a} is .* in the target model's tokenizer"):
        check_draft(config, config, tokenizer, SwappedTokenizer(tokenizer, a, b))
    assert len(sampled_ids(4096)) == 512 and sampled_ids(4096)[-1] == 4095
    assert sampled_ids(10) == list(range(10))


def test_the_fixture_draft_agrees_with_the_demo_models_greedy_tokens() -> None:
    report = json.loads((SPEC / "eval.json").read_text())
    sequences = report["sequences"]
    target = greedy_tokens(default_model_dir(), sequences)
    draft = greedy_tokens(DRAFT, sequences)
    agreement = float(np.mean(draft == target))
    measured = report["measured"]["draft_model"]
    assert agreement >= measured["top1"] - TOLERANCE and agreement > 0.5, agreement
    # Chains of greedy drafts from each generated position: accepted while they agree.
    k, first = report["num_speculative_tokens"], report["prompt_len"] - 1
    starts = np.cumsum([0] + [len(s) for s in sequences])
    agree = draft == target
    accepted = [
        np.cumprod(agree[starts[s] + n + 1 : starts[s] + n + 1 + k]).sum()
        for s, seq in enumerate(sequences)
        for n in range(first, len(seq) - k)
    ]
    assert np.mean(accepted) >= measured["chains"]["mean_accepted"] - TOLERANCE
