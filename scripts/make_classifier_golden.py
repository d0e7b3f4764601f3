"""Build the sequence-classifier golden fixture ``tests/fixtures/encoders/bert_classifier/``.

Run with an interpreter that has torch (CPU) and transformers:

    /work/goldenvenv/bin/python scripts/make_classifier_golden.py

A tiny random fp32 ``BertForSequenceClassification`` with three labels and an ``id2label``
(``negative``, ``neutral``, ``positive``), made as ``make_encoder_golden.py`` makes its models
(its tokenizer, sizes and weight distribution), saved by transformers, with a ``golden.npz`` of
what transformers computes for ``TEXTS``: ``texts``, ``input_ids`` i32[T] (concatenated),
``cu_seq_lens`` i32[S + 1], ``logits`` f32[S, 3] and ``probs`` f32[S, 3] (softmax over the
labels, what ``/classify`` answers). Deterministic: torch 2.14.1 and transformers 5.25.0
rewrite the same bytes.
"""

from __future__ import annotations

import shutil

import numpy as np
import torch
import transformers
from make_encoder_golden import (
    FIXTURES,
    SEED,
    TEXTS,
    bert_tokenizer,
    encoder_config,
    flat,
    randomize,
)

NAME = "bert_classifier"
LABELS = ("negative", "neutral", "positive")


def main() -> None:
    torch.use_deterministic_algorithms(True)
    out = FIXTURES / NAME
    shutil.rmtree(out, ignore_errors=True)
    tok = bert_tokenizer()
    config = encoder_config("bert", tok, len(LABELS))
    config.id2label = dict(enumerate(LABELS))
    config.label2id = {label: i for i, label in enumerate(LABELS)}
    torch.manual_seed(SEED + 2)
    model = transformers.BertForSequenceClassification(config).eval()
    randomize(model, SEED + 2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    encoded = [tok(text)["input_ids"] for text in TEXTS]
    with torch.no_grad():
        batch = tok(list(TEXTS), padding=True, return_tensors="pt")
        logits = model(**batch).logits.float()
    probs = torch.softmax(logits, dim=-1)
    ids, cu = flat(encoded)
    np.savez(
        out / "golden.npz",
        texts=np.array(TEXTS),
        labels=np.array(LABELS),
        input_ids=ids,
        cu_seq_lens=cu,
        logits=logits.numpy().astype(np.float32),
        probs=probs.numpy().astype(np.float32),
    )
    print(f"wrote {out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file())} B")


if __name__ == "__main__":
    main()
