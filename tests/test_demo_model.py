"""The demo model shipped in ``jaxserve/assets/demo``: served when no model is named.

Checks the directory is a complete Hugging Face model, that ``jaxserve.LLM()`` with no model
serves it greedily and stably as readable text, that its chat template renders ChatML, that its
perplexity on a held-out slice of the standard library beats the unigram baseline (recomputed
here with the serving forward, and matching ``eval.json``), and, where torch is installed, that
transformers loads it and computes the same logits.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import jaxserve
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import default_model_dir
from jaxserve.models import decoder
from jaxserve.models.batch import Batch, make_kv_cache
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights

DEMO = default_model_dir()
HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
PAGE = 16


def load_eval() -> dict:
    return json.loads((DEMO / "eval.json").read_text())


def paged_logits(token_ids: list[int]) -> np.ndarray:  # f32[T, V]
    """Logits at every position of one sequence through the serving forward, in f32."""
    config = load_model_config(DEMO)
    weights = load_weights(DEMO, config, jnp.float32)
    num_tokens = len(token_ids)
    num_pages = -(-num_tokens // PAGE)
    cache = make_kv_cache(
        config.num_layers, num_pages, PAGE, config.num_kv_heads, config.head_dim, jnp.float32
    )
    positions = jnp.arange(num_tokens, dtype=jnp.int32)  # i32[T]
    batch = Batch(
        input_ids=jnp.asarray(token_ids, jnp.int32),
        positions=positions,
        slot_mapping=positions,
        kv_lens=jnp.asarray([num_tokens], jnp.int32),
        page_indices=jnp.arange(num_pages, dtype=jnp.int32)[None, :],
        cu_q_lens=jnp.asarray([0, num_tokens], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        logits_indices=jnp.asarray([num_tokens - 1], jnp.int32),
    )
    _, hidden = jax.jit(decoder.forward, static_argnums=(3,))(weights, cache, batch, config)
    return np.asarray(decoder.compute_logits(weights, hidden))


def mean_nll(logits: np.ndarray, targets: np.ndarray) -> float:  # f32[T, V], i32[T]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(-log_probs[np.arange(len(targets)), targets].mean())


def slice_ids() -> list[int]:
    piece = load_eval()["slice"]
    ids = Tokenizer(DEMO).encode(piece["text"])[: piece["num_tokens"]]
    assert len(ids) == piece["num_tokens"]
    return ids


def is_readable(text: str) -> bool:
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    return printable >= 0.95 * len(text) and sum(c.isalpha() for c in text) >= 0.3 * len(text)


@pytest.fixture(scope="module")
def llm() -> jaxserve.LLM:
    return jaxserve.LLM(
        max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=40
    )


def test_demo_is_a_small_complete_hf_directory() -> None:
    for name in HF_FILES:
        assert (DEMO / name).is_file(), name
    size = sum(f.stat().st_size for f in DEMO.iterdir() if f.is_file())
    assert size < 10 * 2**20
    config = load_model_config(DEMO)
    tokenizer = Tokenizer(DEMO)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert config.vocab_size == tokenizer.vocab_size
    generation = json.loads((DEMO / "generation_config.json").read_text())
    stop_tokens = tokenizer.convert_ids_to_tokens(generation["eos_token_id"])
    assert stop_tokens == ["<|eos|>", "<|im_end|>"]


def test_llm_without_a_model_serves_the_demo_greedily(llm: jaxserve.LLM) -> None:
    assert llm.engine.config.model_dir == DEMO
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=24)
    first, second = (llm.generate(["def ", "The "], params, use_tqdm=False) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        text = a.outputs[0].text
        assert text and text == b.outputs[0].text
        assert is_readable(text), text
    # The same tokens eval.json recorded when the model was made (64-token greedy samples).
    recorded = {s["prompt"]: s["completion"] for s in load_eval()["samples"] if "prompt" in s}
    assert recorded["def "].startswith(first[0].outputs[0].text)


def test_chat_template_renders_chatml_and_chat_answers(llm: jaxserve.LLM) -> None:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    params = jaxserve.SamplingParams(temperature=0.0, max_tokens=32)
    question = [{"role": "user", "content": "What does `os.path.join` do?"}]
    text = llm.chat(question, params, use_tqdm=False)[0].outputs[0].text
    assert text and is_readable(text), text
    assert "<|im_start|>" not in text


def test_demo_samples_under_a_json_schema_validate(llm: jaxserve.LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "size": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["module", "class", "function"]},
        },
        "required": ["name", "size", "kind"],
        "additionalProperties": False,
    }
    params = jaxserve.SamplingParams(
        n=8, temperature=1.0, seed=3, max_tokens=80, structured_outputs={"json": schema}
    )
    (output,) = llm.generate("import json\n", params, use_tqdm=False)
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample
        jsonschema.validate(json.loads(sample.text), schema)


def test_heldout_slice_beats_the_unigram_baseline() -> None:
    report = load_eval()
    heldout = report["heldout"]
    assert heldout["model_nll"] < heldout["unigram_nll"] - 1.0
    assert report["slice"]["file"] in report["corpus"]["heldout_files"]
    ids = slice_ids()
    targets = np.asarray(ids[1:])  # i32[T]
    model = mean_nll(paged_logits(ids[:-1]), targets)
    counts = np.asarray(report["unigram_counts"], np.float64)  # f64[V]
    unigram = float(-np.log((counts[targets] + 1) / (counts.sum() + len(counts))).mean())
    assert model == pytest.approx(report["slice"]["model_nll"], abs=2e-3)
    assert unigram == pytest.approx(report["slice"]["unigram_nll"], abs=2e-3)
    assert model < unigram - 1.0


def test_transformers_loads_the_demo_with_the_same_logits() -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = slice_ids()[:64]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()  # f32[T, V]
    np.testing.assert_allclose(paged_logits(ids), theirs, atol=2e-3, rtol=0)
