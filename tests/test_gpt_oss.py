"""GPT-OSS: its config, its checkpoint layout (gate and up interleaved, biases, sinks), the
refusal of MXFP4 checkpoints, attention sinks on the accelerators' dispatch, one server over
HTTP, and tensor and expert parallelism. Prefill, chunked prefill, decode and the long
generation through ``LLM`` against transformers are the family-generic tests of
test_model_parity.py and test_model_families.py (``MOE_FAMILIES`` in conftest)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import jaxserve
from jaxserve.config import builtin_config_dir
from jaxserve.models.families.counting import num_active_params, num_params
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.quant_scheme import QuantizationError
from jaxserve.runner.devices import describe_attention
from jaxserve.runner.parallel.sharding import layer_specs
from pallas_kernels.ragged_paged_attention import dispatch
from tests.conftest import (
    SMALL_ENGINE,
    assert_long_completion_is_golden,
    fixture_dir,
    log_softmax,
    run_with_devices,
    tiny_server,
)

ROOT = Path(__file__).parents[1]


def test_config_has_sinks_biases_layer_types_and_the_clamped_swiglu() -> None:
    config = load_model_config(fixture_dir("gpt_oss"))
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [config.layer_window(i) for i in range(3)] == [16, None, 16]
    assert config.all_layers_window is None  # the full layer keeps every block
    assert config.attention_sinks and config.attention_bias and config.o_proj_bias
    assert config.head_dim == 16 and config.rope_theta == 150000.0
    scaling = config.rope_scaling
    assert scaling is not None and scaling.rope_type == "yarn" and not scaling.truncate
    assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, 64)
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 16)
    assert moe.norm_topk_prob and moe.has_biases and moe.dense_layers == ()
    assert (moe.swiglu_limit, moe.swiglu_alpha) == (1.0, 1.5)


def test_shipped_gpt_oss_20b_config_has_the_published_counts() -> None:
    """openai/gpt-oss-20b: 20.91B parameters, 3.61B active (its model card counts the
    unembedding and not the embedding)."""
    config = load_model_config(builtin_config_dir("gpt-oss-20b"))
    assert config.moe is not None and config.moe.swiglu_limit == 7.0
    assert config.moe.swiglu_alpha == 1.702  # transformers' default: the config has none
    assert config.sliding_window == 128 and config.layer_types[:2] == (
        "sliding_attention",
        "full_attention",
    )
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    assert num_params(config) == 20_914_757_184
    assert num_active_params(config, include_embedding=False) == 3_608_307_264


def test_checkpoint_gate_up_is_interleaved_and_biases_and_sinks_load() -> None:
    config = load_model_config(fixture_dir("gpt_oss"))
    weights = load_weights(fixture_dir("gpt_oss"), config, jnp.float32)
    layer = weights.layers[1]
    prefix = "model.layers.1."
    with safe_open(fixture_dir("gpt_oss") / "model.safetensors", framework="numpy") as f:
        gate_up = f.get_tensor(prefix + "mlp.experts.gate_up_proj")  # [E, H, 2M]
        gate_up_bias = f.get_tensor(prefix + "mlp.experts.gate_up_proj_bias")  # [E, 2M]
        np.testing.assert_array_equal(layer.experts_gate, gate_up[..., 0::2])
        np.testing.assert_array_equal(layer.experts_up, gate_up[..., 1::2])
        np.testing.assert_array_equal(layer.experts_gate_bias, gate_up_bias[:, 0::2])
        np.testing.assert_array_equal(layer.experts_up_bias, gate_up_bias[:, 1::2])
        np.testing.assert_array_equal(
            layer.experts_down, f.get_tensor(prefix + "mlp.experts.down_proj")
        )
        np.testing.assert_array_equal(
            layer.experts_down_bias, f.get_tensor(prefix + "mlp.experts.down_proj_bias")
        )
        np.testing.assert_array_equal(
            np.asarray(layer.router).T, f.get_tensor(prefix + "mlp.router.weight")
        )
        np.testing.assert_array_equal(
            layer.router_logit_bias, f.get_tensor(prefix + "mlp.router.bias")
        )
        np.testing.assert_array_equal(layer.sinks, f.get_tensor(prefix + "self_attn.sinks"))
        np.testing.assert_array_equal(layer.bo, f.get_tensor(prefix + "self_attn.o_proj.bias"))
    assert layer.w_gate is None and layer.q_norm is None


def test_expert_biases_split_with_their_experts_and_sinks_with_the_heads() -> None:
    config = load_model_config(fixture_dir("gpt_oss"))
    tp, ep = layer_specs(config, 0), layer_specs(config, 0, expert_parallel=True)
    assert tuple(tp.experts_gate_bias) == (None, "tp") == tuple(tp.experts_up_bias)
    assert tuple(ep.experts_gate_bias) == ("tp", None)
    assert tuple(tp.experts_down_bias) == (None, None)  # added once, outside the all-reduce
    assert tuple(tp.sinks) == ("tp",)
    assert tuple(tp.router_logit_bias) == (None,)


def test_an_mxfp4_checkpoint_fails_at_start_with_a_clear_message(tmp_path, capsys) -> None:
    model = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(fixture_dir("gpt_oss"), model)
    raw = json.loads((model / "config.json").read_text())
    raw["quantization_config"] = {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
        "quant_method": "mxfp4",
    }
    (model / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match="quant_method='mxfp4'.* is not supported"):
        jaxserve.LLM(str(model), max_model_len=64, num_gpu_blocks_override=16, warmup=False)
    from jaxserve.cli import main

    assert main(["capacity", str(model), "--device-memory", "H200"]) == 2
    assert "mxfp4" in capsys.readouterr().err


def test_attention_sinks_take_the_kernels_on_gpu_and_tpu_and_the_log_says_so(
    monkeypatch,
) -> None:
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: True)
    config = load_model_config("jaxserve/assets/configs/gpt-oss-20b")  # head_dim 64
    for backend, name in (("gpu", "Pallas Mosaic GPU kernel"), ("tpu", "Pallas Mosaic TPU kernel")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        line = describe_attention(config, jnp.bfloat16, block_size=16, tensor_parallel_size=1)
        assert line == f"Attention: {name}"


def test_completion_over_http_is_hugging_faces() -> None:
    """The greedy completion of the long prompt (past the sliding window and yarn's original
    context) and its logprobs are Hugging Face's."""
    with tiny_server("tiny-gpt-oss", family="gpt_oss", **SMALL_ENGINE) as server:
        url = server.url
        assert_long_completion_is_golden(url, "gpt_oss", "tiny-gpt-oss")


PARALLEL_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import jaxserve
    from jaxserve import SamplingParams
    golden = np.load("tests/fixtures/models/gpt_oss/golden.npz")
    for tp, ep in [(2, True), (2, False)]:
        llm = jaxserve.LLM("tests/fixtures/models/gpt_oss", tensor_parallel_size=tp,
                           enable_expert_parallel=ep, max_model_len=128, max_num_seqs=4,
                           max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=64,
                           dtype="float32", warmup=False)
        prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()}
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
        out = llm.generate(prompt, params)[0].outputs[0]
        layer = llm.engine.runner.weights.layers[0]
        print(json.dumps({
            "tp": tp, "ep": ep, "tokens": out.token_ids,
            "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
            "gate_bias_shard": list(layer.experts_gate_bias.addressable_shards[0].data.shape),
            "sinks_shard": list(layer.sinks.addressable_shards[0].data.shape),
        }), flush=True)
""")


def test_tensor_and_expert_parallel_give_hugging_faces_tokens() -> None:
    """2 devices, experts split whole (all-to-all) or sliced (all-reduce), sinks split with
    the heads: Hugging Face's greedy tokens and logprobs."""
    stdout = run_with_devices(PARALLEL_SCRIPT, 2)
    runs = [json.loads(line) for line in stdout.strip().splitlines()]
    golden = np.load(fixture_dir("gpt_oss") / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    ref = log_softmax(golden["long_decode_logits"])[np.arange(len(expected)), expected]
    for run in runs:
        assert run["tokens"] == expected, run
        np.testing.assert_allclose(run["logprobs"], ref, atol=1e-4)
    shards = [(r["tp"], r["ep"], r["gate_bias_shard"], r["sinks_shard"]) for r in runs]
    assert shards == [(2, True, [2, 16], [2]), (2, False, [4, 8], [2])]
