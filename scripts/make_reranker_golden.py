"""Build the decoder-reranker fixture under ``tests/fixtures/rerankers/qwen3_reranker/``.

Run with an interpreter that has torch (CPU is enough) and transformers:

    /work/goldenvenv/bin/python scripts/make_reranker_golden.py

The fixture is a tiny random fp32 ``Qwen3ForCausalLM`` (untied language-model head, so the
reranker's two rows come from ``lm_head``, not the embedding) saved with transformers, with the
parity fixtures' tokenizer (``tests/fixtures/models/qwen3``) adding no special tokens (as
Qwen3's adds none) and the tokens ``yes`` and ``no`` added, as Qwen3-Reranker has them.

``golden.npz`` holds what Qwen3-Reranker's model card computes for ``QUERY`` against each of
``DOCUMENTS``, once with the default instruction and once with ``INSTRUCTION``: each prompt is
the system prefix, ``<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`` and the assistant
suffix with the empty think block, each part tokenized alone and concatenated; the score is
the last token's logits of ``yes`` and ``no``, log-softmax over [no, yes], exp of yes. Each
pair runs alone (no padding). The output is deterministic.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, processors

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "rerankers" / "qwen3_reranker"
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "models" / "qwen3"

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
INSTRUCTION = "Find the passage that names the city"
QUERY = "What is the capital of France?"
DOCUMENTS = (
    "Paris is the capital and largest city of France.",
    "The cache is split into pages.",
    "France",
    "A search engine ranks documents by how well they answer the query, one score each.",
)

CONFIG = dict(
    vocab_size=336,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=4,
    tie_word_embeddings=False,
    rope_theta=1e6,
)


def tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tok.add_tokens(["yes", "no"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def model_card_scores(model, tok, instruction: str) -> tuple[list[list[int]], np.ndarray]:
    """Qwen3-Reranker's model card, one pair at a time."""
    prefix = tok.encode(PREFIX, add_special_tokens=False)
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    ids, scores = [], []
    with torch.no_grad():
        for doc in DOCUMENTS:
            body = f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {doc}"
            pair = prefix + tok(body, return_attention_mask=False)["input_ids"] + suffix
            logits = model(torch.tensor([pair])).logits[:, -1, :]
            stacked = torch.stack([logits[:, no], logits[:, yes]], dim=1)
            scores.append(torch.nn.functional.log_softmax(stacked, dim=1)[:, 1].exp().item())
            ids.append(pair)
    return ids, np.array(scores, np.float32)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    tok = tokenizer(OUT)
    tok.save_pretrained(OUT)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).eval()
    model.save_pretrained(OUT)
    golden = {}
    for key, instruction in (("default", DEFAULT_INSTRUCTION), ("custom", INSTRUCTION)):
        ids, scores = model_card_scores(model, tok, instruction)
        width = max(len(i) for i in ids)
        padded = np.full((len(ids), width), -1, np.int32)
        for row, i in enumerate(ids):
            padded[row, : len(i)] = i
        golden[f"{key}_token_ids"] = padded
        golden[f"{key}_num_tokens"] = np.array([len(i) for i in ids], np.int32)
        golden[f"{key}_scores"] = scores
        print(key, [len(i) for i in ids], scores)
    np.savez(
        OUT / "golden.npz",
        query=np.array(QUERY),
        documents=np.array(DOCUMENTS),
        instruction=np.array(INSTRUCTION),
        **golden,
    )


if __name__ == "__main__":
    main()
