"""Build the encoder golden fixtures under ``tests/fixtures/encoders/``.

Run with an interpreter that has torch (CPU), transformers and sentence-transformers:

    /work/goldenvenv/bin/python scripts/make_encoder_golden.py

Tiny random fp32 models made with transformers' own classes (hidden 32, 2 layers, 4 heads,
intermediate 64, max_position_embeddings 64) and saved the way sentence-transformers publishes
them, each directory with a ``golden.npz`` of what sentence-transformers computes:

- ``bert_embed``: ``BertModel`` + CLS pooling + Normalize (as BGE publishes), ``encode(texts)``;
- ``xlmr_embed``: ``XLMRobertaModel`` + mean pooling + Normalize (as E5 publishes);
- ``bert_cross_encoder``: ``BertForSequenceClassification`` (num_labels 1) saved by
  ``CrossEncoder.save``, ``predict`` of one query against several documents (text pairs with
  token type ids);
- ``xlmr_cross_encoder``: the same with ``XLMRobertaForSequenceClassification`` (as the BGE
  rerankers are).

The BERT models share a WordPiece tokenizer and the XLM-R models a Unigram tokenizer, both
built here from ``CORPUS`` (its words and every character). Weights are N(0, 0.3²), LayerNorm
scales 1 + 0.1·N(0, 1) and biases 0.1·N(0, 1), so outputs are far from flat. The output is
deterministic: torch 2.14.1, transformers 5.25.0, sentence-transformers 6.3.0 and tokenizers
0.23.3 rewrite the same bytes.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "encoders"
MAX_LEN = 64  # max_position_embeddings of BERT; XLM-R's is 64 + 2 (positions from pad + 1)
SEED = 0

CORPUS = """\
The serving engine keeps every request in a queue and runs one forward pass over the batch.
A search engine ranks documents by how well they answer the query.
Embeddings map a sentence to a vector; similar sentences have close vectors.
The cache is split into pages of sixteen tokens, and a long prompt uses many pages.
Le moteur garde chaque requête dans une file. Die Suchmaschine ordnet die Dokumente.
What is the capital of France? Paris is the capital and largest city of France.
Rerankers read the query and the document together and give one score.
"""

TEXTS = (
    "pages",
    "What is the capital of France?",
    "Embeddings map a sentence to a vector, and a search engine ranks documents by them.",
    "Le moteur garde chaque requête dans une file; zebra quokka.",
)
QUERY = "What is the capital of France?"
DOCUMENTS = (
    "Paris is the capital and largest city of France.",
    "The cache is split into pages.",
    "France",
    "A search engine ranks documents by how well they answer the query, one score each.",
)


def corpus_words(pre_tokenizer, normalize=lambda text: text) -> list[tuple[str, int]]:
    """The corpus' words as ``pre_tokenizer`` splits them, with their counts, sorted."""
    counts: dict[str, int] = {}
    for word, _ in pre_tokenizer.pre_tokenize_str(normalize(CORPUS)):
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items())


# NOTE: the vocabularies are built here, not by tokenizers' trainers, whose output changes from
# run to run (ties broken in hash-map order): every word of the corpus, then every character.
def bert_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """WordPiece, lowercased, ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` (type ids 0/1)."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer = normalizers.BertNormalizer(lowercase=True)
    words = corpus_words(pre_tokenizers.BertPreTokenizer(), normalizer.normalize_str)
    chars = sorted({c for word, _ in words for c in word})
    pieces = [w for w, n in words if len(w) > 1] + chars + [f"##{c}" for c in chars]
    vocab = {piece: i for i, piece in enumerate([*specials, *pieces])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return transformers.BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=MAX_LEN,
    )


def xlmr_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Unigram over Metaspace pieces, ``<s> A </s>`` and ``<s> A </s></s> B </s>`` (XLM-R's)."""
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    words = corpus_words(pre_tokenizers.Metaspace())
    total = sum(n for _, n in words)
    chars = sorted({c for word, _ in words for c in word})
    scored = [(w, math.log(n / total)) for w, n in words if len(w) > 1]
    scored += [(c, math.log(0.5 / total)) for c in chars]  # below every word
    tok = Tokenizer(models.Unigram([(s, 0.0) for s in specials] + scored, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<mask>"])
    tok.post_processor = processors.RobertaProcessing(
        ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
    )
    return transformers.XLMRobertaTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=MAX_LEN,
    )


def encoder_config(family: str, tok: transformers.PreTrainedTokenizerFast, num_labels: int):
    common = dict(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        pad_token_id=tok.pad_token_id,
        num_labels=num_labels,
        dtype="float32",
    )
    if family == "bert":
        return transformers.BertConfig(
            **common, max_position_embeddings=MAX_LEN, type_vocab_size=2, layer_norm_eps=1e-12
        )
    return transformers.XLMRobertaConfig(
        **common,
        max_position_embeddings=MAX_LEN + tok.pad_token_id + 1,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def randomize(model: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)


def hf_model(cls: type, config, tok, tmp: Path, seed: int) -> Path:
    """A random model of ``cls`` with its tokenizer, saved by transformers in ``tmp``."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize(model, seed)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return tmp


def flat(encodings: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged token lists -> (i32[T] concatenated, i32[S + 1] prefix sums)."""
    lens = [len(e) for e in encodings]
    if max(lens) > MAX_LEN:  # sentence-transformers would cut it: the golden would not be whole
        raise RuntimeError(f"an input of {max(lens)} tokens is longer than {MAX_LEN=}")
    return np.concatenate(encodings).astype(np.int32), np.cumsum([0, *lens]).astype(np.int32)


def make_embed(name: str, family: str, tok, pooling: str, tmp: Path) -> None:
    cls = transformers.BertModel if family == "bert" else transformers.XLMRobertaModel
    src = hf_model(cls, encoder_config(family, tok, 1), tok, tmp / name, SEED)
    transformer = Transformer(str(src), max_seq_length=MAX_LEN)
    dim = transformer.get_embedding_dimension()
    st = SentenceTransformer(modules=[transformer, Pooling(dim, pooling), Normalize()])
    st.eval()
    out = FIXTURES / name
    st.save(str(out))
    embeddings = st.encode(list(TEXTS), convert_to_numpy=True, batch_size=len(TEXTS))
    tokens = st.encode(list(TEXTS), output_value="token_embeddings", batch_size=len(TEXTS))
    ids, cu = flat([tok(text)["input_ids"] for text in TEXTS])
    np.savez(
        out / "golden.npz",
        texts=np.array(TEXTS),
        input_ids=ids,
        cu_seq_lens=cu,
        token_embeddings=np.concatenate([t.numpy() for t in tokens]).astype(np.float32),
        embeddings=embeddings.astype(np.float32),
    )


def make_cross_encoder(name: str, family: str, tok, tmp: Path) -> None:
    cls = (
        transformers.BertForSequenceClassification
        if family == "bert"
        else transformers.XLMRobertaForSequenceClassification
    )
    src = hf_model(cls, encoder_config(family, tok, 1), tok, tmp / name, SEED + 1)
    ce = CrossEncoder(str(src), max_length=MAX_LEN)
    ce.eval()
    out = FIXTURES / name
    ce.save(str(out))
    pairs = [(QUERY, doc) for doc in DOCUMENTS]
    scores = ce.predict(pairs, batch_size=len(pairs), convert_to_numpy=True)
    logits = ce.predict(
        pairs, batch_size=len(pairs), activation_fn=torch.nn.Identity(), convert_to_numpy=True
    )
    encoded = [tok(QUERY, doc) for doc in DOCUMENTS]
    ids, cu = flat([e["input_ids"] for e in encoded])
    type_ids, _ = flat([e.get("token_type_ids", [0] * len(e["input_ids"])) for e in encoded])
    np.savez(
        out / "golden.npz",
        query=np.array(QUERY),
        documents=np.array(DOCUMENTS),
        input_ids=ids,
        token_type_ids=type_ids,
        cu_seq_lens=cu,
        logits=np.asarray(logits, np.float32),
        scores=np.asarray(scores, np.float32),
    )


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for name in ("bert_embed", "xlmr_embed", "bert_cross_encoder", "xlmr_cross_encoder"):
        shutil.rmtree(FIXTURES / name, ignore_errors=True)  # (README.md stays)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    bert, xlmr = bert_tokenizer(), xlmr_tokenizer()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        make_embed("bert_embed", "bert", bert, "cls", tmp)
        make_embed("xlmr_embed", "xlm-roberta", xlmr, "mean", tmp)
        make_cross_encoder("bert_cross_encoder", "bert", bert, tmp)
        make_cross_encoder("xlmr_cross_encoder", "xlm-roberta", xlmr, tmp)
    for readme in FIXTURES.glob("*/README.md"):  # model cards with versions and dates
        readme.unlink()
    print(
        f"wrote {FIXTURES}: {sum(f.stat().st_size for f in FIXTURES.rglob('*') if f.is_file())} B"
    )


if __name__ == "__main__":
    main()
