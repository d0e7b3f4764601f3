"""The EAGLE-3 head (``models/eagle3.py``, ``models/loading/eagle3_checkpoint.py``) and the
target's aux hidden states (``decoder.forward_with_aux``).

The fixture head ``tests/fixtures/spec/eagle3`` was trained on the demo model's greedy tokens by
``scripts/make_spec_fixtures.py``, which measured its acceptance on the held-out sequences of
``tests/fixtures/spec/eval.json``; these tests measure it again through ``eagle3_step`` on the
paged KV cache. ``eagle3_golden.npz`` holds a PyTorch head's outputs (transformers' Llama
parts, ``scripts/make_eagle3_golden.py``) for the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.config import ConfigError
from jaxserve.engine_config import default_model_dir
from jaxserve.models import decoder, rope
from jaxserve.models.batch import make_kv_cache_for
from jaxserve.models.contiguous_batch import sequences_batch
from jaxserve.models.eagle3 import (
    default_aux_layers,
    eagle3_forward,
    eagle3_step,
    fuse_aux_hidden,
    greedy_draft,
    make_eagle3_kv_cache,
    target_logits,
)
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.layers import fuse_layer
from jaxserve.models.loading.checkpoint_loader import load_weights, tensor_files
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError
from jaxserve.models.loading.eagle3_checkpoint import load_eagle3, read_eagle3_config

SPEC = Path(__file__).parent / "fixtures" / "spec"
HEAD = SPEC / "eagle3"
LLAMA = Path(__file__).parent / "fixtures" / "models" / "llama"
PAGE = 16
TOLERANCE = 0.01  # below the measured rates: the same code, other jax versions' rounding


@pytest.fixture(scope="module")
def demo():
    config = load_model_config(default_model_dir())
    return config, load_weights(default_model_dir(), config, jnp.float32)


@pytest.fixture(scope="module")
def evaluation(demo):
    """The held-out sequences, the demo's aux states f32[T, 3H] and greedy token at every
    position (flattened), and the measured acceptance."""
    config, weights = demo
    report = json.loads((SPEC / "eval.json").read_text())
    sequences = report["sequences"]
    pages = -(-max(map(len, sequences)) // PAGE)
    batch = sequences_batch([(s, 0) for s in sequences], PAGE, pages)
    cache = make_kv_cache_for(config, len(sequences) * pages, PAGE, jnp.float32)
    aux_layers = tuple(report["aux_layers"])
    _, hidden, aux = decoder.forward_with_aux(weights, cache, batch, config, aux_layers)
    greedy = np.asarray(jnp.argmax(decoder.compute_logits(weights, hidden), -1))
    return report, jnp.concatenate(aux, -1), greedy


def read_all(model_dir: Path) -> dict[str, np.ndarray]:
    files = tensor_files(model_dir)
    with CheckpointReader(files) as reader:
        return {name: reader.read_to_host(name) for name in files}


def copy_head(tmp_path: Path, tensors: dict | None = None, **config_changes) -> Path:
    out = tmp_path / "head"
    shutil.copytree(HEAD, out)
    config = json.loads((HEAD / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_aux_states_are_the_inputs_of_the_named_layers() -> None:
    config = load_model_config(LLAMA)
    weights = load_weights(LLAMA, config, jnp.float32)
    ids = [0, 5, 17, 3, 99, 42, 7]
    batch = sequences_batch([(ids, 0)], PAGE, 1)
    cache = make_kv_cache_for(config, 1, PAGE, jnp.float32)
    _, hidden, aux = decoder.forward_with_aux(weights, cache, batch, config, (1, 0))
    _, plain = decoder.forward(weights, cache, batch, config)
    np.testing.assert_array_equal(hidden, plain)
    # Directly: the embedding enters layer 0, layer 0's output enters layer 1.
    x = weights.embed[batch.input_ids]
    rotary = rope.cos_sin(
        *rope.rotary_angles(batch.positions, config.head_dim, *config.layer_rope(0)), x.dtype
    )
    after_first, _ = decoder.decoder_layer(
        weights.layers[0], x, cache[0], batch, config, rotary,
        decoder.dispatch.ragged_paged_attention, 0, None, None, None, None,
    )  # fmt: skip
    np.testing.assert_array_equal(aux[1], x)
    np.testing.assert_allclose(aux[0], after_first, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"aux_layers \[2\] outside \[0, num_layers=2\)"):
        decoder.forward_with_aux(weights, cache, batch, config, (2,))


def test_the_published_layout_loads_with_its_shapes(demo) -> None:
    config, weights = demo
    names = set(tensor_files(HEAD))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= names
    assert {"lm_head.weight", "norm.weight", "d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names  # the target's is used
    head_config, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    h, w = config.hidden_size, head_config.draft_vocab_size
    assert head.fc.shape == (3 * h, h)
    assert head.layer.wq.shape == (2 * h, config.num_q_heads, config.head_dim)
    assert head.layer.wk.shape == (2 * h, config.num_kv_heads, config.head_dim)
    assert head.lm_head.shape == (h, w) and head.draft_to_target.shape == (w,)
    tensors = read_all(HEAD)
    np.testing.assert_array_equal(head.draft_to_target, np.arange(w) + tensors["d2t"])
    assert tensors["t2d"][np.asarray(head.draft_to_target)].all() and tensors["t2d"].sum() == w
    assert head_config.aux_layers(config.num_layers) == (1, 2, 3)
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's when a head names none


def test_a_greedy_draft_is_the_argmax_of_the_target_vocabulary_logits(demo) -> None:
    """``greedy_draft`` (the chain's: the draft vocabulary's argmax, mapped to a target id) is
    the id ``target_logits``' argmax picks over the whole target vocabulary: on random rows,
    and on a row whose best logit ties between two draft ids (the lower id wins in both,
    ``draft_to_target`` ascending as the fixture's does)."""
    config, weights = demo
    _, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    assert bool(jnp.all(jnp.diff(head.draft_to_target) > 0))
    normed = jax.random.normal(jax.random.key(3), (24, config.hidden_size), jnp.float32)
    best = 10.0 * normed[0]  # row 0's logit at draft ids 3 and 7: 10 |row 0|^2, the largest
    tied = dataclasses.replace(head, lm_head=head.lm_head.at[:, 3].set(best).at[:, 7].set(best))
    for h in (head, tied):
        full = target_logits(h, normed, config.vocab_size)
        np.testing.assert_array_equal(greedy_draft(h, normed), jnp.argmax(full, -1))
    assert int(greedy_draft(tied, normed)[0]) == int(head.draft_to_target[3])


def test_model_prefixed_and_layers_0_names_load_the_same(demo, tmp_path) -> None:
    config, weights = demo
    renamed = {
        "model." + name.replace("midlayer.", "layers.0."): value
        for name, value in read_all(HEAD).items()
    }
    _, head = load_eagle3(copy_head(tmp_path, renamed), config, weights.embed, jnp.float32)
    _, reference = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    np.testing.assert_array_equal(head.layer.wq, reference.layer.wq)
    np.testing.assert_array_equal(head.fc, reference.fc)


def test_a_head_of_another_hidden_size_is_refused(demo, tmp_path) -> None:
    config, weights = demo
    head_dir = copy_head(tmp_path, target_hidden_size=512)
    with pytest.raises(ConfigError, match=r"target_hidden_size=512 .*hidden_size=256"):
        load_eagle3(head_dir, config, weights.embed)
    tensors = read_all(HEAD)
    tensors["fc.weight"] = tensors["fc.weight"][:, :512]
    head_dir = copy_head(tmp_path / "fc", tensors)
    with pytest.raises(
        WeightsError, match=r"'fc.weight' has shape \[256, 512\], expected \[256, 768\]"
    ):
        load_eagle3(head_dir, config, weights.embed)


def test_a_head_without_its_vocabulary_map_is_refused(demo, tmp_path) -> None:
    config, weights = demo
    tensors = read_all(HEAD)
    del tensors["d2t"]
    with pytest.raises(WeightsError, match=r"'d2t' \[1024\] missing.*needs the map"):
        load_eagle3(copy_head(tmp_path, tensors), config, weights.embed)


def test_a_config_that_is_no_head_or_a_target_too_shallow_is_refused(demo, tmp_path) -> None:
    config, _ = demo
    with pytest.raises(ConfigError, match="architectures=.*LlamaForCausalLM'.*names no EAGLE-3"):
        read_eagle3_config(copy_head(tmp_path, architectures=["LlamaForCausalLM"]))
    head_config = read_eagle3_config(HEAD)
    default = dataclasses.replace(head_config, aux_layer_ids=None)
    with pytest.raises(ConfigError, match=r"\[2, 2, 1\] must be 3 distinct ids in \[0, .*=4\)"):
        default.check_target(config)  # vLLM's default ids for 4 layers repeat a layer


def test_the_head_matches_a_pytorch_head_of_transformers_parts(demo) -> None:
    config, weights = demo
    golden = np.load(SPEC / "eagle3_golden.npz")
    head_config, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    num_tokens = len(golden["token_ids"])
    batch = sequences_batch([(golden["token_ids"].tolist(), 0)], PAGE, 1)
    batch = dataclasses.replace(batch, positions=jnp.asarray(golden["positions"]))
    kv = make_eagle3_kv_cache(head_config, 1, PAGE, jnp.float32)
    hidden = fuse_aux_hidden(head, [jnp.asarray(golden["aux"])])
    # As loaded, and with q/k/v and gate/up joined as one device serves it (load_head).
    joined = dataclasses.replace(head, layer=fuse_layer(head.layer))
    assert joined.layer.fused is not None and joined.layer.fused.w_gate_up is not None
    for served in (head, joined):
        _, normed, prenorm = eagle3_forward(served, kv, batch, hidden, head_config)
        np.testing.assert_allclose(prenorm, golden["prenorm"], rtol=1e-4, atol=1e-4)
        logits = normed @ served.lm_head
        np.testing.assert_allclose(logits, golden["draft_logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(head.draft_to_target, golden["draft_to_target"])
    assert num_tokens == prenorm.shape[0]


def test_the_heads_top1_agrees_with_the_demo_models_greedy_tokens(demo, evaluation) -> None:
    config, weights = demo
    report, aux, greedy = evaluation
    head_config, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    sequences = report["sequences"]
    pages = -(-max(map(len, sequences)) // PAGE)
    starts = np.cumsum([0] + [len(s) for s in sequences])
    # Row i reads the target's state at i and the token at i + 1: it proposes the token at i + 2.
    batch = sequences_batch([(s[1:], 0) for s in sequences], PAGE, pages)
    rows = np.concatenate(
        [np.arange(a, b - 1) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    )
    kv = make_eagle3_kv_cache(head_config, len(sequences) * pages, PAGE, jnp.float32)
    _, normed, _ = eagle3_forward(head, kv, batch, fuse_aux_hidden(head, [aux[rows]]), head_config)
    proposed = np.asarray(head.draft_to_target[jnp.argmax(normed @ head.lm_head, -1)])
    agreement = float(np.mean(proposed == greedy[rows + 1]))
    measured = report["measured"]["eagle3"]["top1"]
    assert agreement >= measured - TOLERANCE and agreement > 0.3, (agreement, measured)


def chain(head, head_config, aux, sequences, anchors, k):
    """i32[anchors, k]: the drafts chained from each (sequence, n) (the token at n + 1 just
    sampled), through ``eagle3_step``, one sequence of the batch per anchor."""
    pages = -(-max(map(len, sequences)) // PAGE)
    starts = np.cumsum([0] + [len(s) for s in sequences])
    batch = sequences_batch([(sequences[s][1 : n + 2], 0) for s, n in anchors], PAGE, pages)
    rows = np.concatenate([np.arange(starts[s], starts[s] + n + 1) for s, n in anchors])
    hidden = fuse_aux_hidden(head, [aux[rows]])
    kv = make_eagle3_kv_cache(head_config, len(anchors) * pages, PAGE, jnp.float32)
    drafts = []
    for j in range(k):
        kv, logits, prenorm = eagle3_step(head, kv, batch, hidden, head_config)
        assert logits.shape == (len(anchors), head_config.vocab_size)
        drafts.append(np.asarray(jnp.argmax(logits, -1)))
        hidden = prenorm[batch.logits_indices]
        steps = [([int(t)], n + 1 + j) for t, (_, n) in zip(drafts[-1], anchors, strict=True)]
        batch = sequences_batch(steps, PAGE, pages)
    return np.stack(drafts, 1), starts


def test_chained_draft_steps_are_accepted_as_measured(demo, evaluation) -> None:
    config, weights = demo
    report, aux, greedy = evaluation
    head_config, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    sequences, k = report["sequences"], report["num_speculative_tokens"]
    first = report["prompt_len"] - 1  # from here on the tokens are the demo's greedy ones
    anchors = [(s, n) for s, seq in enumerate(sequences) for n in range(first, len(seq) - k)]
    drafts, starts = chain(head, head_config, aux, sequences, anchors, k)
    expected = np.asarray(
        [[greedy[starts[s] + n + j] for j in range(1, k + 1)] for s, n in anchors]
    )
    accepted = np.cumprod(drafts == expected, axis=1).sum(1)
    measured = report["measured"]["eagle3"]["chains"]
    assert len(anchors) == measured["num_chains"]
    assert accepted.mean() >= measured["mean_accepted"] - TOLERANCE, accepted.mean()
    assert (accepted >= 2).mean() > 0  # a second chained draft is accepted, not only the first


def test_a_chained_step_equals_one_pass_over_the_same_inputs(demo, evaluation) -> None:
    config, weights = demo
    report, aux, _ = evaluation
    head_config, head = load_eagle3(HEAD, config, weights.embed, jnp.float32)
    seq = report["sequences"][0][:20]
    kv = make_eagle3_kv_cache(head_config, 2, PAGE, jnp.float32)
    first = fuse_aux_hidden(head, [aux[:19]])
    kv, logits, prenorm = eagle3_step(
        head, kv, sequences_batch([(seq[1:], 0)], PAGE, 2), first, head_config
    )
    draft = int(jnp.argmax(logits[0]))
    _, chained, _ = eagle3_step(
        head, kv, sequences_batch([([draft], 19)], PAGE, 2), prenorm[-1:], head_config
    )
    # The same tokens and hidden rows in one pass, over a fresh cache.
    whole = sequences_batch([(seq[1:] + [draft], 0)], PAGE, 2)
    fresh = make_eagle3_kv_cache(head_config, 2, PAGE, jnp.float32)
    rows = jnp.concatenate([first, prenorm[-1:]])
    _, one_pass, _ = eagle3_step(head, fresh, whole, rows, head_config)
    np.testing.assert_allclose(chained, one_pass, rtol=1e-5, atol=1e-5)
