"""The encoder families (BERT, XLM-RoBERTa) against sentence-transformers' goldens
(``scripts/make_encoder_golden.py``): embeddings with CLS and mean pooling, cross-encoder logits
and scores, the pair tokenization the scores were made from, and the flat ragged batch (no
attention across sequences, padding without effect)."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer

from jaxserve.config_fields import ConfigError
from jaxserve.models.encoder import heads
from jaxserve.models.encoder.config import (
    encoder_config_from_dict,
    is_encoder,
    load_encoder_config,
)
from jaxserve.models.encoder.forward import EncoderBatch, forward, gelu_erf
from jaxserve.models.encoder.weights import dummy_encoder_weights, load_encoder_weights
from jaxserve.models.families.registry import model_config_from_dict
from jaxserve.models.loading.checkpoint_reader import WeightsError

ENCODERS = Path(__file__).parent / "fixtures" / "encoders"
EMBED = ("bert_embed", "xlmr_embed")
CROSS = ("bert_cross_encoder", "xlmr_cross_encoder")


@functools.cache
def model(name: str):
    config = load_encoder_config(ENCODERS / name)
    return config, load_encoder_weights(ENCODERS / name, config, jnp.float32)


@functools.partial(jax.jit, static_argnums=(2,))
def run(weights, batch, config):
    return forward(weights, batch, config)


def ragged(flat: np.ndarray, cu: np.ndarray) -> list[list[int]]:
    return [flat[a:b].tolist() for a, b in zip(cu[:-1], cu[1:], strict=True)]


def device_batch(batch: EncoderBatch) -> EncoderBatch:
    return jax.tree.map(jnp.asarray, batch)


def st_pooling(name: str) -> tuple[str, bool]:
    """The fixture's sentence-transformers pooling mode and whether it normalizes."""
    modules = json.loads((ENCODERS / name / "modules.json").read_text())
    pooling = json.loads((ENCODERS / name / "1_Pooling" / "config.json").read_text())
    return pooling["pooling_mode"], any(m["type"].endswith("Normalize") for m in modules)


@pytest.mark.parametrize("name", EMBED)
def test_embeddings_equal_sentence_transformers(name):
    golden = np.load(ENCODERS / name / "golden.npz")
    tokenizer = AutoTokenizer.from_pretrained(ENCODERS / name)
    token_ids = [tokenizer(str(text))["input_ids"] for text in golden["texts"]]
    assert token_ids == ragged(golden["input_ids"], golden["cu_seq_lens"])
    config, weights = model(name)
    # every text in one flat batch, padded to a bucket of tokens and of sequences
    batch = device_batch(EncoderBatch.from_sequences(token_ids, num_tokens=128, num_seqs=8))
    hidden = run(weights, batch, config)
    num_tokens, num_seqs = len(golden["input_ids"]), len(token_ids)
    np.testing.assert_allclose(hidden[:num_tokens], golden["token_embeddings"], atol=1e-4)
    pooling, is_normalized = st_pooling(name)
    assert (pooling, is_normalized) == ({"bert_embed": "cls", "xlmr_embed": "mean"}[name], True)
    embeddings = heads.encoder_pool(hidden, batch.cu_seq_lens, pooling, is_normalized)
    assert embeddings.shape == (8, config.hidden_size) and embeddings.dtype == jnp.float32
    np.testing.assert_allclose(embeddings[:num_seqs], golden["embeddings"], atol=1e-4)


@pytest.mark.parametrize("name", CROSS)
def test_cross_encoder_scores_equal_sentence_transformers(name):
    golden = np.load(ENCODERS / name / "golden.npz")
    tokenizer = AutoTokenizer.from_pretrained(ENCODERS / name)
    pairs = [tokenizer(str(golden["query"]), str(doc)) for doc in golden["documents"]]
    cu = golden["cu_seq_lens"]
    # a pair is [CLS] q [SEP] d [SEP] with token types 0 then 1 (XLM-R: <s> q </s></s> d </s>)
    assert [p["input_ids"] for p in pairs] == ragged(golden["input_ids"], cu)
    type_ids = [p.get("token_type_ids", [0] * len(p["input_ids"])) for p in pairs]
    assert type_ids == ragged(golden["token_type_ids"], cu)
    config, weights = model(name)
    assert config.num_labels == 1 and config.score_activation == "sigmoid"
    batch = EncoderBatch.from_sequences(
        [p["input_ids"] for p in pairs], type_ids, num_tokens=256, num_seqs=8
    )
    batch = device_batch(batch)
    logits = heads.classify(weights.head, run(weights, batch, config), batch.cu_seq_lens)
    scores = heads.scores(logits, config.score_activation)
    num_docs = len(pairs)
    np.testing.assert_allclose(logits[:num_docs, 0], golden["logits"], atol=1e-4)
    np.testing.assert_allclose(scores[:num_docs, 0], golden["scores"], atol=1e-5)
    assert np.argsort(-scores[:num_docs, 0]).tolist() == np.argsort(-golden["scores"]).tolist()


def test_bert_pairs_use_the_second_token_type():
    golden = np.load(ENCODERS / "bert_cross_encoder" / "golden.npz")
    assert set(golden["token_type_ids"].tolist()) == {0, 1}


def test_sequences_in_one_batch_equal_each_alone_whatever_the_padding():
    """No attention across sequences: each pair alone (at the same bucket shape, one compile)
    gives the rows it gives beside the others, and padding tokens of any id change nothing."""
    golden = np.load(ENCODERS / "bert_cross_encoder" / "golden.npz")
    config, weights = model("bert_cross_encoder")
    cu = golden["cu_seq_lens"]
    ids, types = ragged(golden["input_ids"], cu), ragged(golden["token_type_ids"], cu)
    together = EncoderBatch.from_sequences(ids, types, num_tokens=128, num_seqs=8)
    hidden = np.asarray(run(weights, device_batch(together), config))
    rng = np.random.default_rng(0)
    for i in range(len(ids)):
        alone = EncoderBatch.from_sequences([ids[i]], [types[i]], num_tokens=128, num_seqs=8)
        num_pad = 128 - len(ids[i])
        alone.input_ids[len(ids[i]) :] = rng.integers(0, config.vocab_size, num_pad)
        alone.token_type_ids[len(ids[i]) :] = rng.integers(0, 2, num_pad)
        hidden_alone = np.asarray(run(weights, device_batch(alone), config))
        np.testing.assert_allclose(
            hidden_alone[: len(ids[i])], hidden[cu[i] : cu[i + 1]], atol=1e-5
        )


def test_pooling_reads_only_each_sequences_tokens():
    """Padding rows hold whatever the attention left there (cuDNN's packed form does not write
    them): even NaN reaches no sequence's pooled rows."""
    from jaxserve.runner.encoder_runner import encoder_step_outputs

    nan = float("nan")
    hidden = jnp.asarray([[1.0, 0.0], [3.0, 4.0], [5.0, 6.0], [nan, nan]])  # row 3: padding
    cu = jnp.asarray([0, 1, 3, 3], jnp.int32)  # sequences of 1 and 2 tokens, one padding slot
    np.testing.assert_allclose(heads.pool_cls(hidden, cu)[:2], [[1.0, 0.0], [3.0, 4.0]])
    np.testing.assert_allclose(heads.pool_mean(hidden, cu)[:2], [[1.0, 0.0], [4.0, 5.0]])
    outputs = encoder_step_outputs(hidden, cu)[:2]  # sums, first and last rows
    np.testing.assert_allclose(outputs[:, 0], [[1.0, 0.0], [8.0, 10.0]])
    np.testing.assert_allclose(outputs[:, 2], [[1.0, 0.0], [5.0, 6.0]])
    normed = heads.encoder_pool(hidden, cu, "cls", is_normalized=True)
    np.testing.assert_allclose(normed[:2], [[1.0, 0.0], [0.6, 0.8]])
    with pytest.raises(ValueError, match="pooling='last'"):
        heads.encoder_pool(hidden, cu, "last", is_normalized=False)  # type: ignore[arg-type]


def test_scores_apply_the_saved_activation():
    logits = jnp.asarray([[0.0], [2.0]])
    np.testing.assert_allclose(heads.scores(logits, "sigmoid")[:, 0], [0.5, 0.880797], atol=1e-6)
    np.testing.assert_allclose(heads.scores(logits, "identity"), logits)
    with pytest.raises(ValueError, match="activation='softmax'"):
        heads.scores(logits, "softmax")


def test_batch_from_sequences_pads_and_refuses_what_does_not_fit():
    batch = EncoderBatch.from_sequences([[5, 6, 7], [8]], num_tokens=6, num_seqs=3)
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 0]
    assert batch.cu_seq_lens.tolist() == [0, 3, 4, 4]
    assert batch.token_type_ids.tolist() == [0] * 6
    with pytest.raises(ValueError, match="num_tokens=3"):
        EncoderBatch.from_sequences([[5, 6, 7], [8]], num_tokens=3)
    with pytest.raises(ValueError, match="one entry per token"):
        EncoderBatch.from_sequences([[5, 6]], [[0]])


def raw_config(name: str) -> dict:
    return json.loads((ENCODERS / name / "config.json").read_text())


def test_config_reads_each_family():
    bert = load_encoder_config(ENCODERS / "bert_embed")
    assert (bert.model_type, bert.num_labels, bert.position_offset) == ("bert", 0, 0)
    assert (bert.type_vocab_size, bert.layer_norm_eps, bert.max_seq_len) == (2, 1e-12, 64)
    xlmr = load_encoder_config(ENCODERS / "xlmr_cross_encoder")
    # XLM-R's positions start at pad_token_id + 1 = 2: a table of 66 rows holds 64 tokens
    assert (xlmr.model_type, xlmr.num_labels, xlmr.position_offset) == ("xlm-roberta", 1, 2)
    assert (xlmr.type_vocab_size, xlmr.max_seq_len, xlmr.head_dim) == (1, 64, 8)
    assert is_encoder(raw_config("bert_embed"))
    assert not is_encoder({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_unknown_architectures_keep_their_errors():
    raw = {**raw_config("bert_embed"), "architectures": ["BertForMaskedLM"]}
    with pytest.raises(ConfigError, match="BertForMaskedLM.*supported encoders: BertModel"):
        encoder_config_from_dict(raw)
    raw = {**raw_config("bert_embed"), "architectures": ["XLMRobertaModel"]}
    with pytest.raises(ConfigError, match="model_type='bert' with architectures=.'XLMRoberta"):
        encoder_config_from_dict(raw)
    # the decoder registry still names what it serves for an encoder's config
    with pytest.raises(ConfigError, match=r"architectures=\['BertModel'\] is not supported"):
        model_config_from_dict(raw_config("bert_embed"))
    with pytest.raises(ConfigError, match="hidden_act='swish'"):
        encoder_config_from_dict({**raw_config("bert_embed"), "hidden_act": "swish"})
    with pytest.raises(ConfigError, match="position_embedding_type='relative_key'"):
        encoder_config_from_dict(
            {**raw_config("bert_embed"), "position_embedding_type": "relative_key"}
        )


def copy_fixture(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ENCODERS / name, tmp_path / name))


@pytest.mark.parametrize(
    ("where", "path", "expected"),
    [
        ("st", "torch.nn.modules.linear.Identity", "identity"),
        ("st", "my_package.Scale", "sigmoid"),  # not torch's: skipped, as CrossEncoder does
        ("config", "torch.nn.modules.activation.Tanh", "tanh"),
        ("old", "torch.nn.modules.linear.Identity", "identity"),
        ("none", None, "sigmoid"),
    ],
)
def test_cross_encoder_reads_its_saved_score_activation(tmp_path, where, path, expected):
    model_dir = copy_fixture("bert_cross_encoder", tmp_path)
    st_path = model_dir / "config_sentence_transformers.json"
    st_config = json.loads(st_path.read_text())
    raw = raw_config("bert_cross_encoder")
    st_config.pop("activation_fn")
    if where == "st":
        st_config["activation_fn"] = path
    elif where == "config":
        raw["sentence_transformers"] = {"activation_fn": path}
    elif where == "old":
        raw["sbert_ce_default_activation_function"] = path
    st_path.write_text(json.dumps(st_config))
    (model_dir / "config.json").write_text(json.dumps(raw))
    assert load_encoder_config(model_dir).score_activation == expected


def test_an_unsupported_score_activation_is_named(tmp_path):
    model_dir = copy_fixture("bert_cross_encoder", tmp_path)
    st_path = model_dir / "config_sentence_transformers.json"
    st_path.write_text(json.dumps({"activation_fn": "torch.nn.modules.activation.ReLU"}))
    with pytest.raises(ConfigError, match="activation_fn='torch.nn.modules.activation.ReLU'"):
        load_encoder_config(model_dir)


def test_weights_load_with_or_without_the_family_prefix(tmp_path):
    """A classifier's encoder under ``bert.`` (as transformers saves it) or bare (as
    sentence-transformers saves an embedding model) loads to the same weights."""
    model_dir = copy_fixture("bert_cross_encoder", tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    save_file(
        {k.removeprefix("bert."): v for k, v in tensors.items()}, model_dir / "model.safetensors"
    )
    config, weights = model("bert_cross_encoder")
    bare = load_encoder_weights(model_dir, config, jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, bare, weights)


def test_missing_or_misshapen_tensors_are_named(tmp_path):
    model_dir = copy_fixture("xlmr_cross_encoder", tmp_path)
    config = load_encoder_config(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    name = "roberta.encoder.layer.1.attention.self.key.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, model_dir / "model.safetensors")
    with pytest.raises(WeightsError, match=rf"{name}' \(expected shape \[32\]\) is missing"):
        load_encoder_weights(model_dir, config, jnp.float32)
    tensors["classifier.out_proj.weight"] = np.zeros((2, 32), np.float32)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(WeightsError, match=r"out_proj.weight' has shape \[2, 32\], expected"):
        load_encoder_weights(model_dir, config, jnp.float32)


def test_dummy_weights_have_the_loaded_weights_shapes():
    config, weights = model("xlmr_cross_encoder")
    dummy = dummy_encoder_weights(config, jnp.bfloat16, seed=1)
    shapes = jax.tree.map(lambda x: x.shape, weights)
    assert jax.tree.map(lambda x: x.shape, dummy) == shapes
    assert {x.dtype for x in jax.tree.leaves(dummy)} == {jnp.dtype(jnp.bfloat16)}


def test_bfloat16_weights_give_the_embeddings_within_bfloat16_error():
    golden = np.load(ENCODERS / "bert_embed" / "golden.npz")
    config = load_encoder_config(ENCODERS / "bert_embed")
    weights = load_encoder_weights(ENCODERS / "bert_embed", config, jnp.bfloat16)
    token_ids = ragged(golden["input_ids"], golden["cu_seq_lens"])
    batch = device_batch(EncoderBatch.from_sequences(token_ids, num_tokens=64, num_seqs=4))
    hidden = run(weights, batch, config)
    assert hidden.dtype == jnp.bfloat16
    embeddings = heads.encoder_pool(hidden, batch.cu_seq_lens, "cls", is_normalized=True)
    cosines = np.sum(np.asarray(embeddings) * golden["embeddings"], axis=-1)
    assert cosines.min() > 0.999, cosines


# -- the runner's windowed attention ---------------------------------------------------------


def _segments_of(lengths: list[int], num_tokens: int) -> jax.Array:
    """i32[T]: each token's sequence, padding past the last one its own segment."""
    from jaxserve.models.encoder.forward import segment_ids

    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return segment_ids(jnp.asarray(cu), num_tokens)


def _attention_inputs(seed: int, num_tokens: int, dtype=jnp.float32, head_dim: int = 16):
    rng = np.random.default_rng(seed)
    shape = (num_tokens, 4, head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("num_tokens", [64, 256])
def test_windowed_attention_equals_the_dense_reference(num_tokens: int):
    """Sequences of up to one tile (32 tokens) across tile edges, and padding after them:
    each query tile sees its own tile and the two beside it, which hold its whole sequence."""
    from jaxserve.models.encoder.forward import segment_attention
    from jaxserve.runner.segment_attention import windowed_segment_attention

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < num_tokens - 40:
        lengths.append(int(rng.integers(1, 33)))
        total += lengths[-1]
    segments = _segments_of(lengths, num_tokens)
    q, k, v = _attention_inputs(seed, num_tokens)
    want = segment_attention(q, k, v, segments, 0.25)
    got = windowed_segment_attention(q, k, v, segments, 0.25, tile=32)
    real = sum(lengths)  # padding rows are garbage either way (forward's contract)
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-5, atol=1e-5, err_msg=f"{seed=}")


def test_encoder_attention_names_its_choice(monkeypatch):
    from jaxserve.runner.encoder_runner import ENCODER_ATTENTION_ENV, encoder_attention

    monkeypatch.delenv(ENCODER_ATTENTION_ENV, raising=False)
    assert encoder_attention(jnp.bfloat16) == (
        "xla",
        "cuDNN is a GPU library; this is the cpu backend",
    )
    monkeypatch.setenv(ENCODER_ATTENTION_ENV, "cudnn")
    assert encoder_attention(jnp.float32)[0] == "cudnn"  # as asked (a GPU's cuDNN refuses f32)
    monkeypatch.setenv(ENCODER_ATTENTION_ENV, "packed")
    assert encoder_attention(jnp.bfloat16) == ("packed", f"{ENCODER_ATTENTION_ENV}=packed")
    monkeypatch.setenv(ENCODER_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="JAXSERVE_ENCODER_ATTENTION='flash' must be one of"):
        encoder_attention(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
@pytest.mark.parametrize("num_tokens", [64, 1024])
def test_cudnn_windowed_attention_equals_the_reference(num_tokens: int):
    from jaxserve.models.encoder.forward import segment_attention
    from jaxserve.runner.segment_attention import windowed_segment_attention

    seed = int(np.random.default_rng().integers(2**31))
    lengths = [int(n) for n in np.random.default_rng(seed).integers(1, 65, num_tokens // 40)]
    segments = _segments_of(lengths, num_tokens)
    q, k, v = _attention_inputs(seed, num_tokens, jnp.bfloat16, head_dim=64)  # BGE's heads
    want = segment_attention(q, k, v, segments, 0.25).astype(jnp.float32)
    got = jax.jit(
        functools.partial(windowed_segment_attention, tile=64, implementation="cudnn"),
        static_argnums=4,
    )(q, k, v, segments, 0.25)
    # Only the sequences' rows: the padding (one segment, here longer than the windows) is
    # garbage by forward's contract, and the H200 run of 2026-12-05 compared it too.
    real = sum(lengths)
    got32 = np.asarray(got.astype(jnp.float32))[:real]
    np.testing.assert_allclose(got32, np.asarray(want)[:real], atol=2e-2, err_msg=f"{seed=}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
@pytest.mark.parametrize(
    "num_tokens, num_seqs, max_len",
    [(64, 1, 64), (64, 8, 16), (1024, 64, 64), (16384, 256, 512)],
)
def test_cudnn_packed_attention_equals_the_reference(num_tokens, num_seqs, max_len):
    """cuDNN over packed sequences: every sequence's rows equal the dense reference's (lengths
    from 1 to ``max_len``, padding sequences of length 0 after them, padding tokens after the
    last), padding rows are zeros when asked for (the encoder does not ask); one sequence alone
    takes the plain padding mask."""
    from jaxserve.models.encoder.forward import segment_attention
    from jaxserve.runner.segment_attention import packed_segment_attention
    from tests.test_pooling_attention import ragged

    seed = int(np.random.default_rng().integers(2**31))
    cu_seq_lens, segments, real = ragged(seed, num_tokens, max_len, num_seqs)
    q, k, v = _attention_inputs(seed, num_tokens, jnp.bfloat16, head_dim=64)
    want = segment_attention(q[:real], k[:real], v[:real], segments[:real], 0.125)
    got = jax.jit(packed_segment_attention, static_argnums=4)(
        q, k, v, segments, 0.125, cu_seq_lens=cu_seq_lens
    )
    got32 = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(
        got32[:real], np.asarray(want.astype(jnp.float32)), atol=2e-2, err_msg=f"{seed=}"
    )
    assert not got32[real:].any(), "padding rows are zeros"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (cuDNN)")
def test_cudnn_packed_encoder_embeds_as_the_reference(monkeypatch):
    """The bf16 encoder through the runner: packed attention (auto on Hopper) against the
    windowed jnp reference, texts of mixed lengths in one step."""
    import jaxserve
    from jaxserve.runner.encoder_runner import ENCODER_ATTENTION_ENV

    texts = [[5 + (i * 7 + j) % 100 for j in range(1 + (i * 13) % 60)] for i in range(24)]
    embeddings = {}
    for choice in ("packed", "xla"):
        monkeypatch.setenv(ENCODER_ATTENTION_ENV, choice)
        llm = jaxserve.LLM(
            str(ENCODERS / "bert_embed"),
            runner="pooling",
            dtype="bfloat16",
            max_model_len=64,
            max_num_batched_tokens=1024,
        )
        embeddings[choice] = np.array([o.outputs.embedding for o in llm.embed(texts)])
        llm.shutdown()
    np.testing.assert_allclose(embeddings["packed"], embeddings["xla"], atol=3e-2)


def test_exact_gelu_is_x_phi_x() -> None:
    """BERT's "gelu" as x / 2 (1 + erf(x / sqrt 2)) in float32: within float32 rounding of
    x Phi(x) in float32, and within half a bf16 ulp (plus the float32 error) on bf16 inputs,
    no further from it than ``jax.nn.gelu``'s exact form."""
    x = np.random.default_rng().standard_normal(20_000).astype(np.float32) * 4
    want = np.array([v / 2 * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    np.testing.assert_allclose(np.asarray(gelu_erf(jnp.asarray(x))), want, rtol=1e-5, atol=2e-6)
    xb = jnp.asarray(x, jnp.bfloat16)
    wanted = [v / 2 * math.erfc(-v / math.sqrt(2)) for v in np.asarray(xb, np.float64)]
    want = np.array(wanted)
    got = np.asarray(gelu_erf(xb), np.float64)
    assert np.all(np.abs(got - want) <= 2**-8 * np.abs(want) + 2e-6)  # half an ulp: <= 2^-8
    old = np.asarray(jax.nn.gelu(xb, approximate=False), np.float64)
    assert np.abs(got - want).max() <= np.abs(old - want).max()


@pytest.mark.parametrize("every_bucket", [False, True])
def test_warm_up_runs_the_smallest_bucket_or_on_a_gpu_each(monkeypatch, every_bucket):
    """The encoder's warm-up compiles every bucket, then runs the smallest once, or where a
    program's first run costs (a GPU: stood in for here) each bucket once."""
    import jaxserve
    from jaxserve.runner import encoder_runner, warmup

    monkeypatch.setattr(warmup, "runs_every_bucket", lambda: every_bucket)
    asked = []
    padding = encoder_runner.EncoderRunner.padding_batch

    def recording(self, num_tokens):
        asked.append(num_tokens)
        return padding(self, num_tokens)

    monkeypatch.setattr(encoder_runner.EncoderRunner, "padding_batch", recording)
    bert = str(Path(__file__).parent / "fixtures" / "encoders" / "bert_embed")
    llm = jaxserve.LLM(bert, runner="pooling", max_model_len=64, max_num_batched_tokens=64)
    buckets = list(llm.engine.runner.buckets.token_buckets)
    llm.shutdown()
    runs = buckets if every_bucket else buckets[:1]
    assert len(buckets) > 1 and asked == buckets + runs  # one lowering each, then the runs
