"""New weights for a running engine (``LLM.update_weights``, ``LLM.update_weights_from_disk``):
served from the next generate, equal to a fresh engine on those weights, without a compile;
weights that do not fit change nothing; the prefix cache is cleared."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.engine.llm import LLM
from jaxserve.runner.weight_update import WeightsUpdateError
from jaxserve.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, fixture_dir

PROMPTS = [[5, 17, 40, 41, 2, 9], [7, 7, 7, 100, 3]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def make_llm(model: Path) -> LLM:
    return LLM(str(model), dtype="float32", **SMALL_ENGINE)


def sample(llm: LLM) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens of ``PROMPTS`` and their logprobs."""
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in outs
    ]
    return [list(o.token_ids) for o in outs], np.array(logprobs)


def copy_model(tmp_path: Path, name: str, change) -> Path:
    """The llama fixture with ``change(tensors)`` applied to its safetensors."""
    source = fixture_dir("llama")
    target = tmp_path / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("golden.npz"))
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def scaled(tensors: dict[str, np.ndarray]) -> None:
    rng = np.random.default_rng(0)
    for name, value in tensors.items():
        if "norm" not in name:
            noise = rng.standard_normal(value.shape).astype(value.dtype)
            tensors[name] = value + noise * np.abs(value).mean()


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> tuple[Path, list[list[int]], np.ndarray, object]:
    """Another checkpoint of the same shapes, and what a fresh engine on it samples."""
    path = copy_model(tmp_path_factory.mktemp("models"), "other", scaled)
    fresh = make_llm(path)
    tokens, logprobs = sample(fresh)
    weights = jax.tree.map(np.asarray, fresh.weights)  # on the host, as a trainer might hand them
    fresh.shutdown()
    return path, tokens, logprobs, weights


@pytest.fixture(scope="module")
def llm():
    engine = make_llm(fixture_dir("llama"))
    yield engine
    engine.shutdown()


def test_weights_from_disk_sample_as_a_fresh_engine_does(llm, other) -> None:
    path, tokens, logprobs, _ = other
    before, _ = sample(llm)
    assert before != tokens  # the other weights sample other tokens
    num_programs = llm.engine.runner.programs.step_fn._cache_size()
    seconds = llm.update_weights_from_disk(path)
    assert seconds >= 0
    after, after_logprobs = sample(llm)
    assert after == tokens
    np.testing.assert_allclose(after_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    assert llm.engine.runner.programs.step_fn._cache_size() == num_programs  # nothing compiled
    llm.update_weights_from_disk(fixture_dir("llama"))  # and back
    assert sample(llm)[0] == before


def test_weights_from_a_pytree_sample_as_a_fresh_engine_does(llm, other) -> None:
    _, tokens, logprobs, host_weights = other
    before, _ = sample(llm)
    served = llm.weights
    llm.update_weights(host_weights)  # numpy leaves: placed on the device, as served
    after, after_logprobs = sample(llm)
    assert after == tokens
    np.testing.assert_allclose(after_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    leaves = jax.tree.leaves(llm.weights)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert [leaf.dtype for leaf in leaves] == [leaf.dtype for leaf in jax.tree.leaves(served)]
    llm.update_weights(served)  # device arrays of the served dtype: served as they are
    pairs = zip(jax.tree.leaves(llm.weights), jax.tree.leaves(served), strict=True)
    assert all(a is b for a, b in pairs)
    assert sample(llm)[0] == before


def test_weights_that_do_not_fit_change_nothing(llm, tmp_path) -> None:
    before, _ = sample(llm)
    served = llm.weights
    wrong = jax.tree.map(lambda x: x, served)
    wrong.layers[0].mlp_norm = np.ones(3, np.float32)
    with pytest.raises(WeightsUpdateError, match=r"\.layers\[0\]\.mlp_norm: shape \(3,\)"):
        llm.update_weights(wrong)
    with pytest.raises(WeightsUpdateError, match=r"\.embed: missing"):
        llm.update_weights({"lm_head": served.lm_head})
    with pytest.raises(WeightsUpdateError, match="the whole tree: not a weight of this model"):
        llm.update_weights(object())  # not a pytree: one leaf, at no weight's path

    def cut(tensors: dict[str, np.ndarray]) -> None:
        name = "model.layers.1.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :-1].copy()

    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        llm.update_weights_from_disk(copy_model(tmp_path, "cut", cut))
    assert llm.weights is served
    assert sample(llm)[0] == before


def test_an_update_clears_the_prefix_cache_and_waits_for_no_request(llm, other) -> None:
    before, _ = sample(llm)
    assert llm.engine.kv.pool.cached  # the prompts' blocks stay cached for the next request
    served = llm.weights
    llm.update_weights(served)
    assert not llm.engine.kv.pool.cached
    llm.engine.add_request("running", PROMPTS[0], PARAMS)
    with pytest.raises(RuntimeError, match="requests are queued"):
        llm.update_weights(served)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.update_weights(served)
    llm.engine.abort_request("running")
    llm.update_weights(served)  # the abort taken, nothing runs
    assert sample(llm)[0] == before
