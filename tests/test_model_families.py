"""Gemma 2, Gemma 3 text, Phi-3 and the rope scalings: their configs, and long generations
through ``jaxserve.LLM`` against transformers (past the sliding window and the original rope
context). Prefill, chunked prefill and decode parity per family are in test_model_parity.py."""

from __future__ import annotations

import numpy as np
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.config import FULL, SLIDING, ConfigError, builtin_config_dir
from jaxserve.models.families.counting import num_params
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from tests.conftest import NEW_FAMILIES, fixture_dir


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_long_greedy_generation_matches_hf(family: str) -> None:
    """56-token prompt in chunks of 32, then 20 decode steps: positions 56..75 pass the
    16-token sliding window and the 64-position original rope context."""
    golden = np.load(fixture_dir(family) / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    llm = jaxserve.LLM(
        str(fixture_dir(family)),
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        block_size=4,
        num_gpu_blocks_override=64,
        dtype="float32",
        warmup=False,
    )
    params = SamplingParams(temperature=0, max_tokens=len(expected), ignore_eos=True, logprobs=0)
    prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()}
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == expected
    got = [lp[token].logprob for lp, token in zip(out.logprobs, out.token_ids, strict=True)]
    ref = log_softmax(golden["long_decode_logits"])[np.arange(len(expected)), expected]
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM.*Gemma3ForCausalLM.*Phi3ForCausalLM"):
        model_config_from_dict(raw)
    with pytest.raises(ConfigError, match="model_type='falcon' is not supported.*gemma2"):
        model_config_from_dict({"model_type": "falcon"})


GEMMA3 = dict(
    model_type="gemma3_text",
    num_hidden_layers=7,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=32,
)


def test_gemma3_layer_pattern_from_sliding_window_pattern_or_layer_types() -> None:
    old = model_config_from_dict(
        GEMMA3
        | {
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    every_third = tuple(FULL if (i + 1) % 3 == 0 else SLIDING for i in range(7))
    assert old.layer_types == every_third
    assert [old.layer_window(i) for i in range(3)] == [32, 32, None]
    assert old.layer_rope(0) == (1e4, None)
    theta, scaling = old.layer_rope(2)
    assert theta == 1e6 and scaling is not None
    assert (scaling.rope_type, scaling.factor) == ("linear", 8.0)
    types = [SLIDING, FULL, FULL, SLIDING, SLIDING, SLIDING, FULL]
    new = model_config_from_dict(GEMMA3 | {"layer_types": types})
    assert new.layer_types == tuple(types)


def test_rope_scaling_and_rope_parameters_spellings_agree() -> None:
    base = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=320,
    )
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    old = model_config_from_dict(
        base | {"rope_theta": 1e6, "rope_scaling": {"type": "yarn"} | yarn}
    )
    new = model_config_from_dict(
        base | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6} | yarn}
    )
    assert old.rope_scaling == new.rope_scaling and old.rope_theta == new.rope_theta == 1e6
    assert new.rope_scaling is not None
    assert new.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)


def test_phi3_su_is_longrope_with_the_paper_attention_factor() -> None:
    raw = dict(
        model_type="phi3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )
    scaling = model_config_from_dict(raw).rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert scaling.long_factor == (2.0,) * 8
    assert scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))
    with pytest.raises(ConfigError, match="short_factor field must have length 8, got 4"):
        raw["rope_scaling"] = {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
        model_config_from_dict(raw)


def test_shipped_gemma_configs_have_the_real_shapes() -> None:
    gemma2 = load_model_config(builtin_config_dir("gemma-2-9b"))
    assert num_params(gemma2) == 9_241_705_984  # google/gemma-2-9b
    assert gemma2.layer_types[:2] == (SLIDING, FULL) and gemma2.sliding_window == 4096
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.sm_scale == 256**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = load_model_config(builtin_config_dir("gemma-3-12b"))
    assert gemma3.layer_types.count(FULL) == 8 and gemma3.layer_types[5] == FULL
    assert gemma3.rope_local_theta == 1e4 and gemma3.qk_norm and gemma3.tie_word_embeddings
