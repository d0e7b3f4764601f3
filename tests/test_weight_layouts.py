"""``LLM.update_weights`` in the layouts a trainer writes (docs/training.md): Hugging Face names
(``model.state_dict()``, safetensors) and a flax.nnx model's state, converted on the device by
the loader's own conversion; a bad name, path or shape names itself and changes nothing."""

from __future__ import annotations

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.engine.llm import LLM
from jaxserve.models.loading.named_weights import (
    nnx_from_hf,
    nnx_to_hf_names,
    weights_from_nnx,
)
from jaxserve.models.quant import QArray
from jaxserve.runner.weight_update import WeightsUpdateError, weights_layout
from jaxserve.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, fixture_dir

EXAMPLE = fixture_dir("llama").parents[3] / "examples" / "rl_loop.py"


def example_module():
    """``examples/rl_loop.py`` (its nnx Llama), imported once."""
    if "rl_loop" not in sys.modules:
        spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["rl_loop"] = module
        spec.loader.exec_module(module)
    return sys.modules["rl_loop"]


def golden(family: str) -> dict:
    return dict(np.load(fixture_dir(family) / "golden.npz"))


def greedy(llm: LLM, family: str) -> list[int]:
    """The greedy continuation of the golden prompt (as many tokens as the golden's)."""
    g = golden(family)
    params = SamplingParams(temperature=0.0, max_tokens=len(g["greedy_ids"]), ignore_eos=True)
    prompt = {"prompt_token_ids": g["prompt_ids"].tolist()}
    return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def hf_tensors(family: str) -> dict[str, np.ndarray]:
    return load_file(fixture_dir(family) / "model.safetensors")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def random_llm(request):
    """An engine on a fixture's config with random weights (``load_format="dummy"``)."""
    family = request.param
    llm = LLM(str(fixture_dir(family)), dtype="float32", load_format="dummy", **SMALL_ENGINE)
    yield family, llm
    llm.shutdown()


def test_hugging_face_names_serve_the_checkpoint_as_transformers_does(random_llm) -> None:
    """The fixture's safetensors, on the device (jax arrays) and on the host (numpy), serve
    transformers' golden tokens, fused as the loader fuses, without a compile."""
    family, llm = random_llm
    expected = golden(family)["greedy_ids"].tolist()
    assert greedy(llm, family) != expected  # random weights
    served = llm.weights
    num_programs = llm.engine.runner.programs.step_fn._cache_size()
    tensors = hf_tensors(family)
    assert weights_layout(tensors) == "hf"
    llm.update_weights({name: jnp.asarray(value) for name, value in tensors.items()})
    assert greedy(llm, family) == expected
    new = llm.weights
    assert jax.tree.structure(new) == jax.tree.structure(served)  # q/k/v, gate/up fused
    assert new.layers[0].fused is not None and new.layers[0].wq is None
    assert [x.dtype for x in jax.tree.leaves(new)] == [x.dtype for x in jax.tree.leaves(served)]
    llm.update_weights(served)
    llm.update_weights(tensors, layout="hf")  # numpy on the host
    assert greedy(llm, family) == expected
    assert llm.engine.runner.programs.step_fn._cache_size() == num_programs
    llm.update_weights(served)


def test_an_nnx_state_serves_the_same_tokens(random_llm) -> None:
    """A flax.nnx state of the documented layout: the example's Llama (an untied lm_head), or
    the nested dict ``nnx.to_pure_dict`` writes (Qwen3: q/k norms, tied embeddings)."""
    from flax import nnx

    family, llm = random_llm
    expected = golden(family)["greedy_ids"].tolist()
    served = llm.weights
    if family == "llama":
        policy = example_module().load_policy(fixture_dir(family))
        state = nnx.state(policy, nnx.Param)
        logits = np.asarray(policy(jnp.asarray(golden(family)["prompt_ids"])[None]))[0]
        np.testing.assert_allclose(logits, golden(family)["prefill_logits"], atol=1e-4)
    else:
        state = nnx_from_hf(hf_tensors(family))
    assert weights_layout(state) == "nnx"
    names = nnx_to_hf_names(state)
    assert names["layers.1.self_attn.q_proj.kernel"] == "model.layers.1.self_attn.q_proj.weight"
    assert names["embedder.embedding"] == "model.embed_tokens.weight"
    hf = weights_from_nnx(state)
    kernel = hf["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(kernel, hf_tensors(family)["model.layers.0.mlp.down_proj.weight"])
    llm.update_weights(state)
    assert greedy(llm, family) == expected
    llm.update_weights(served)


def test_bad_names_paths_and_shapes_are_named_and_change_nothing(random_llm) -> None:
    family, llm = random_llm
    before = greedy(llm, family)
    served = llm.weights
    tensors = hf_tensors(family)
    renamed = dict(tensors)
    renamed["model.layers.0.self_attn.q_prj.weight"] = renamed.pop(
        "model.layers.0.self_attn.q_proj.weight"
    )
    with pytest.raises(WeightsUpdateError, match="2 weights do not fit") as error:
        llm.update_weights(renamed)
    assert "model.layers.0.self_attn.q_prj.weight: not a weight of this model" in str(error.value)
    assert "model.layers.0.self_attn.q_proj.weight: missing" in str(error.value)
    cut = dict(tensors)
    cut["model.layers.1.mlp.down_proj.weight"] = cut["model.layers.1.mlp.down_proj.weight"][:, :-1]
    shape = r"shape \(64, 95\), the model's is \(64, 96\)"
    with pytest.raises(WeightsUpdateError, match=r"layers\.1\.mlp\.down_proj\.weight: " + shape):
        llm.update_weights(cut)

    state = nnx_from_hf(tensors)
    state["layers"][0]["self_attn"]["q_proj"]["bias"] = np.zeros(64, np.float32)  # no bias here
    state["layers"][1]["mlp"]["gate_proj"]["scale"] = np.ones(96, np.float32)  # not a norm
    state["blocks"] = {"0": {"kernel": np.ones((2, 2), np.float32)}}  # another layout
    kernel = state["layers"][1]["mlp"]["up_proj"]["kernel"]
    state["layers"][1]["mlp"]["up_proj"]["kernel"] = kernel[:-1]  # [in - 1, out]
    with pytest.raises(WeightsUpdateError, match="4 weights do not fit") as error:
        llm.update_weights(state)
    message = str(error.value)
    assert "layers.1.mlp.gate_proj.scale: not a parameter of the nnx layout" in message
    assert "blocks.0.kernel: not a parameter of the nnx layout" in message
    assert (
        "layers.0.self_attn.q_proj.bias (model.layers.0.self_attn.q_proj.bias): "
        "not a weight of this model" in message
    )
    assert (
        "layers.1.mlp.up_proj.kernel (model.layers.1.mlp.up_proj.weight): "
        "shape (63, 96), the model's is (64, 96)" in message
    )
    del state["blocks"]
    with pytest.raises(WeightsUpdateError, match=r"layers\.0\.input_layernorm\.scale .*missing"):
        llm.update_weights({k: v for k, v in state.items() if k != "layers"} | {"layers": {}})
    with pytest.raises(ValueError, match="layout='torch' must be one of auto, engine, hf, nnx"):
        llm.update_weights(tensors, layout="torch")
    assert llm.weights is served
    assert greedy(llm, family) == before


def test_a_quantized_model_takes_named_weights_as_its_loader_quantizes_them() -> None:
    """With ``quantization="int8"`` the Hugging Face tensors are quantized on the device as the
    loader quantizes a checkpoint: the same QArrays, bit for bit."""
    llm = LLM(str(fixture_dir("llama")), quantization="int8", dtype="float32", **SMALL_ENGINE)
    loaded = llm.weights
    before = greedy(llm, "llama")
    tensors = hf_tensors("llama")
    llm.update_weights({name: value * 1.5 for name, value in tensors.items()})
    assert greedy(llm, "llama") != before
    llm.update_weights(tensors)
    assert isinstance(llm.weights.layers[0].fused.w_gate_up, QArray)  # joined, one device
    pairs = zip(jax.tree.leaves(llm.weights), jax.tree.leaves(loaded), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
    assert greedy(llm, "llama") == before
    llm.shutdown()


def test_the_layout_is_told_apart_from_the_tree() -> None:
    assert weights_layout({"lm_head": np.ones(2)}) == "engine"  # not a Hugging Face name
    assert weights_layout({"model.norm.weight": np.ones(2)}) == "hf"
    assert weights_layout({"embedder": {"embedding": np.ones(2)}}) == "nnx"
    assert weights_layout(object()) == "engine"
    assert weights_layout({"model.norm.weight": np.ones(2)}, layout="nnx") == "nnx"


TP_SCRIPT = """
import jax, numpy as np
import jaxserve
from safetensors.numpy import load_file
golden = np.load("tests/fixtures/models/qwen3/golden.npz")
llm = jaxserve.LLM("tests/fixtures/models/qwen3", tensor_parallel_size=2, load_format="dummy",
                   max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                   num_gpu_blocks_override=64, dtype="float32", warmup=False)
served = llm.weights
llm.update_weights(load_file("tests/fixtures/models/qwen3/model.safetensors"))
pairs = zip(jax.tree.leaves(llm.weights), jax.tree.leaves(served), strict=True)
print(all(a.sharding == b.sharding for a, b in pairs))
prompt = {"prompt_token_ids": golden["prompt_ids"].tolist()}
out = llm.generate(prompt, jaxserve.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(out[0].outputs[0].token_ids == golden["greedy_ids"].tolist())
"""


def test_hugging_face_names_are_placed_in_the_tensor_parallel_shards() -> None:
    """On two devices each field lands in the shards the loader places it in."""
    from tests.conftest import run_with_devices

    assert run_with_devices(TP_SCRIPT, 2, timeout=300).split() == ["True", "True"]
