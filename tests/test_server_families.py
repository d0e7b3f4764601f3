"""Gemma 2 and Phi-3 over HTTP: the golden greedy tokens through /v1/completions, and a chat
completion whose prompt is the golden chat rendering, on a real server per family.

Gemma 2 exercises soft-capping, alternating windows and the (1 + w) norms; Phi-3 the fused
projections, longrope and a window on every layer. The long prompt's 20 greedy tokens run past
the 16-token window and the 64-position original rope context (golden from transformers).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import openai
import pytest

from tests.conftest import fixture_dir, tiny_server

# The messages scripts/make_golden.py renders into golden["chat_ids"].
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! How big is a page?"},
]


@pytest.fixture(scope="module", params=["gemma2", "phi3"])
def served(request):
    family = request.param
    with (
        tiny_server(
            family,
            family=family,
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            block_size=4,
            num_gpu_blocks_override=64,
            warmup=False,
        ) as server,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client,
    ):
        golden = np.load(fixture_dir(family) / "golden.npz")
        yield SimpleNamespace(family=family, client=client, golden=golden, engine=server.engine)


def greedy(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}


def decode(served, token_ids) -> str:
    return served.engine.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def test_completion_greedy_tokens_equal_the_golden(served):
    """Past the sliding window and the original rope context, as transformers generates."""
    golden = served.golden
    expected = golden["long_greedy_ids"].tolist()
    out = served.client.completions.create(
        model=served.family,
        prompt=golden["prompt2_ids"].tolist(),
        logprobs=0,
        **greedy(len(expected)),
    )
    choice = out.choices[0]
    assert out.usage.completion_tokens == len(expected)
    assert choice.text == decode(served, expected)
    # Each token's logprob is transformers' log-softmax of its row, within the LLM tests' 1e-4.
    logits = golden["long_decode_logits"]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ref = log_probs[np.arange(len(expected)), expected]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, ref, atol=1e-4)


def test_chat_completion_renders_the_golden_prompt_and_continues_it(served):
    """The served chat template renders the golden chat_ids; the reply is the greedy
    continuation of exactly those tokens (the same text as a completion on them)."""
    chat_ids = served.golden["chat_ids"].tolist()
    chat = served.client.chat.completions.create(
        model=served.family, messages=CHAT_MESSAGES, **greedy(8)
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == 8
    plain = served.client.completions.create(model=served.family, prompt=chat_ids, **greedy(8))
    assert chat.choices[0].message.content == plain.choices[0].text
