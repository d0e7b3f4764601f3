"""Build the embedding fixtures under ``tests/fixtures/embeddings/`` with sentence-transformers.

Run with an interpreter that has torch (CPU is enough), transformers and sentence-transformers:

    /work/goldenvenv/bin/python scripts/make_embedding_golden.py

Each fixture is a tiny random fp32 decoder (transformers' own base-model class, as embedding
models publish them: ``Qwen3Model``, ``MistralModel``, ``LlamaModel``) wrapped in
sentence-transformers (``models.Transformer`` + ``models.Pooling`` [+ ``models.Normalize``]) and
saved with ``SentenceTransformer.save``, so the directory holds what a real embedding model's
does: ``config.json`` and ``model.safetensors`` (tensor names without the ``model.`` prefix),
``modules.json``, ``1_Pooling/config.json`` (sentence-transformers 6 writes ``pooling_mode``;
older versions wrote ``pooling_mode_lasttoken`` and the like: the engine reads both),
``config_sentence_transformers.json``, the tokenizer. The tokenizer is the parity fixtures'
(``tests/fixtures/models/qwen3``), with the special tokens each kind of model adds:

- ``qwen3_last``: last-token pooling and Normalize; the tokenizer appends ``<|eos|>`` and
  prepends nothing, as Qwen3-Embedding's appends ``<|endoftext|>``; Matryoshka dimensions
  16 and 32 in config.json (``matryoshka_dimensions``, as vLLM reads them).
- ``mistral_mean``: mean pooling and Normalize (e5-mistral's architecture); the tokenizer
  prepends ``<|bos|>``.
- ``llama_cls``: CLS (first-token) pooling, no Normalize; the tokenizer adds nothing, so the
  first token is the text's own.

``golden.npz`` holds, for ``TEXTS`` (of different lengths), the token ids sentence-transformers
fed the model (``token_ids``, padded with -1, and ``num_tokens``), its ``encode`` output
(``embeddings``) and the pooled vectors before Normalize (``pooled``). Each text is encoded alone
(no padding), so every kind of pooling sees exactly the text's tokens. The output is
deterministic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from sentence_transformers import SentenceTransformer, models
from tokenizers import Tokenizer, processors

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "embeddings"
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "models" / "qwen3"

TEXTS = (
    "Hi",
    "The scheduler picks the requests that fit.",
    "A long prompt uses many pages: the engine appends a new page when the request grows, and "
    "nothing is copied. Attention reads the keys and values of every earlier token; rotary "
    "position embeddings turn the query and the key by an angle that grows with the position.",
)

SHAPE = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=4,
    tie_word_embeddings=True,
)


def model_configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "qwen3_last": transformers.Qwen3Config(**SHAPE, rope_theta=1e6),
        "mistral_mean": transformers.MistralConfig(**SHAPE, rope_theta=1e4, sliding_window=None),
        "llama_cls": transformers.LlamaConfig(**SHAPE, rope_theta=1e4),
    }


BASE_MODELS = {
    "qwen3_last": transformers.Qwen3Model,
    "mistral_mean": transformers.MistralModel,
    "llama_cls": transformers.LlamaModel,
}
POOLING = {"qwen3_last": "lasttoken", "mistral_mean": "mean", "llama_cls": "cls"}
NORMALIZE = {"qwen3_last": True, "mistral_mean": True, "llama_cls": False}
MATRYOSHKA = {"qwen3_last": [16, 32]}


def tokenizer_with(name: str, directory: Path) -> transformers.PreTrainedTokenizerFast:
    """The parity fixtures' tokenizer, adding the special tokens ``name``'s kind of model adds."""
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    bos, eos = "<|bos|>", "<|eos|>"
    if name == "qwen3_last":
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, 1)]
        )
    elif name == "llama_cls":
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        bos_token=bos,
        eos_token=eos,
        pad_token="<|pad|>",
        padding_side="left" if name == "qwen3_last" else "right",
    )


def build(name: str) -> None:
    directory = OUT / name
    if directory.exists():
        shutil.rmtree(directory)
    staging = directory.parent / f".{name}-staging"
    config = model_configs()[name]
    torch.manual_seed(0)
    base = BASE_MODELS[name](config).eval()
    base.save_pretrained(staging)
    tokenizer = tokenizer_with(name, staging)
    tokenizer.save_pretrained(staging)
    transformer = models.Transformer(str(staging), max_seq_length=config.max_position_embeddings)
    transformer.auto_model.eval()
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), POOLING[name])
    modules = [transformer, pooling] + ([models.Normalize()] if NORMALIZE[name] else [])
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(directory))
    shutil.rmtree(staging)
    (directory / "README.md").unlink()  # the generated model card: nothing the tests read
    if name in MATRYOSHKA:  # as vLLM reads it: config.json's matryoshka_dimensions
        path = directory / "config.json"
        raw = json.loads(path.read_text())
        raw["matryoshka_dimensions"] = MATRYOSHKA[name]
        path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    write_golden(model, directory)


def write_golden(model: SentenceTransformer, directory: Path) -> None:
    ids, embeddings, pooled = [], [], []
    with torch.no_grad():
        for text in TEXTS:
            features = model.tokenize([text])
            ids.append(features["input_ids"][0].tolist())
            embeddings.append(model.encode([text], convert_to_numpy=True)[0])
            out = model[1](model[0](dict(features)))  # Transformer, then Pooling: no Normalize
            pooled.append(out["sentence_embedding"][0].numpy())
    width = max(len(i) for i in ids)
    token_ids = np.full((len(ids), width), -1, np.int32)
    for row, i in enumerate(ids):
        token_ids[row, : len(i)] = i
    np.savez(
        directory / "golden.npz",
        texts=np.array(TEXTS),
        token_ids=token_ids,
        num_tokens=np.array([len(i) for i in ids], np.int32),
        embeddings=np.stack(embeddings).astype(np.float32),
        pooled=np.stack(pooled).astype(np.float32),
    )
    print(f"{directory.name}: {[len(i) for i in ids]} tokens, dim {embeddings[0].shape[0]}")


def main() -> None:
    for name in model_configs():
        build(name)


if __name__ == "__main__":
    main()
