"""DeepSeek-V3: its config, multi-head latent attention against the plain attention it stands
for, the latent cache's size in capacity planning and in a real engine, and one server over
HTTP with the prefix cache. Prefill, chunked prefill, decode and the long generation through
``LLM`` against transformers are the family-generic tests of test_model_parity.py and
test_model_families.py (``MOE_FAMILIES`` in conftest)."""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

import jaxserve
from jaxserve.bench.capacity import add_capacity_arguments, run_capacity
from jaxserve.config import ConfigError, builtin_config_dir
from jaxserve.models import mla, rope
from jaxserve.models.batch import Batch
from jaxserve.models.families.counting import num_active_params, num_params
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.runner.devices import describe_attention
from jaxserve.runner.parallel.mesh import validate_tensor_parallel_size
from pallas_kernels import kv_cache
from pallas_kernels.mla import reference as mla_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.conftest import (
    SMALL_ENGINE,
    assert_long_completion_is_golden,
    fixture_dir,
    run_with_devices,
    tiny_server,
)

ROOT = Path(__file__).parents[1]

TINY = dict(
    model_type="deepseek_v3",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


def mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0


def test_fixture_config_reads_mla_yarn_and_the_routing() -> None:
    config = load_model_config(fixture_dir("deepseek_v3"))
    assert config.mla is not None and config.moe is not None
    assert (config.mla.q_lora_rank, config.mla.kv_lora_rank) == (24, 32)
    assert (config.mla.qk_nope_head_dim, config.mla.qk_rope_head_dim) == (16, 8)
    assert config.mla.v_head_dim == 12 and config.mla.rope_interleave
    assert config.head_dim == 8 and config.num_kv_heads == 1  # rope dims; one shared latent
    # YaRN: cos/sin times mscale(mscale) / mscale(mscale_all_dim), scores times the latter
    # squared (transformers' yarn_apply_mscale).
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"
    assert config.rope_scaling.attention_factor == pytest.approx(mscale(4, 1.0) / mscale(4, 0.8))
    assert config.sm_scale == pytest.approx(24**-0.5 * mscale(4, 0.8) ** 2)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (8, 2, 4, 2)
    assert moe.scoring == "sigmoid" and moe.norm_topk_prob and moe.has_correction_bias
    assert moe.routed_scaling_factor == 2.5 and moe.shared_intermediate_size == 8
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert config.kv_cache_dims == ((1, 32), (1, 8))  # c_kv and k_pe, not per-head K and V


def test_config_variants_and_errors_name_the_field() -> None:
    plain = model_config_from_dict(TINY | {"q_lora_rank": None, "rope_interleave": False})
    assert plain.mla is not None and plain.mla.q_lora_rank is None
    assert not plain.mla.rope_interleave and plain.sm_scale == pytest.approx(24**-0.5)
    two_shared = model_config_from_dict(TINY | {"n_shared_experts": 2, "first_k_dense_replace": 0})
    assert two_shared.moe is not None and two_shared.moe.shared_intermediate_size == 32
    assert two_shared.moe.dense_layers == ()
    with pytest.raises(ConfigError, match="attention_bias=True is not supported for deepseek_v3"):
        model_config_from_dict(TINY | {"attention_bias": True})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert model_config_from_dict(TINY | {"quantization_config": fp8}).mla is not None
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with pytest.raises(ConfigError, match="quant_method='awq'.* not supported for deepseek_v3"):
        model_config_from_dict(TINY | {"quantization_config": awq})
    with pytest.raises(ConfigError, match="kv_lora_rank=0 must be a positive integer"):
        model_config_from_dict(TINY | {"kv_lora_rank": 0})
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        validate_tensor_parallel_size(model_config_from_dict(TINY), 3)


def test_weights_are_the_checkpoint_tensors() -> None:
    """kv_a_proj_with_mqa splits into the latent's rows and k_pe's; kv_b_proj keeps each
    head's key part then value together; the router bias is read."""
    config = load_model_config(fixture_dir("deepseek_v3"))
    weights = load_weights(fixture_dir("deepseek_v3"), config, jnp.float32)
    layer, prefix = weights.layers[2], "model.layers.2."
    with safe_open(fixture_dir("deepseek_v3") / "model.safetensors", framework="numpy") as f:
        kv_a = f.get_tensor(prefix + "self_attn.kv_a_proj_with_mqa.weight")  # [L + R, H]
        kv_b = f.get_tensor(prefix + "self_attn.kv_b_proj.weight")  # [N * (C + U), L]
        bias = f.get_tensor(prefix + "mlp.gate.e_score_correction_bias")
    assert (np.asarray(layer.wkv_a).T == kv_a[:32]).all()
    assert (np.asarray(layer.wk_pe).T == kv_a[32:]).all()
    head1 = kv_b.reshape(4, 28, 32)[1]  # [C + U, L]
    assert (np.asarray(layer.w_kv_b)[:, 1].T == head1).all()
    assert (np.asarray(layer.router_bias) == bias).all() and np.abs(bias).max() > 0
    assert weights.layers[0].router is None and weights.layers[0].w_gate is not None
    # In bf16 the router and its bias stay float32, as transformers keeps them.
    bf16 = load_weights(fixture_dir("deepseek_v3"), config, jnp.bfloat16).layers[1]
    assert bf16.router.dtype == bf16.router_bias.dtype == jnp.float32
    assert bf16.experts_gate.dtype == bf16.w_kv_b.dtype == jnp.bfloat16
    assert dummy_weights(config, jnp.bfloat16).layers[2].router_bias.dtype == jnp.float32


def random_batch(rng, q_lens, kv_lens, page_size, num_pages):
    """Host arrays of a ragged batch over shuffled pages (the last q_len tokens of each)."""
    pages_per_seq = -(-max(kv_lens) // page_size)
    order = rng.permutation(num_pages)
    page_indices = order[: len(q_lens) * pages_per_seq].reshape(len(q_lens), pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(page_indices, jnp.int32),
        jnp.asarray(cu),
        jnp.asarray([len(q_lens)], jnp.int32),
    )


def test_latent_attention_is_one_head_attention_over_the_joined_latent() -> None:
    """MLA's reference equals the plain reference with one KV head, K = V = [c_kv, k_pe],
    keeping the output's latent columns: prefill chunks and decode rows in one ragged batch."""
    rng = np.random.default_rng(0)
    num_pages, page_size, heads, latent, rope_dim = 16, 4, 4, 32, 8
    q_lens, kv_lens = [5, 1, 3], [9, 7, 3]  # a chunk after 4 cached, a decode, a prefill
    num_tokens = 12  # 3 rows of padding
    q_latent = jnp.asarray(rng.normal(size=(num_tokens, heads, latent)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(num_tokens, heads, rope_dim)), jnp.float32)
    ckv = jnp.asarray(rng.normal(size=(num_pages, page_size, 1, latent)), jnp.float32)
    kpe = jnp.asarray(rng.normal(size=(num_pages, page_size, 1, rope_dim)), jnp.float32)
    batch = random_batch(rng, q_lens, kv_lens, page_size, num_pages)
    got = mla_reference.ragged_paged_mla_attention(q_latent, q_pe, ckv, kpe, *batch, sm_scale=0.3)
    joined = jnp.concatenate([ckv, kpe], axis=-1)
    q = jnp.concatenate([q_latent, q_pe], axis=-1)
    want = ragged_paged_attention(q, joined, joined, *batch, sm_scale=0.3)[..., :latent]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert not np.asarray(got[9:]).any()  # padding rows


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def expanded_attention(lw, x, positions, config):
    """Hugging Face's form on one sequence: K and V of every head expanded from the latent,
    causal softmax over them (numpy, float64)."""
    m = config.mla

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + config.rms_norm_eps) * f64(w)

    x = f64(x)
    if lw.wq_a is not None:
        q = np.einsum("TQ,QNA->TNA", norm(x @ f64(lw.wq_a), lw.q_a_norm), f64(lw.wq_b))
    else:
        q = np.einsum("TH,HNA->TNA", x, f64(lw.wq))
    c_kv = norm(x @ f64(lw.wkv_a), lw.kv_a_norm)  # [T, L]
    k_pe = (x @ f64(lw.wk_pe))[:, None, :]  # [T, 1, R]
    q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]

    def rotate(v):  # HF's interleaved pairs, or halves
        freqs, scale = rope.rotary_angles(
            jnp.asarray(positions), config.head_dim, config.rope_theta, config.rope_scaling
        )
        cos, sin = f64(jnp.cos(freqs)) * scale, f64(jnp.sin(freqs)) * scale  # [T, R / 2]
        cos, sin = cos[:, None], sin[:, None]
        if m.rope_interleave:
            a, b = v[..., 0::2], v[..., 1::2]
        else:
            a, b = np.split(v, 2, axis=-1)
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    kv = np.einsum("TL,LNB->TNB", c_kv, f64(lw.w_kv_b))
    k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
    k_pe = np.broadcast_to(rotate(k_pe), (*k_nope.shape[:2], m.qk_rope_head_dim))
    keys = np.concatenate([k_nope, k_pe], -1)  # [T, N, A]
    queries = np.concatenate([q_nope, rotate(q_pe)], -1)
    scores = np.einsum("TNA,SNA->NTS", queries, keys) * config.sm_scale
    scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("NTS,SNU->TNU", probs, v)
    return np.einsum("TNU,NUH->TH", out, f64(lw.wo))


@pytest.mark.parametrize(
    "variant",
    [{}, {"q_lora_rank": None, "rope_interleave": False}],
    ids=["q_lora_interleaved", "q_proj_halves"],
)
def test_absorbed_attention_equals_the_expanded_form(variant) -> None:
    """The absorbed step over the paged latent cache (a prefill, then a decode) computes the
    attention of per-head keys and values expanded from the latent; with q_lora_rank or a
    plain q_proj, interleaved rotary pairs or halves; positions past the original context."""
    rope_scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                    "mscale": 1.0, "mscale_all_dim": 0.7}  # fmt: skip
    config = model_config_from_dict(TINY | {"rope_scaling": rope_scaling} | variant)
    lw = dummy_weights(config, jnp.float32, seed=1, scale=0.3).layers[0]
    rng = np.random.default_rng(1)
    num_tokens, page_size, num_pages = 11, 4, 6
    x = jnp.asarray(rng.normal(size=(num_tokens, config.hidden_size)), jnp.float32)
    positions = np.arange(num_tokens, dtype=np.int32)
    want = expanded_attention(lw, x, positions, config)
    pages = np.asarray([4, 1, 5], np.int32)
    cache = tuple(jnp.zeros((num_pages, page_size, *dims), jnp.float32)
                  for dims in config.kv_cache_dims)  # fmt: skip
    got = []
    for start, end in ((0, 10), (10, 11)):  # prefill 10, decode 1
        pos = positions[start:end]
        batch = Batch(
            input_ids=jnp.zeros(end - start, jnp.int32),
            positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(pages[pos // page_size] * page_size + pos % page_size),
            kv_lens=jnp.asarray([end], jnp.int32),
            page_indices=jnp.asarray(pages[None]),
            cu_q_lens=jnp.asarray([0, end - start], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
            logits_indices=jnp.asarray([end - start - 1], jnp.int32),
        )
        freqs, scale = rope.rotary_angles(
            batch.positions, config.head_dim, config.rope_theta, config.rope_scaling
        )
        rotary = rope.cos_sin(freqs, scale, jnp.float32)
        out, *cache = mla.mla_attention_block(lw, x[start:end], *cache, batch, config, rotary)
        got.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(got), want, atol=2e-5, rtol=1e-4)
    # The cache holds each token's normalized latent (RMS 1 before the norm's scale).
    latents = np.asarray(cache[0]).reshape(-1, 32)[(pages[:, None] * 4 + np.arange(4)).ravel()]
    assert np.abs(latents[11:]).max() == 0 and np.abs(latents[:11]).min(axis=1).max() > 0


def capacity_json(capsys, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    assert run_capacity(parser.parse_args([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_shipped_deepseek_v3_config_and_its_latent_cache_bytes(capsys) -> None:
    config = load_model_config(builtin_config_dir("deepseek-v3"))
    assert config.mla is not None and config.moe is not None
    # transformers' DeepseekV3ForCausalLM of this config (on the meta device) has 671.0B
    # parameters and e_score_correction_bias entries; 37.6B are read per token.
    assert num_params(config) == 671_026_419_200
    assert num_active_params(config) == 37_552_297_472
    assert config.moe.dense_layers == (0, 1, 2) and config.moe.routed_scaling_factor == 2.5
    assert config.sm_scale == pytest.approx(192**-0.5 * mscale(40, 1.0) ** 2)
    out = capacity_json(
        capsys, str(builtin_config_dir("deepseek-v3")), "--device-memory", "8000GB",
        "--max-model-len", "32K",
    )  # fmt: skip
    # 61 layers x (512 latent + 64 rotary key) x bf16: not 2 x 128 heads x 192 per layer.
    assert out["kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    # The 58 routers and their biases stay float32 (4 bytes, not 2).
    assert out["weight_bytes"] == 671_026_419_200 * 2 + 58 * (7168 + 1) * 256 * 2
    # The reference attention's temporaries follow the step, not the context: each of the
    # step's 2048 rows walks its positions in blocks of 128 (tests/test_capacity_mla.py).
    half = capacity_json(
        capsys, str(builtin_config_dir("deepseek-v3")), "--device-memory", "8000GB",
        "--max-model-len", "16K",
    )  # fmt: skip
    assert out["activation_bytes"] == half["activation_bytes"]
    assert out["mla_temporary_bytes"] == half["mla_temporary_bytes"] > 0


def test_capacity_text_names_the_latent(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    args = [str(builtin_config_dir("deepseek-v3")), "--device-memory", "8000GB"]
    assert run_capacity(parser.parse_args(args)) == 0
    text = capsys.readouterr().out
    assert "Multi-head latent attention: the cache holds a latent of 512 and a rotary key of " \
        "64 per token and layer, shared by its 128 heads" in text  # fmt: skip
    assert "(70,272 bytes per token" in text


def test_capacity_matches_the_engines_latent_cache(capsys) -> None:
    memory = 64 * 1024**2
    llm = jaxserve.LLM(
        str(fixture_dir("deepseek_v3")),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        dtype="float32",
        device_memory_bytes=memory,
        warmup=False,
    )
    out = capacity_json(
        capsys, str(fixture_dir("deepseek_v3")), "--max-model-len", "128", "--device-memory",
        str(memory), "--dtype", "float32", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32",
    )  # fmt: skip
    runner = llm.engine.runner
    assert out["kv_bytes_per_token"] == 3 * (32 + 8) * 4
    assert out["num_blocks"] == runner.num_blocks
    blocks, block_size = runner.num_blocks, out["block_size"]
    for ckv, kpe in runner.kv_cache:
        assert ckv.shape == (blocks, block_size, 1, 32) and kpe.shape == (blocks, block_size, 1, 8)
    cache_bytes = sum(x.nbytes for layer in runner.kv_cache for x in layer)
    assert cache_bytes == out["num_blocks"] * block_size * out["kv_bytes_per_token"]
    line = describe_attention(runner.model_config, jnp.float32, block_size, 1)
    assert line == (
        "Attention: pure-jnp reference (multi-head latent attention: the MLA kernels are for "
        "GPUs and TPUs; this is the cpu backend)"
    )


def test_over_http_with_the_prefix_cache() -> None:
    """The long greedy completion is Hugging Face's, and again when its prompt's blocks come
    from the prefix cache."""
    golden = np.load(fixture_dir("deepseek_v3") / "golden.npz")
    with tiny_server("tiny-dsv3", family="deepseek_v3", **SMALL_ENGINE) as server:
        url = server.url
        assert_long_completion_is_golden(url, "deepseek_v3", "tiny-dsv3")
        body = {
            "model": "tiny-dsv3",
            "prompt": golden["prompt2_ids"].tolist(),
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        tokenizer = AutoTokenizer.from_pretrained(fixture_dir("deepseek_v3"))
        expected = tokenizer.decode(golden["long_greedy_ids"][:4]).rstrip("\ufffd")
        assert answer["choices"][0]["text"] == expected


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import jaxserve
    from jaxserve import SamplingParams
    golden = np.load("tests/fixtures/models/deepseek_v3/golden.npz")
    for tp, ep in [(1, False), (2, False), (4, True)]:
        llm = jaxserve.LLM("tests/fixtures/models/deepseek_v3", tensor_parallel_size=tp,
                           enable_expert_parallel=ep, max_model_len=128, max_num_seqs=4,
                           max_num_batched_tokens=32, block_size=4, num_gpu_blocks_override=64,
                           dtype="float32", warmup=False)
        prompt = {"prompt_token_ids": golden["prompt2_ids"].tolist()}
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        runner = llm.engine.runner
        print(json.dumps({
            "tp": tp, "tokens": out.token_ids,
            "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
            "latent_shard": list(runner.kv_cache[0][0].addressable_shards[0].data.shape),
            "kv_b_shard": list(runner.weights.layers[1].w_kv_b.addressable_shards[0].data.shape),
        }), flush=True)
""")


def test_tensor_parallel_splits_the_heads_and_keeps_the_latent_whole() -> None:
    """2 and 4 virtual CPU devices (experts split whole on 4): each device computes its query
    heads over a full copy of the latent cache (one latent serves every head), and the tokens
    and logprobs are those of one device, which are Hugging Face's."""
    stdout = run_with_devices(TENSOR_PARALLEL_SCRIPT, 4)
    runs = [json.loads(line) for line in stdout.strip().splitlines()]
    golden = np.load(fixture_dir("deepseek_v3") / "golden.npz")
    for run in runs:
        assert run["tokens"] == golden["long_greedy_ids"].tolist(), run
        np.testing.assert_allclose(run["logprobs"], runs[0]["logprobs"], atol=1e-5)
        assert run["latent_shard"] == [64, 4, 1, 32]  # every page, the whole latent
    assert [run["kv_b_shard"] for run in runs] == [[32, 4, 28], [32, 2, 28], [32, 1, 28]]


def test_fp8_latent_cache_stores_scaled_latents_and_reads_them_back() -> None:
    """An fp8 cache holds c_kv / scale and k_pe / scale; attention reads page * scale, the
    same as over a float32 cache of those values; a padding row's write is dropped."""
    rng = np.random.default_rng(2)
    e4m3 = jnp.float8_e4m3fn
    c_kv = jnp.asarray(rng.normal(size=(3, 32)), jnp.float32)
    k_pe = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    slots = jnp.asarray([5, 6, 16], jnp.int32)  # the last is past the 16 slots: padding
    ckv, kpe = kv_cache.write_latent(
        jnp.zeros((4, 4, 1, 32), e4m3), jnp.zeros((4, 4, 1, 8), e4m3), c_kv, k_pe, slots,
        ckv_scale=0.5, kpe_scale=2.0,
    )  # fmt: skip
    stored = np.asarray(ckv, np.float32).reshape(16, 32)
    np.testing.assert_allclose(stored[[5, 6]] * 0.5, c_kv[:2], rtol=0.07, atol=0.01)
    assert not np.delete(stored, [5, 6], axis=0).any()
    np.testing.assert_allclose(np.asarray(kpe, np.float32).reshape(16, 8)[[5, 6]] * 2.0,
                               k_pe[:2], rtol=0.07, atol=0.03)  # fmt: skip
    q_latent = jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32)
    q_pe = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
    batch = (
        jnp.asarray([7], jnp.int32),  # kv_lens: positions 0..6 on page 0 and 1
        jnp.asarray([[0, 1]], jnp.int32),
        jnp.asarray([0, 2], jnp.int32),
        jnp.asarray([1], jnp.int32),
    )
    got = mla_reference.ragged_paged_mla_attention(
        q_latent, q_pe, ckv, kpe, *batch, sm_scale=0.2, ckv_scale=0.5, kpe_scale=2.0
    )
    plain = (np.asarray(ckv, np.float32) * 0.5, np.asarray(kpe, np.float32) * 2.0)
    want = mla_reference.ragged_paged_mla_attention(
        q_latent, q_pe, *map(jnp.asarray, plain), *batch, sm_scale=0.2
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
