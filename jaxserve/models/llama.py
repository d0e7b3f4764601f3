"""The decoder families (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3, and the
mixtures of experts Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS and DeepSeek-V3) as pure functions.

``forward(weights, kv_cache, batch, config) -> (kv_cache, hidden)`` runs one ragged batch of
prefill chunks and decode tokens over the paged KV cache; ``compute_logits`` turns selected
hidden rows into logits. Config switches cover the families: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3, Gemma 3), every RoPE scaling (``rope.py``), tied embeddings, sliding windows
for all layers (Mistral, Phi-3) or per layer (Gemma's local and global layers, with a rope base
per layer type in Gemma 3), attention and final logit soft-capping and the attention scale
(Gemma 2), Gemma's (1 + weight) RMSNorm, scaled embeddings, norms after attention and MLP and
GeGLU. Phi-3's fused qkv and gate_up tensors are split at loading (``families.py``). A layer
with experts runs ``moe.moe_block`` in place of its dense MLP. GPT-OSS adds attention sinks
(a logit per head in the softmax's denominator, passed to the attention op) and an output
projection bias. DeepSeek-V3's layers run multi-head latent attention (``mla.py``) over a cache
of latents, with dense MLPs first and experts after.

Einsum letters: T tokens, H hidden, N query heads, K kv heads, D head dim, I intermediate,
V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models import mla, moe, rope
from jaxserve.models.batch import Batch, KVCache
from jaxserve.models.quant import QArray, linear
from pallas_kernels.kv_cache import write_kv
from pallas_kernels.ragged_paged_attention import dispatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FusedProjections:
    """A layer's projections that read the same input, joined on their output axis so that
    each is one GEMM: at small batch the separate k and v GEMMs (a quarter of q's size each)
    ran far from the bandwidth floor (``benchmarks/fusion_probe.py``, RESULTS.md)."""

    wqkv: jax.Array  # [H, N + 2K, D]  wq, wk, wv
    w_gate_up: jax.Array | None  # [H, 2I]  w_gate, w_up; None on a layer with experts


# NOTE: these are the model code's typed view of the weights. What each field is (checkpoint
# name and layout, shape, dummy init, which configs have it) is its row in families.py, which
# loading, dummy weights, sharding and parameter counting read; tests/test_weight_table.py
# checks that the rows and these fields agree.
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array  # [H]
    # The Linear weights may be quantized: a QArray (quant.py) read through quant.linear.
    # wq, wk, wv (and w_gate, w_up) are None once fuse_projections has joined them in ``fused``.
    wq: jax.Array | QArray | None = None  # [H, N, D]  (MLA: [H, N, A]; none with q_lora_rank)
    wk: jax.Array | QArray | None = None  # [H, K, D]  (MLA has none)
    wv: jax.Array | QArray | None = None  # [H, K, D]
    wo: jax.Array | QArray = dataclasses.field(kw_only=True)  # [N, D, H]  (MLA: [N, U, H])
    mlp_norm: jax.Array = dataclasses.field(kw_only=True)  # [H]
    w_gate: jax.Array | QArray | None = None  # [H, I]  None on a layer with experts
    w_up: jax.Array | QArray | None = None  # [H, I]
    w_down: jax.Array | QArray | None = None  # [I, H]
    bq: jax.Array | None = None  # [N, D]  (Qwen2)
    bk: jax.Array | None = None  # [K, D]
    bv: jax.Array | None = None  # [K, D]
    q_norm: jax.Array | None = None  # [D]  (Qwen3, Gemma 3)
    k_norm: jax.Array | None = None  # [D]
    post_attn_norm: jax.Array | None = None  # [H]  (Gemma: norms after attention and MLP)
    post_mlp_norm: jax.Array | None = None  # [H]
    router: jax.Array | None = None  # [H, E]  a layer with experts (Mixtral, Qwen3-MoE)
    experts_gate: jax.Array | None = None  # [E, H, M]
    experts_up: jax.Array | None = None  # [E, H, M]
    experts_down: jax.Array | None = None  # [E, M, H]
    shared_gate: jax.Array | None = None  # [H, S]  a shared expert (Qwen2-MoE)
    shared_up: jax.Array | None = None  # [H, S]
    shared_down: jax.Array | None = None  # [S, H]
    shared_router: jax.Array | None = None  # [H, 1]  its gate
    bo: jax.Array | None = None  # [H]  the output projection's bias (GPT-OSS)
    sinks: jax.Array | None = None  # [N]  attention sink logits (GPT-OSS)
    router_logit_bias: jax.Array | None = None  # [E]  (GPT-OSS)
    experts_gate_bias: jax.Array | None = None  # [E, M]
    experts_up_bias: jax.Array | None = None  # [E, M]
    experts_down_bias: jax.Array | None = None  # [E, H]
    # Multi-head latent attention (DeepSeek-V3, mla.py).
    wq_a: jax.Array | None = None  # [H, Q]  the query's low-rank down projection
    q_a_norm: jax.Array | None = None  # [Q]
    wq_b: jax.Array | None = None  # [Q, N, A]
    wkv_a: jax.Array | None = None  # [H, L]  to the KV latent
    wk_pe: jax.Array | None = None  # [H, R]  to the shared rotary key
    kv_a_norm: jax.Array | None = None  # [L]
    w_kv_b: jax.Array | None = None  # [L, N, B]  latent -> each head's key part and value
    router_bias: jax.Array | None = None  # [E]  e_score_correction_bias (DeepSeek-V3)
    # Not a checkpoint tensor: made at load from the rows above (fuse_projections).
    fused: FusedProjections | None = None

    def moe_weights(self) -> moe.MoeWeights | None:
        """This layer's experts, or None for a dense MLP."""
        if self.router is None:
            return None
        assert self.experts_gate is not None and self.experts_up is not None
        assert self.experts_down is not None
        return moe.MoeWeights(
            self.router,
            self.experts_gate,
            self.experts_up,
            self.experts_down,
            shared_gate=self.shared_gate,
            shared_up=self.shared_up,
            shared_down=self.shared_down,
            shared_router=self.shared_router,
            router_logit_bias=self.router_logit_bias,
            router_bias=self.router_bias,
            gate_bias=self.experts_gate_bias,
            up_bias=self.experts_up_bias,
            down_bias=self.experts_down_bias,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, H]
    layers: list[LayerWeights]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [H, V]; None when tied to the embedding


AttentionFn = Callable[..., jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype before the scale (as Hugging Face does).

    ``unit_offset`` (Gemma): the scale is ``1 + weight`` and applies in float32 before the cast.
    """
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:  # f32[D // 2]
    """The global layers' rotary frequencies (position-independent scalings)."""
    return rope.inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def apply_rope(
    x: jax.Array,  # [T, heads, D]
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2]
) -> jax.Array:  # [T, heads, D]
    """Rotary embedding in the rotate-half layout of Hugging Face checkpoints."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # f32[T, D/2]
    return rope.apply_rotary(x, *rope.cos_sin(freqs, 1.0, x.dtype))


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def attention_block(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    k_pages: jax.Array,  # [P, page_size, K, D]
    v_pages: jax.Array,
    batch: Batch,
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],  # (cos, sin), each [T, 1, D] in x's dtype
    attention_fn: AttentionFn,
    sliding_window: int | None,
    kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    if lw.fused is not None:  # one GEMM for q, k and v
        qkv = linear(x, lw.fused.wqkv, "TH,HXD->TXD")
        n, kv = config.num_q_heads, config.num_kv_heads
        q, k, v = qkv[:, :n], qkv[:, n : n + kv], qkv[:, n + kv :]
    else:
        assert lw.wq is not None and lw.wk is not None and lw.wv is not None
        q = linear(x, lw.wq, "TH,HND->TND")
        k = linear(x, lw.wk, "TH,HKD->TKD")
        v = linear(x, lw.wv, "TH,HKD->TKD")
    if lw.bq is not None:  # q/k/v biases (Qwen2): the config has all three or none
        q = q + lw.bq
    if lw.bk is not None:
        k = k + lw.bk
    if lw.bv is not None:
        v = v + lw.bv
    if lw.q_norm is not None:  # per-head RMSNorm (Qwen3, Gemma 3): both or neither
        q = rms_norm(q, lw.q_norm, config.rms_norm_eps, config.is_gemma)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, config.rms_norm_eps, config.is_gemma)
    q = rope.apply_rotary(q, *rotary)
    k = rope.apply_rotary(k, *rotary)
    # NOTE: the scales reach the attention op as arguments, not static options, so every
    # layer's call still shares one lowering of the kernel (programs.shared_attention).
    scales = {} if kv_scale is None else {"k_scale": kv_scale[0], "v_scale": kv_scale[1]}
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping, **scales)
    sinks = {} if lw.sinks is None else {"sinks": lw.sinks}  # (GPT-OSS)
    out = attention_fn(
        q,
        k_pages,
        v_pages,
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=config.sm_scale,
        sliding_window=sliding_window,
        soft_cap=config.attn_logit_softcap,
        **scales,
        **sinks,
    )  # [T, N, D]
    out = linear(out, lw.wo, "TND,NDH->TH")
    if lw.bo is not None:
        out = out + lw.bo
    return out, k_pages, v_pages


def mlp_block(
    lw: LayerWeights, x: jax.Array, act: Callable[[jax.Array], jax.Array] = jax.nn.silu
) -> jax.Array:  # [T, H] -> [T, H]
    assert lw.w_down is not None
    if lw.fused is not None and lw.fused.w_gate_up is not None:  # one GEMM for gate and up
        gate_up = linear(x, lw.fused.w_gate_up, "TH,HI->TI")
        gate, up = jnp.split(gate_up, 2, axis=1)
    else:
        assert lw.w_gate is not None and lw.w_up is not None
        gate = linear(x, lw.w_gate, "TH,HI->TI")
        up = linear(x, lw.w_up, "TH,HI->TI")
    return linear(act(gate) * up, lw.w_down, "TI,IH->TH")


def forward(
    weights: Weights,
    kv_cache: KVCache,
    batch: Batch,
    config: ModelConfig,
    attention_fn: AttentionFn | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    experts_fn: moe.ExpertsFn | None = None,
) -> tuple[KVCache, jax.Array]:  # (kv_cache, hidden[T, H])
    """One step over a ragged batch; returns the updated cache and final-normed hidden states.

    ``kv_scales``: each layer's (k_scale, v_scale) of an fp8 cache (``models/kv_scales.py``).
    ``experts_fn``: how a layer with experts runs them (``moe.run_experts``, or its sharded
    form under tensor or expert parallelism).
    """
    attention_fn = attention_fn or dispatch.ragged_paged_attention
    eps, gemma = config.rms_norm_eps, config.is_gemma
    act = _ACTIVATIONS[config.hidden_act]
    x = weights.embed[batch.input_ids]  # [T, H]
    if gemma:  # the normalizer is rounded to the activations' dtype, as in Hugging Face
        x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
    rotaries: dict[tuple[float, RopeScaling | None], tuple[jax.Array, jax.Array]] = {}
    new_cache: KVCache = []
    # NOTE: a Python loop over per-layer weights (unrolled under jit), not lax.scan over stacked
    # weights: on the H200 the scanned decode GEMMs ran at 32% of the bandwidth floor, unrolled
    # at 88% (BENCHMARKS.md).
    for layer, (lw, (k_pages, v_pages)) in enumerate(zip(weights.layers, kv_cache, strict=True)):
        layer_rope = config.layer_rope(layer)
        if layer_rope not in rotaries:
            freqs, scale = rope.rotary_angles(batch.positions, config.head_dim, *layer_rope)
            rotaries[layer_rope] = rope.cos_sin(freqs, scale, x.dtype)
        h = rms_norm(x, lw.attn_norm, eps, gemma)
        kv_scale = None if kv_scales is None else kv_scales[layer]
        if config.mla is not None:  # DeepSeek-V3: the pages hold the latent and k_pe
            attn, k_pages, v_pages = mla.mla_attention_block(
                lw, h, k_pages, v_pages, batch, config, rotaries[layer_rope], kv_scale
            )
        else:
            attn, k_pages, v_pages = attention_block(
                lw,
                h,
                k_pages,
                v_pages,
                batch,
                config,
                rotaries[layer_rope],
                attention_fn,
                config.layer_window(layer),
                kv_scale,
            )
        if lw.post_attn_norm is not None:  # Gemma: a norm after attention too
            attn = rms_norm(attn, lw.post_attn_norm, eps, gemma)
        x = x + attn
        h = rms_norm(x, lw.mlp_norm, eps, gemma)
        experts = lw.moe_weights()
        if experts is not None and config.moe is not None:
            mlp = moe.moe_block(h, experts, config.moe, act, experts_fn, batch.cu_q_lens[-1])
        else:
            mlp = mlp_block(lw, h, act)
        if lw.post_mlp_norm is not None:
            mlp = rms_norm(mlp, lw.post_mlp_norm, eps, gemma)
        x = x + mlp
        new_cache.append((k_pages, v_pages))
    return new_cache, rms_norm(x, weights.final_norm, eps, gemma)


def compute_logits(
    weights: Weights, hidden: jax.Array, soft_cap: float | None = None
) -> jax.Array:  # [N, H] -> f32[N, V]
    """Logits of the given hidden rows; ``soft_cap`` (Gemma 2): cap * tanh(logits / cap)."""
    if weights.lm_head is None:
        logits = linear(hidden, weights.embed, "NH,VH->NV", out_dtype=jnp.float32)
    else:
        logits = linear(hidden, weights.lm_head, "NH,HV->NV", out_dtype=jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


# The joined arrays of ``FusedProjections`` and their parts, joined on axis 1 in this order
# (the loader writes the parts in place, ``weights._fused_parts``).
FUSED_FIELDS = (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up")))


def fuse_projections(weights: Weights) -> Weights:
    """``weights`` with each layer's q/k/v (and gate/up) joined (``fuse_layer``); the separate
    arrays are released layer by layer, so the peak is one layer's extra copy."""
    for i, lw in enumerate(weights.layers):
        weights.layers[i] = fuse_layer(lw)
        del lw
    return weights


def fuse_layer(lw: LayerWeights) -> LayerWeights:
    """The layer with q/k/v (and gate/up) joined in ``LayerWeights.fused``; as it is when
    already fused or when they are not plain arrays.

    For unquantized weights on one device: a tensor-parallel layout splits q and k/v heads
    over different mesh views, and quantized weights are QArrays (``quant.linear``).
    """
    if lw.wq is None or not all(isinstance(w, jax.Array) for w in (lw.wq, lw.wk, lw.wv)):
        return lw
    wqkv = jnp.concatenate([lw.wq, lw.wk, lw.wv], axis=1)  # type: ignore[list-item]
    gate_up = None
    if isinstance(lw.w_gate, jax.Array) and isinstance(lw.w_up, jax.Array):
        gate_up = jnp.concatenate([lw.w_gate, lw.w_up], axis=1)
    return dataclasses.replace(
        lw,
        wq=None,
        wk=None,
        wv=None,
        w_gate=None if gate_up is not None else lw.w_gate,
        w_up=None if gate_up is not None else lw.w_up,
        fused=FusedProjections(wqkv, gate_up),
    )
