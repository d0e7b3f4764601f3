"""The mixture-of-experts layer (jaxserve/models/moe.py) against a dense numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, MoeConfig
from jaxserve.models import moe

H, M, S = 16, 12, 20


def numpy_route(logits: np.ndarray, config: MoeConfig, bias: np.ndarray | None):
    """Hugging Face's routers (Qwen3-MoE / Mixtral softmax, DeepSeek-V3 sigmoid and groups)
    in float64 numpy: (weights [T, k], ids [T, k])."""
    if config.scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    num_tokens, num_experts = scores.shape
    if config.n_group > 1:
        per_group = num_experts // config.n_group
        groups = choice.reshape(num_tokens, config.n_group, per_group)
        group_scores = np.sort(groups, -1)[..., -2:].sum(-1)
        kept = np.argsort(-group_scores, -1)[:, : config.topk_group]
        mask = np.zeros((num_tokens, config.n_group), bool)
        np.put_along_axis(mask, kept, True, -1)
        choice = np.where(np.repeat(mask, per_group, 1), choice, -np.inf)
    ids = np.argsort(-choice, -1, kind="stable")[:, : config.top_k]
    weights = np.take_along_axis(scores, ids, -1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * config.routed_scaling_factor, ids


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def numpy_moe(x: np.ndarray, w: dict[str, np.ndarray], config: MoeConfig) -> np.ndarray:
    """Every token through each of its experts, one token at a time."""
    weights, ids = numpy_route(x @ w["router"], config, w.get("router_bias"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t], strict=True):
            hidden = silu(x[t] @ w["w_gate"][e]) * (x[t] @ w["w_up"][e])
            out[t] += weight * (hidden @ w["w_down"][e])
    if "shared_gate" in w:
        shared = (silu(x @ w["shared_gate"]) * (x @ w["shared_up"])) @ w["shared_down"]
        if "shared_router" in w:
            shared = shared / (1 + np.exp(-(x @ w["shared_router"])))
        out += shared
    return out


def make_weights(config: MoeConfig, seed: int, shared: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e = config.num_experts
    w = {
        "router": rng.normal(0, 1.0, (H, e)),
        "w_gate": rng.normal(0, 0.3, (e, H, M)),
        "w_up": rng.normal(0, 0.3, (e, H, M)),
        "w_down": rng.normal(0, 0.3, (e, M, H)),
    }
    if config.has_correction_bias:
        w["router_bias"] = rng.normal(0, 0.5, (e,))
    if shared:
        w |= {
            "shared_gate": rng.normal(0, 0.3, (H, S)),
            "shared_up": rng.normal(0, 0.3, (H, S)),
            "shared_down": rng.normal(0, 0.3, (S, H)),
            "shared_router": rng.normal(0, 0.3, (H, 1)),
        }
    return w


def to_jax(w: dict[str, np.ndarray]) -> moe.MoeWeights:
    return moe.MoeWeights(**{k: jnp.asarray(v, jnp.float32) for k, v in w.items()})


CONFIGS = {
    "softmax_top2_norm": MoeConfig(8, 2, M, norm_topk_prob=True),  # Mixtral
    "softmax_top2_raw": MoeConfig(8, 2, M, norm_topk_prob=False),  # Qwen3-MoE default
    "softmax_top1": MoeConfig(4, 1, M, norm_topk_prob=False),
    # DeepSeek-V3: sigmoid, 4 groups of 4, 2 kept, biased choice, scaled weights
    "grouped_sigmoid": MoeConfig(
        16,
        3,
        M,
        scoring="sigmoid",
        norm_topk_prob=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        has_correction_bias=True,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_route_matches_the_reference_routers(name: str) -> None:
    config = CONFIGS[name]
    w = make_weights(config, seed=1)
    logits = np.random.default_rng(2).normal(0, 2.0, (37, config.num_experts))
    want_w, want_ids = numpy_route(logits, config, w.get("router_bias"))
    bias = None if "router_bias" not in w else jnp.asarray(w["router_bias"], jnp.float32)
    got_w, got_ids = moe.route(jnp.asarray(logits, jnp.float32), config, bias)
    np.testing.assert_array_equal(np.sort(got_ids, -1), np.sort(want_ids, -1))
    order = np.argsort(got_ids, -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(got_w), order, -1),
        np.take_along_axis(want_w, np.argsort(want_ids, -1), -1),
        rtol=1e-5,
    )


def test_grouped_routing_picks_only_from_the_kept_groups() -> None:
    """The bias moves the choice (experts of the best groups) but not the weights."""
    config = CONFIGS["grouped_sigmoid"]
    logits = np.zeros((1, 16))
    logits[0, [0, 5, 9, 15]] = 3.0  # one strong expert in each group
    logits[0, [1, 4]] = 2.0  # groups 0 and 1 have the best pairs
    bias = jnp.zeros(16).at[15].set(1.0)  # lifts group 3's pair above group 1's
    weights, ids = moe.route(jnp.asarray(logits, jnp.float32), config, bias)
    assert set(np.asarray(ids[0]).tolist()) == {0, 1, 15}
    picked = 1 / (1 + np.exp(-logits[0, np.asarray(ids[0])]))
    np.testing.assert_allclose(weights[0], 2.5 * picked / picked.sum(), rtol=1e-6)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shared", [False, True])
def test_moe_block_matches_a_dense_numpy_moe(name: str, shared: bool) -> None:
    config = CONFIGS[name]
    w = make_weights(config, seed=3, shared=shared)
    x = np.random.default_rng(4).normal(0, 1.0, (24, H))
    got = moe.moe_block(jnp.asarray(x, jnp.float32), to_jax(w), config, jax.nn.silu)
    np.testing.assert_allclose(got, numpy_moe(x, w, config), rtol=2e-4, atol=2e-4)
    ref = moe.reference_moe(jnp.asarray(x, jnp.float32), to_jax(w), config, jax.nn.silu)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_every_token_on_one_expert_and_experts_without_tokens() -> None:
    """A router that sends every token to experts 5 and 2: six experts get nothing."""
    config = MoeConfig(8, 2, M, norm_topk_prob=False)
    w = make_weights(config, seed=5)
    w["router"] = np.zeros((H, 8))
    x = np.abs(np.random.default_rng(6).normal(0, 1.0, (16, H))) + 0.1  # positive features
    w["router"][:, 5] = 3.0
    w["router"][:, 2] = 1.0
    _, ids = numpy_route(x @ w["router"], config, None)
    assert (ids[:, 0] == 5).all() and (ids[:, 1] == 2).all()
    got = moe.moe_block(jnp.asarray(x, jnp.float32), to_jax(w), config, jax.nn.silu)
    np.testing.assert_allclose(got, numpy_moe(x, w, config), rtol=2e-4, atol=2e-4)
    # An expert that gets no token: changing its weights changes nothing.
    w["w_down"][0] = 100.0
    again = moe.moe_block(jnp.asarray(x, jnp.float32), to_jax(w), config, jax.nn.silu)
    np.testing.assert_array_equal(got, again)


def test_padding_tokens_run_no_expert() -> None:
    """Tokens past ``num_valid_tokens`` (a bucket's padding) get no expert and output 0."""
    config = CONFIGS["softmax_top2_norm"]
    w = make_weights(config, seed=9, shared=False)
    x = np.random.default_rng(10).normal(0, 1.0, (16, H))
    got = moe.moe_block(
        jnp.asarray(x, jnp.float32), to_jax(w), config, jax.nn.silu, num_valid_tokens=jnp.int32(5)
    )
    np.testing.assert_allclose(got[:5], numpy_moe(x[:5], w, config), rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(got[5:], 0.0)
    _, ids = moe.route(jnp.asarray(x @ w["router"], jnp.float32), config)
    order, sizes = moe.sort_by_expert(jnp.where(jnp.arange(16)[:, None] < 5, ids, 8), 8)
    assert int(sizes.sum()) == 10  # the padding rows belong to no group
    assert (np.asarray(order[:10]) // 2 < 5).all()


def test_routing_changes_never_recompile() -> None:
    """One compiled program serves every routing: group sizes are data, not shapes."""
    config = CONFIGS["softmax_top2_raw"]
    w = to_jax(make_weights(config, seed=7))
    step = jax.jit(lambda x, w: moe.moe_block(x, w, config, jax.nn.silu))
    rng = np.random.default_rng(8)
    seen = set()
    for i in range(4):
        x = rng.normal(0, 1.0 + 3 * i, (16, H)).astype(np.float32)
        if i == 3:  # every token on one expert
            w = moe.MoeWeights(**(vars(w) | {"router": w.router.at[:, 0].set(50.0)}))
            x = np.abs(x)
        _, ids = moe.route(jnp.einsum("TH,HE->TE", x, w.router), config)
        seen.add(tuple(np.bincount(np.asarray(ids).ravel(), minlength=8).tolist()))
        step(jnp.asarray(x), w).block_until_ready()
    assert len(seen) == 4  # four different routings
    assert step._cache_size() == 1
    # The program holds the grouped matmul, not a loop over experts.
    jaxpr = str(jax.make_jaxpr(lambda x: moe.moe_block(x, w, config, jax.nn.silu))(x))
    assert jaxpr.count("= ragged_dot_general[") == 3 and "while" not in jaxpr


def test_moe_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        MoeConfig(8, 9, M)
    with pytest.raises(ConfigError, match="scoring_func='relu'"):
        MoeConfig(8, 2, M, scoring="relu")
    with pytest.raises(ConfigError, match="n_group=3 must divide num_experts=8"):
        MoeConfig(8, 2, M, n_group=3)
    with pytest.raises(ConfigError, match="topk_group=3 exceeds n_group=2"):
        MoeConfig(8, 2, M, n_group=2, topk_group=3)


GPT_OSS = MoeConfig(8, 2, M, norm_topk_prob=True, has_biases=True, swiglu_limit=0.7)


def numpy_gpt_oss_moe(x: np.ndarray, w: dict[str, np.ndarray], config: MoeConfig) -> np.ndarray:
    """Hugging Face's GptOssMLP in float64: softmax over the top-k biased logits, gate and up
    (with their biases) through the clamped swiglu, down with its bias, weighted and summed."""
    assert config.swiglu_limit is not None
    limit, alpha = config.swiglu_limit, config.swiglu_alpha
    logits = x @ w["router"] + w["router_logit_bias"]
    ids = np.argsort(-logits, -1, kind="stable")[:, : config.top_k]
    top = np.take_along_axis(logits, ids, -1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t], strict=True):
            gate = np.minimum(x[t] @ w["w_gate"][e] + w["gate_bias"][e], limit)
            up = np.clip(x[t] @ w["w_up"][e] + w["up_bias"][e], -limit, limit)
            hidden = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[t] += weight * (hidden @ w["w_down"][e] + w["down_bias"][e])
    return out


def gpt_oss_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e = GPT_OSS.num_experts
    return make_weights(GPT_OSS, seed) | {
        "router_logit_bias": rng.normal(0, 1.0, (e,)),
        "gate_bias": rng.normal(0, 0.5, (e, M)),
        "up_bias": rng.normal(0, 0.5, (e, M)),
        "down_bias": rng.normal(0, 0.5, (e, H)),
    }


def test_clamped_swiglu_caps_the_gate_above_and_up_both_ways() -> None:
    gate = jnp.asarray([10.0, -3.0, 0.5])
    up = jnp.asarray([10.0, -10.0, 0.2])
    got = moe.clamped_swiglu(gate, up, limit=7.0, alpha=1.702)
    g = np.asarray([7.0, -3.0, 0.5])  # the gate is not clamped below
    u = np.asarray([7.0, -7.0, 0.2])
    np.testing.assert_allclose(got, (u + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-6)


def test_gpt_oss_experts_match_hugging_faces_mlp() -> None:
    """Router and expert biases and the clamped swiglu, against a numpy GptOssMLP; some gate
    and up values pass the limit, so the clamps are exercised."""
    w = gpt_oss_weights(seed=11)
    x = np.random.default_rng(12).normal(0, 1.0, (24, H))
    gates = np.einsum("TH,EHM->TEM", x, w["w_gate"]) + w["gate_bias"][None]
    assert (gates > 0.7).any() and (gates < -0.7).any()
    want = numpy_gpt_oss_moe(x, w, GPT_OSS)
    got = moe.moe_block(jnp.asarray(x, jnp.float32), to_jax(w), GPT_OSS, jax.nn.silu)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    ref = moe.reference_moe(jnp.asarray(x, jnp.float32), to_jax(w), GPT_OSS, jax.nn.silu)
    np.testing.assert_allclose(ref, want, rtol=2e-4, atol=2e-4)
    # Without the clamps (a limit far away) the output changes: they were in play.
    loose = moe.moe_block(
        jnp.asarray(x, jnp.float32),
        to_jax(w),
        MoeConfig(8, 2, M, norm_topk_prob=True, has_biases=True, swiglu_limit=1e6),
        jax.nn.silu,
    )
    assert np.abs(np.asarray(loose) - want).max() > 1e-2


def test_gpt_oss_padding_tokens_take_no_expert_bias() -> None:
    """A bucket's padding tokens (expert E) get neither the experts' nor the down bias."""
    w = gpt_oss_weights(seed=13)
    x = np.random.default_rng(14).normal(0, 1.0, (16, H))
    got = moe.moe_block(
        jnp.asarray(x, jnp.float32),
        to_jax(w),
        GPT_OSS,
        jax.nn.silu,
        num_valid_tokens=jnp.int32(5),
    )
    np.testing.assert_allclose(got[:5], numpy_gpt_oss_moe(x[:5], w, GPT_OSS), rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(got[5:], 0.0)


def test_row_bias_follows_the_groups() -> None:
    bias = jnp.arange(4.0)[:, None] * jnp.ones((4, 2))  # expert e's bias is e
    sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)  # expert 1 has no row; 2 rows past the sum
    got = moe.row_bias(bias, sizes, 8)
    np.testing.assert_array_equal(got[:, 0], [0, 0, 2, 2, 2, 3, 0, 0])


def test_swiglu_limit_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="swiglu_limit=0.0 must be positive"):
        MoeConfig(8, 2, M, swiglu_limit=0.0)


def test_grouped_routing_runs_on_the_grouped_matmul_kernel(monkeypatch) -> None:
    """DeepSeek-V3's routing (groups, sigmoid scores steered by e_score_correction_bias,
    scaled weights) feeds the same sorted rows as every router, so its experts take the
    Pallas Triton grouped matmul (interpreted here; the GPU's first choice): three kernel
    calls, no ragged_dot, and the per-token numpy reference's output, shared expert included;
    padding tokens stay out of every group."""
    from pallas_kernels.grouped_matmul import dispatch as gm

    config = CONFIGS["grouped_sigmoid"]
    w = make_weights(config, seed=5, shared=True)
    x = np.random.default_rng(6).normal(0, 1.0, (11, H))
    monkeypatch.setenv(gm.GROUPED_MATMUL_ENV, "triton")

    def layer(x, weights):
        return moe.moe_block(x, weights, config, jax.nn.silu, num_valid_tokens=jnp.int32(9))

    jaxpr = str(jax.make_jaxpr(layer)(jnp.asarray(x, jnp.float32), to_jax(w)))
    assert jaxpr.count("grouped_matmul_triton") == 3 and "ragged_dot" not in jaxpr
    got = np.asarray(layer(jnp.asarray(x, jnp.float32), to_jax(w)))
    want = numpy_moe(x, w, config)
    np.testing.assert_allclose(got[:9], want[:9], rtol=1e-4, atol=1e-4)
