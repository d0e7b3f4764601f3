"""The model's weights as typed pytrees (``LayerWeights`` per layer, ``Weights`` for the model),
the q/k/v and gate/up projections joined for one GEMM each (``fuse_projections``), and RMSNorm:
what the decoder (``decoder.py``), latent attention (``mla.py``), the loader
(``loading/``) and the runner's sharding all share.

What each field is (checkpoint name and layout, shape, dummy init, which configs have it) is its
row in its family's weight table (``families/``).

Einsum letters: H hidden, N query heads, K kv heads, D head dim, I intermediate, V vocab; the
experts' and latent attention's as in ``families/fields.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.models import moe, quant
from jaxserve.models.quant import QArray, tiled_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FusedProjections:
    """A layer's projections that read the same input, joined on their output axis so that
    each is one GEMM: at small batch the separate k and v GEMMs (a quarter of q's size each)
    ran far from the bandwidth floor (``benchmarks/probes/fusion_probe.py``, RESULTS.md)."""

    wqkv: jax.Array | QArray  # [H, N + 2K, D]  wq, wk, wv
    w_gate_up: jax.Array | QArray | None  # [H, 2I]  w_gate, w_up; None on a layer with experts


# NOTE: these are the model code's typed view of the weights. What each field is (checkpoint
# name and layout, shape, dummy init, which configs have it) is its row in its family's table
# (families/), which loading, dummy weights, sharding and parameter counting read;
# tests/test_weight_table.py checks that the rows and these fields agree.
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


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    unit_offset: bool = False,
    row_tile: int | None = None,
) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype before the scale (as Hugging Face does).

    ``unit_offset`` (Gemma): the scale is ``1 + weight`` and applies in float32 before the cast.
    ``row_tile`` (batch-invariant mode): ``row_tile`` rows at a time, as ``quant.linear``.
    """
    if row_tile is not None:
        # NOTE: on the CPU a row's mean of squares, fused into a step of other shape, came out
        # 1 ulp apart between token buckets; one fixed shape reduces every row alike.
        return tiled_rows(lambda tile: rms_norm(tile, weight, eps, unit_offset), x, row_tile)
    return scaled_rows(x, rms_scale(x, eps), weight, unit_offset)


def rms_rows(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm's rows before its weight, cast to x's dtype (``rms_norm`` without
    ``unit_offset`` is ``weight * rms_rows(x, eps)``)."""
    return (x.astype(jnp.float32) * rms_scale(x, eps)).astype(x.dtype)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:  # f32[..., 1]: 1 / rms(x) per row
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def scaled_rows(
    part: jax.Array,  # [..., C]  columns of rows whose 1 / rms is ``scale``
    scale: jax.Array,  # f32[..., 1]  ``rms_scale`` of the whole rows
    weight: jax.Array,  # [C]  the norm's weight for these columns
    unit_offset: bool = False,
) -> jax.Array:  # [..., C]
    """``rms_norm``'s output on some of a row's columns, given the whole row's scale: the same
    products in the same order, so the values are ``rms_norm``'s."""
    part32 = part.astype(jnp.float32) * scale
    if unit_offset:
        return (part32 * (1.0 + weight.astype(jnp.float32))).astype(part.dtype)
    return weight * part32.astype(part.dtype)


# The joined arrays of ``FusedProjections`` and their parts, joined on axis 1 in this order
# (the loader writes the parts in place, ``loading.checkpoint_loader._fused_parts``).
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
    already fused or when they are neither plain arrays nor per-channel 8-bit QArrays
    (``quant.join``: fp8 and int8, quantized on load or per channel in the checkpoint).

    For weights on one device: a tensor-parallel layout splits q and k/v heads over different
    mesh views. Quantized weights were kept apart until 2026-12-06: XLA joined q/k/v's fp8 GEMMs
    itself (their concatenation inside the GEMM's fusion), not gate/up's, one GEMM a layer more
    than bf16 at every step (a deviceless H200 compile).
    """
    qkv = _joined([lw.wq, lw.wk, lw.wv])
    if qkv is None:
        return lw
    gate_up = _joined([lw.w_gate, lw.w_up])
    return dataclasses.replace(
        lw,
        wq=None,
        wk=None,
        wv=None,
        w_gate=None if gate_up is not None else lw.w_gate,
        w_up=None if gate_up is not None else lw.w_up,
        fused=FusedProjections(qkv, gate_up),
    )


def _joined(parts: list) -> jax.Array | QArray | None:
    """``parts`` joined on their first output axis (axis 1 of a plain ``[in, *out]`` array),
    or None where they cannot be."""
    if all(isinstance(p, jax.Array) for p in parts):
        return jnp.concatenate(parts, axis=1)
    if quant.joinable(parts):
        return quant.join(parts)
    return None
