"""Mixtral, Qwen3-MoE and Qwen2-MoE: their configs, their expert weights, one server over HTTP,
and expert parallelism (2 and 4 virtual CPU devices give the same tokens as 1). Prefill,
chunked prefill, decode and the long generation through ``LLM`` against transformers are the
family-generic tests of test_model_parity.py and test_model_families.py (``MOE_FAMILIES`` in
conftest)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.config import ConfigError, builtin_config_dir
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.counting import num_active_params, num_params
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.runner.parallel.sharding import layer_specs, validate_tensor_parallel_size
from tests.conftest import (
    SMALL_ENGINE,
    assert_long_completion_is_golden,
    fixture_dir,
    run_with_devices,
    tiny_server,
)

ROOT = Path(__file__).parents[1]

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
)


def test_qwen3_moe_sparse_step_and_mlp_only_layers_pick_the_expert_layers() -> None:
    config = model_config_from_dict(QWEN3_MOE | {"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.moe is not None and config.moe.dense_layers == (0, 2, 3, 4)
    assert [config.is_moe_layer(i) for i in range(6)] == [0, 1, 0, 0, 0, 1]
    assert not config.moe.norm_topk_prob  # Qwen3-MoE's default
    every = model_config_from_dict(QWEN3_MOE | {"norm_topk_prob": True})
    assert every.moe is not None and every.moe.dense_layers == () and every.moe.norm_topk_prob
    fixture = load_model_config(fixture_dir("qwen3_moe"))
    assert fixture.moe is not None and fixture.moe.dense_layers == (1,) and fixture.qk_norm
    qwen2 = load_model_config(fixture_dir("qwen2_moe"))
    assert qwen2.moe is not None and qwen2.moe.dense_layers == (0,)  # decoder_sparse_step 2
    assert qwen2.moe.shared_intermediate_size == 48 and qwen2.moe.has_shared_gate
    assert qwen2.attention_bias  # qkv_bias
    mixtral = load_model_config(fixture_dir("mixtral"))
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (4, 2, 32)


def test_moe_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        model_config_from_dict(QWEN3_MOE | {"num_experts_per_tok": 9})
    # As in transformers, a mlp_only_layers entry past the last layer names no layer.
    assert model_config_from_dict(QWEN3_MOE | {"mlp_only_layers": [7]}).moe.dense_layers == ()


def test_experts_are_the_checkpoint_tensors_stacked() -> None:
    """Each expert's gate/up/down is its own checkpoint tensor; the model stacks them on E."""
    config = load_model_config(fixture_dir("mixtral"))
    weights = load_weights(fixture_dir("mixtral"), config, jnp.float32)
    layer = weights.layers[1]
    prefix = "model.layers.1.block_sparse_moe."
    with safe_open(fixture_dir("mixtral") / "model.safetensors", framework="numpy") as f:
        assert (np.asarray(layer.router).T == f.get_tensor(prefix + "gate.weight")).all()
        for e in range(4):
            w1 = f.get_tensor(f"{prefix}experts.{e}.w1.weight")  # [M, H]
            w2 = f.get_tensor(f"{prefix}experts.{e}.w2.weight")  # [H, M]
            w3 = f.get_tensor(f"{prefix}experts.{e}.w3.weight")
            assert (np.asarray(layer.experts_gate[e]).T == w1).all()
            assert (np.asarray(layer.experts_up[e]).T == w3).all()
            assert (np.asarray(layer.experts_down[e]).T == w2).all()
    qwen = load_weights(fixture_dir("qwen3_moe"), load_model_config(fixture_dir("qwen3_moe")))
    assert qwen.layers[1].router is None and qwen.layers[1].w_gate is not None  # mlp_only
    assert qwen.layers[0].w_gate is None and qwen.layers[0].experts_gate is not None


def test_expert_specs_split_slices_or_whole_experts() -> None:
    config = load_model_config(fixture_dir("qwen3_moe"))
    tp, ep = layer_specs(config, 0), layer_specs(config, 0, expert_parallel=True)
    assert tuple(tp.experts_gate) == (None, None, "tp")  # M: a slice of every expert
    assert tuple(tp.experts_down) == (None, "tp", None)
    assert (tuple(ep.experts_gate), tuple(ep.experts_down)) == (("tp", None, None),) * 2
    assert tuple(tp.router) == (None, None)  # the router is replicated
    shared = layer_specs(load_model_config(fixture_dir("qwen2_moe")), 1, True)
    assert (tuple(shared.shared_gate), tuple(shared.shared_down)) == ((None, "tp"), ("tp", None))
    assert tuple(shared.shared_router) == (None, None)
    assert tuple(layer_specs(config, 1).w_gate) == (None, "tp")  # the dense layer
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_experts=8"):
        validate_tensor_parallel_size(
            model_config_from_dict(QWEN3_MOE | {"num_attention_heads": 6, "num_key_value_heads": 3,
                                               "intermediate_size": 99}),
            3,
            expert_parallel=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="must divide moe_intermediate_size=16"):
        validate_tensor_parallel_size(model_config_from_dict(QWEN3_MOE | {"num_experts": 6}), 32)


def test_shipped_qwen3_30b_a3b_config_has_the_real_shapes() -> None:
    config = load_model_config(builtin_config_dir("qwen3-30b-a3b"))
    assert config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (128, 8, 768)
    assert config.moe.norm_topk_prob and config.moe.dense_layers == ()
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active
    assert num_params(config) == 30_532_122_624
    assert num_active_params(config) == 3_353_032_704


def test_chat_and_completion_over_http_on_qwen3_moe() -> None:
    """The greedy completion of the long prompt is Hugging Face's; a chat answers."""
    with tiny_server("tiny-moe", family="qwen3_moe", **SMALL_ENGINE) as server:
        url = server.url
        assert_long_completion_is_golden(url, "qwen3_moe", "tiny-moe")
        chat = {
            "model": "tiny-moe",
            "messages": [{"role": "user", "content": "Hello! How big is a page?"}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["message"]["role"] == "assistant"


EXPERT_PARALLEL_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import numpy as np
    import jaxserve
    from jaxserve import SamplingParams
    for family, tp, ep in [("qwen3_moe", 1, False), ("qwen3_moe", 2, True),
                           ("qwen3_moe", 4, True), ("qwen3_moe", 2, False),
                           ("mixtral", 4, True), ("qwen2_moe", 2, True)]:
        golden = np.load(f"tests/fixtures/models/{family}/golden.npz")
        llm = jaxserve.LLM(f"tests/fixtures/models/{family}", tensor_parallel_size=tp,
                           enable_expert_parallel=ep, max_model_len=128, max_num_seqs=4,
                           max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=64,
                           dtype="float32", warmup=False)
        runner = llm.engine.runner
        prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()}
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
        out = llm.generate(prompt, params)[0].outputs[0]
        layer = next(w for w in runner.weights.layers if w.router is not None)
        experts = runner.tp.experts_fn if runner.tp is not None else None
        jaxpr = ""
        if experts is not None:
            x = np.zeros((16, 64), np.float32)
            ids, w = np.zeros((16, 2), np.int32), np.ones((16, 2), np.float32)
            jaxpr = str(jax.make_jaxpr(lambda *a: experts(*a, act=jax.nn.silu))(
                x, ids, w, layer.experts_gate, layer.experts_up, layer.experts_down))
        print(json.dumps({
            "family": family, "tp": tp, "ep": ep, "tokens": out.token_ids,
            "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
            "expert_shard": list(layer.experts_gate.addressable_shards[0].data.shape),
            "all_to_all": jaxpr.count("all_to_all"), "psum": jaxpr.count("psum"),
        }), flush=True)

    # 3 devices: 16 tokens do not split evenly, and 3 of them are a bucket's padding.
    from jaxserve.models import moe
    from jaxserve.runner.parallel.expert_parallel import sharded_experts
    from jaxserve.runner.parallel.sharding import make_mesh
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    ids = rng.integers(0, 6, size=(16, 2)).astype(np.int32)
    ids[13:] = 6  # padding: no expert
    w = rng.random((16, 2)).astype(np.float32)
    gate, up = rng.normal(size=(2, 6, 8, 4)).astype(np.float32)
    down = rng.normal(size=(6, 4, 8)).astype(np.float32)
    experts = sharded_experts(make_mesh(3, devices=jax.devices()[:3]), "tp", True)
    got = experts(x, ids, w, gate, up, down, act=jax.nn.silu)
    want = moe.run_experts(x, ids, w, gate, up, down, act=jax.nn.silu)
    print(json.dumps({"uneven_max_error": float(np.abs(np.asarray(got - want)).max())}))
""")


def test_expert_parallel_gives_the_tokens_of_one_device() -> None:
    """2 and 4 devices, experts split whole (all-to-all) or sliced (all-reduce): the same
    greedy tokens and logprobs as one device, which are Hugging Face's."""
    stdout = run_with_devices(EXPERT_PARALLEL_SCRIPT, 4)
    *runs, uneven = [json.loads(line) for line in stdout.strip().splitlines()]
    assert uneven["uneven_max_error"] < 1e-5
    assert len(runs) == 6
    for run in runs:
        golden = np.load(fixture_dir(run["family"]) / "golden.npz")
        assert run["tokens"] == golden["long_greedy_ids"].tolist(), run
        one_device = runs[0] if run["family"] == "qwen3_moe" else None
        if one_device is not None:
            np.testing.assert_allclose(run["logprobs"], one_device["logprobs"], atol=1e-5)
    shards = [(r["family"], r["tp"], r["ep"], r["expert_shard"]) for r in runs]
    assert shards == [
        ("qwen3_moe", 1, False, [8, 64, 16]),
        ("qwen3_moe", 2, True, [4, 64, 16]),  # whole experts per device
        ("qwen3_moe", 4, True, [2, 64, 16]),
        ("qwen3_moe", 2, False, [8, 64, 8]),  # a slice of every expert
        ("mixtral", 4, True, [1, 64, 32]),
        ("qwen2_moe", 2, True, [2, 64, 16]),  # and a shared expert, split like a dense MLP
    ]
    assert [r["all_to_all"] > 0 for r in runs] == [False, True, True, False, True, True]
    assert runs[3]["psum"] > 0


def test_startup_log_names_the_experts_and_how_they_are_split() -> None:
    from jaxserve.runner.devices import describe_experts

    qwen2 = load_model_config(fixture_dir("qwen2_moe"))
    one = EngineConfig(model=str(fixture_dir("qwen2_moe")))
    assert describe_experts(qwen2, one) == (
        "Experts: 4, 2 per token (jax.lax.ragged_dot), a shared expert"
    )
    ep = EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    qwen3 = load_model_config(builtin_config_dir("qwen3-30b-a3b"))
    assert describe_experts(qwen3, ep) == (
        "Experts: 128, 8 per token (jax.lax.ragged_dot), expert parallel over 4"
    )
    assert describe_experts(load_model_config(fixture_dir("llama")), one) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_quantized_checkpoint_of_experts_fails_at_start_naming_both(tmp_path, family) -> None:
    """A quantization_config other than fp8 on a mixture of experts is refused when the
    config is read: its expert tensors would be read as raw values without their scales
    (fp8 checkpoints' experts are read: tests/test_moe_fp8.py)."""
    model = tmp_path / family
    model.mkdir()
    raw = json.loads((fixture_dir(family) / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"quant_method='awq'.*not supported for {family}"):
        load_model_config(model)
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (model / "config.json").write_text(json.dumps(raw))
    assert load_model_config(model).moe is not None
