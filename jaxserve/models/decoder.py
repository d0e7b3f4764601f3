"""The decoder families (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3, and the
mixtures of experts Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS and DeepSeek-V3) as pure functions.

``forward(weights, kv_cache, batch, config) -> (kv_cache, hidden)`` runs one ragged batch of
prefill chunks and decode tokens over the paged KV cache; ``compute_logits`` turns selected
hidden rows into logits. Config switches cover the families: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3, Gemma 3), every RoPE scaling (``rope.py``), tied embeddings, sliding windows
for all layers (Mistral, Phi-3) or per layer (Gemma's local and global layers, with a rope base
per layer type in Gemma 3), attention and final logit soft-capping and the attention scale
(Gemma 2), Gemma's (1 + weight) RMSNorm, scaled embeddings, norms after attention and MLP and
GeGLU. Phi-3's fused qkv and gate_up tensors are split at loading (``families/phi.py``). A layer
with experts runs ``moe.moe_block`` in place of its dense MLP. GPT-OSS adds attention sinks
(a logit per head in the softmax's denominator, passed to the attention op) and an output
projection bias. DeepSeek-V3's layers run multi-head latent attention (``mla.py``) over a cache
of latents, with dense MLPs first and experts after.

Einsum letters: T tokens, H hidden, N query heads, K kv heads, D head dim, I intermediate,
V vocab. The weights' types and RMSNorm are ``layers.py``'s.

``forward_with_aux`` also returns the residual stream entering the layers it is asked for (an
EAGLE-3 head's input, ``eagle3.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models import lora as lora_ops
from jaxserve.models import mla, moe, rope
from jaxserve.models.batch import Batch, KVCache
from jaxserve.models.layers import (
    LayerWeights,
    Weights,
    rms_norm,
    rms_rows,
    rms_scale,
    scaled_rows,
)
from jaxserve.models.quant import linear
from pallas_kernels.kv_cache import write_kv
from pallas_kernels.qk_norm_rope import dispatch as qk_dispatch
from pallas_kernels.qk_norm_rope import triton as qk_triton
from pallas_kernels.ragged_paged_attention import dispatch
from pallas_kernels.swiglu_matmul import dispatch as swiglu_dispatch

AttentionFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class WholePromptAttention:
    """Passed as ``attention_fn``: a step whose sequences are whole prompts, attended from the
    step's own keys and values. Nothing is written to the KV cache or read from it (its pages
    pass through): a pooling runner's steps when no prompt is chunked and no prefix is cached
    (``runner/pooling_attention.py``). ``attend(q [T, N, D], k [T, K, D], v, cu_q_lens,
    sm_scale) -> [T, N, D]`` attends causally within each sequence."""

    attend: Callable[..., jax.Array]


# What a model step attends with: an op over the paged cache, or whole prompts without it.
StepAttention = AttentionFn | WholePromptAttention


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


def qkv_projections(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    config: ModelConfig,
    lora: lora_ops.LayerLora | None = None,
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [T, N, D], [T, K, D], [T, K, D]
    """q, k and v (one GEMM when fused), each token's adapter term added."""
    if lw.fused is not None:  # one GEMM for q, k and v
        qkv = linear(x, lw.fused.wqkv, "TH,HXD->TXD", row_tile=row_tile)
        n, kv = config.num_q_heads, config.num_kv_heads
        q, k, v = qkv[:, :n], qkv[:, n : n + kv], qkv[:, n + kv :]
    else:
        assert lw.wq is not None and lw.wk is not None and lw.wv is not None
        q = linear(x, lw.wq, "TH,HND->TND", row_tile=row_tile)
        k = linear(x, lw.wk, "TH,HKD->TKD", row_tile=row_tile)
        v = linear(x, lw.wv, "TH,HKD->TKD", row_tile=row_tile)
    if lora is not None:
        dq, dk, dv = lora_ops.qkv_deltas(x, lora, q.shape[1:], k.shape[1:])
        q, k, v = q + dq, k + dk, v + dv
    return q, k, v


def attention_block(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    k_pages: jax.Array,  # [P, page_size, K, D]
    v_pages: jax.Array,
    batch: Batch,
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],  # (cos, sin), each [T, 1, D] in x's dtype
    attention_fn: StepAttention,
    sliding_window: int | None,
    kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
    lora: lora_ops.LayerLora | None = None,  # the layer's adapter slots (--enable-lora)
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    on_kernel = _kernel_normed_qkv(lw, x, config, rotary, lora, row_tile)
    if on_kernel is not None:
        q, k, v = on_kernel
    else:
        q, k, v = _normed_qkv(lw, x, config, rotary, lora, row_tile)
    if isinstance(attention_fn, WholePromptAttention):  # no cache: the pages pass through
        out = attention_fn.attend(q, k, v, batch.cu_q_lens, sm_scale=config.sm_scale)
        return _output_projection(lw, out, lora, row_tile), k_pages, v_pages
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
    return _output_projection(lw, out, lora, row_tile), k_pages, v_pages


def _normed_qkv(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],
    lora: lora_ops.LayerLora | None,
    row_tile: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v, each with its bias; q and k normed (Qwen3, Gemma 3) and turned."""
    q, k, v = qkv_projections(lw, x, config, lora, row_tile)
    if lw.bq is not None:  # q/k/v biases (Qwen2): the config has all three or none
        q = q + lw.bq
    if lw.bk is not None:
        k = k + lw.bk
    if lw.bv is not None:
        v = v + lw.bv
    if lw.q_norm is not None and lw.k_norm is not None and row_tile is None:
        eps, gemma = config.rms_norm_eps, config.is_gemma  # per-head RMSNorm (Qwen3, Gemma 3)
        q = normed_rotary(q, lw.q_norm, eps, gemma, rotary)
        k = normed_rotary(k, lw.k_norm, eps, gemma, rotary)
    else:
        if lw.q_norm is not None:  # batch-invariant mode's row tiles
            q = rms_norm(q, lw.q_norm, config.rms_norm_eps, config.is_gemma, row_tile)
        if lw.k_norm is not None:
            k = rms_norm(k, lw.k_norm, config.rms_norm_eps, config.is_gemma, row_tile)
        q = rope.apply_rotary(q, *rotary)
        k = rope.apply_rotary(k, *rotary)
    return q, k, v


def _kernel_normed_qkv(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],  # (cos, sin), each [T, 1, D]
    lora: lora_ops.LayerLora | None,
    row_tile: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """``_normed_qkv`` with q's and k's per-head norm and rotation each in one pass over the
    fused q/k/v product (``pallas_kernels/qk_norm_rope``), where ``JAXSERVE_QK_NORM_ROPE`` asks
    for it and the step fits; None elsewhere (no fused product, biases, adapters, batch-invariant
    row tiles, no per-head norms)."""
    if lw.fused is None or lw.q_norm is None or lw.k_norm is None or lw.bq is not None:
        return None
    if lora is not None or row_tile is not None:
        return None
    n, kv = config.num_q_heads, config.num_kv_heads
    shape = jax.ShapeDtypeStruct((x.shape[0], n + 2 * kv, config.head_dim), x.dtype)
    mode = qk_dispatch.takes(shape, 0, n)
    if mode is None or qk_dispatch.takes(shape, n, kv) is None:
        return None
    qkv = linear(x, lw.fused.wqkv, "TH,HXD->TXD")
    cos, sin = rotary[0][:, 0], rotary[1][:, 0]  # [T, D]
    norm = functools.partial(
        qk_triton.normed_rope,
        eps=config.rms_norm_eps,
        unit_offset=config.is_gemma,
        interpret=mode == "interpret",
    )
    q = norm(qkv, lw.q_norm, cos, sin, first=0, heads=n)
    k = norm(qkv, lw.k_norm, cos, sin, first=n, heads=kv)
    return q, k, qkv[:, n + kv :]


def normed_rotary(
    x: jax.Array,  # [T, heads, D]
    weight: jax.Array,  # [D]  the per-head norm's
    eps: float,
    unit_offset: bool,  # Gemma's 1 + weight
    rotary: tuple[jax.Array, jax.Array],  # (cos, sin), each [T, 1, D]
) -> jax.Array:  # [T, heads, D]
    """``rope.apply_rotary(rms_norm(x, weight, ...), *rotary)``, the same values, written so
    that each half of a head is normed as it turns, with the head's 1 / rms reduced apart.

    NOTE: the composition was two passes over q (and k) on the GPU: XLA's normalization fusion
    wrote the normed heads, then the rotation read them. Here the norm is one reduction and the
    rotation's pass, which reads x and writes the result: at a Qwen3-0.6B step of 16,384 tokens
    99 MB a layer fewer read and written (a deviceless H100 compile); at decode the kernels are
    as many as before."""
    scale = rms_scale(x, eps)
    half = x.shape[-1] // 2
    x1 = scaled_rows(x[..., :half], scale, weight[:half], unit_offset)
    x2 = scaled_rows(x[..., half:], scale, weight[half:], unit_offset)
    return rope.rotate_halves(x1, x2, *rotary)


def _output_projection(
    lw: LayerWeights,
    out: jax.Array,  # [T, N, D]  the attention's output
    lora: lora_ops.LayerLora | None,
    row_tile: int | None,
) -> jax.Array:  # [T, H]
    delta = None if lora is None else lora_ops.o_delta(out, lora)
    out = linear(out, lw.wo, "TND,NDH->TH", row_tile=row_tile)
    if delta is not None:
        out = out + delta
    if lw.bo is not None:
        out = out + lw.bo
    return out


def mlp_block(
    lw: LayerWeights,
    x: jax.Array,
    act: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    lora: lora_ops.LayerLora | None = None,  # the layer's adapter slots (--enable-lora)
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> jax.Array:  # [T, H] -> [T, H]
    assert lw.w_down is not None
    fused = lw.fused.w_gate_up if lw.fused is not None else None
    if isinstance(fused, jax.Array) and lora is None and row_tile is None and act is jax.nn.silu:
        mode = swiglu_dispatch.takes(x, fused)
        if mode is not None:  # SwiGLU in the GEMM's epilogue (JAXSERVE_SWIGLU_MATMUL)
            h = swiglu_dispatch.swiglu_matmul(x, fused, mode)
            return linear(h, lw.w_down, "TI,IH->TH")
    if fused is not None:  # one GEMM for gate and up
        gate_up = linear(x, fused, "TH,HI->TI", row_tile=row_tile)
        gate, up = jnp.split(gate_up, 2, axis=1)
    else:
        assert lw.w_gate is not None and lw.w_up is not None
        gate = linear(x, lw.w_gate, "TH,HI->TI", row_tile=row_tile)
        up = linear(x, lw.w_up, "TH,HI->TI", row_tile=row_tile)
    if lora is None:
        return linear(act(gate) * up, lw.w_down, "TI,IH->TH", row_tile=row_tile)
    d_gate, d_up = lora_ops.gate_up_deltas(x, lora)
    h = act(gate + d_gate) * (up + d_up)
    return linear(h, lw.w_down, "TI,IH->TH") + lora_ops.down_delta(h, lora)


def layer_attention(
    lw: LayerWeights,
    h: jax.Array,  # [T, H]  normed
    pages: tuple[jax.Array, jax.Array],  # the layer's two page arrays
    batch: Batch,
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],
    attention_fn: StepAttention,
    layer: int,
    kv_scale: tuple[float, float] | None,
    lora: lora_ops.LayerLora | None = None,
    row_tile: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (out [T, H], *pages)
    """Layer ``layer``'s attention: latent attention for a config with MLA, else the
    family's (windowed where the layer slides)."""
    k_pages, v_pages = pages
    if config.mla is not None:  # DeepSeek-V3: the pages hold the latent and k_pe
        if isinstance(attention_fn, WholePromptAttention):
            raise ValueError("latent attention reads its cache: it has no whole-prompt form")
        return mla.mla_attention_block(
            lw, h, k_pages, v_pages, batch, config, rotary, kv_scale, attention_fn
        )
    return attention_block(
        lw,
        h,
        k_pages,
        v_pages,
        batch,
        config,
        rotary,
        attention_fn,
        config.layer_window(layer),
        kv_scale,
        lora,
        row_tile,
    )


def layer_mlp(
    lw: LayerWeights,
    h: jax.Array,  # [T, H]  normed
    config: ModelConfig,
    act: Callable[[jax.Array], jax.Array],
    experts_fn: moe.ExpertsFn | None,
    batch: Batch,
    lora: lora_ops.LayerLora | None = None,
    row_tile: int | None = None,
) -> jax.Array:  # [T, H]
    """The layer's experts where it has them (no adapter reaches them), else its dense MLP."""
    experts = lw.moe_weights()
    if experts is not None and config.moe is not None:
        return moe.moe_block(h, experts, config.moe, act, experts_fn, batch.cu_q_lens[-1])
    return mlp_block(lw, h, act, lora, row_tile)


def check_row_tile(config: ModelConfig, row_tile: int | None) -> None:
    """Batch-invariant GEMMs cover the dense decoders: a mixture of experts groups a step's
    rows by expert (its GEMMs' shapes follow the routing) and latent attention (DeepSeek) has
    GEMMs of its own, neither tiled."""
    if row_tile is None:
        return
    if row_tile < 1:
        raise ValueError(f"{row_tile=} must be >= 1")
    if config.moe is not None or config.mla is not None:
        kind = "a mixture of experts" if config.moe is not None else "multi-head latent attention"
        raise ValueError(
            f"batch_invariant: {config.model_type} has {kind}, which batch-invariant mode does "
            "not cover (only dense decoders); serve it without --batch-invariant"
        )


def forward(
    weights: Weights,
    kv_cache: KVCache,
    batch: Batch,
    config: ModelConfig,
    attention_fn: StepAttention | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    experts_fn: moe.ExpertsFn | None = None,
    lora: lora_ops.LoraInputs | None = None,
    row_tile: int | None = None,
) -> tuple[KVCache, jax.Array]:  # (kv_cache, hidden[T, H])
    """One step over a ragged batch; returns the updated cache and final-normed hidden states.

    ``kv_scales``: each layer's (k_scale, v_scale) of an fp8 cache (``models/kv_scales.py``).
    ``experts_fn``: how a layer with experts runs them (``moe.run_experts``, or its sharded
    form under tensor or expert parallelism). ``lora``: the adapter slots and each token's
    slot (``models/lora.py``); None traces no LoRA code at all.
    ``row_tile``: batch-invariant mode's GEMM rows (``quant.linear``); None: plain GEMMs.
    """
    new_cache, hidden, _ = forward_with_aux(
        weights, kv_cache, batch, config, (), attention_fn, kv_scales, experts_fn, lora, row_tile
    )
    return new_cache, hidden


def check_aux_layers(config: ModelConfig, aux_layers: Sequence[int]) -> None:
    """Each id names a layer whose input ``forward_with_aux`` can return: 0 <= id < layers."""
    outside = [i for i in aux_layers if not 0 <= i < config.num_layers]
    if outside:
        raise ValueError(
            f"aux_layers {list(outside)} outside [0, num_layers={config.num_layers}): id j is "
            "the residual stream entering layer j"
        )


def forward_with_aux(
    weights: Weights,
    kv_cache: KVCache,
    batch: Batch,
    config: ModelConfig,
    aux_layers: Sequence[int],
    attention_fn: StepAttention | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    experts_fn: moe.ExpertsFn | None = None,
    lora: lora_ops.LoraInputs | None = None,
    row_tile: int | None = None,
) -> tuple[KVCache, jax.Array, tuple[jax.Array, ...]]:  # (kv_cache, hidden[T, H], aux)
    """``forward``, and the residual stream entering each layer of ``aux_layers`` (id j: the
    output of layer j - 1, id 0 the embedding; vLLM's numbering for EAGLE-3's aux hidden
    states), one [T, H] array per id in the order given (``models/eagle3.py`` reads them)."""
    check_row_tile(config, row_tile)
    check_aux_layers(config, aux_layers)
    attention_fn = attention_fn or dispatch.ragged_paged_attention
    x = weights.embed[batch.input_ids]  # [T, H]
    route = None if lora is None else lora.routing(x.dtype)  # tokens -> slots
    if config.is_gemma:  # the normalizer is rounded to the activations' dtype, as in Hugging Face
        x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
    rotaries: dict[tuple[float, RopeScaling | None], tuple[jax.Array, jax.Array]] = {}
    new_cache: KVCache = []
    entering: dict[int, jax.Array] = {}  # layer -> its input [T, H]
    # NOTE: a Python loop over per-layer weights (unrolled under jit), not lax.scan over stacked
    # weights: on the H200 the scanned decode GEMMs ran at 32% of the bandwidth floor, unrolled
    # at 88% (BENCHMARKS.md).
    for layer, (lw, pages) in enumerate(zip(weights.layers, kv_cache, strict=True)):
        if layer in aux_layers:
            entering[layer] = x
        layer_rope = config.layer_rope(layer)
        if layer_rope not in rotaries:
            freqs, scale = rope.rotary_angles(batch.positions, config.head_dim, *layer_rope)
            rotaries[layer_rope] = rope.cos_sin(freqs, scale, x.dtype)
        kv_scale = None if kv_scales is None else kv_scales[layer]
        lora_layer = None
        if lora is not None and route is not None:
            lora_layer = lora_ops.LayerLora(lora.weights.layers[layer], route)
        x, pages = decoder_layer(
            lw,
            x,
            pages,
            batch,
            config,
            rotaries[layer_rope],
            attention_fn,
            layer,
            kv_scale,
            experts_fn,
            lora_layer,
            row_tile,
        )
        new_cache.append(pages)
    hidden = rms_norm(x, weights.final_norm, config.rms_norm_eps, config.is_gemma, row_tile)
    return new_cache, hidden, tuple(entering[i] for i in aux_layers)


def decoder_layer(
    lw: LayerWeights,
    x: jax.Array,  # [T, H]  the residual stream
    pages: tuple[jax.Array, jax.Array],  # the layer's two page arrays
    batch: Batch,
    config: ModelConfig,
    rotary: tuple[jax.Array, jax.Array],
    attention_fn: StepAttention,
    layer: int,
    kv_scale: tuple[float, float] | None,
    experts_fn: moe.ExpertsFn | None,
    lora: lora_ops.LayerLora | None,
    row_tile: int | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:  # (x, pages)
    """Layer ``layer``: normed attention then normed MLP, each added to the residual stream."""
    eps, gemma = config.rms_norm_eps, config.is_gemma
    act = _ACTIVATIONS[config.hidden_act]
    h, attn_lora = _normed_input(x, lw.attn_norm, config, lora, row_tile)
    attn, k_pages, v_pages = layer_attention(
        lw, h, pages, batch, config, rotary, attention_fn, layer, kv_scale, attn_lora, row_tile
    )
    if lw.post_attn_norm is not None:  # Gemma: a norm after attention too
        attn = rms_norm(attn, lw.post_attn_norm, eps, gemma, row_tile)
    x = x + attn
    h, mlp_lora = _normed_input(x, lw.mlp_norm, config, lora, row_tile)
    mlp = layer_mlp(lw, h, config, act, experts_fn, batch, mlp_lora, row_tile)
    if lw.post_mlp_norm is not None:
        mlp = rms_norm(mlp, lw.post_mlp_norm, eps, gemma, row_tile)
    return x + mlp, (k_pages, v_pages)


def _normed_input(
    x: jax.Array,  # [T, H]  the residual stream
    weight: jax.Array,  # [H]  the norm's
    config: ModelConfig,
    lora: lora_ops.LayerLora | None,
    row_tile: int | None,
) -> tuple[jax.Array, lora_ops.LayerLora | None]:
    """The norm's output, and the layer's adapter slots reading it as the norm's unscaled rows
    and weight (``LayerLora.normed``): at decode XLA fuses the weight into the base GEMM and
    the LoRA kernel applies it as it reads, so the normed rows are not written for it (two
    passes a layer; not for Gemma's float32 ``1 + weight``, nor batch-invariant row tiles)."""
    eps, gemma = config.rms_norm_eps, config.is_gemma
    if lora is None or gemma or row_tile is not None:
        return rms_norm(x, weight, eps, gemma, row_tile), lora
    rows = rms_rows(x, eps)
    return weight * rows, lora_ops.with_normed(lora, rows, weight)


def compute_logits(
    weights: Weights,
    hidden: jax.Array,
    soft_cap: float | None = None,
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> jax.Array:  # [N, H] -> f32[N, V]
    """Logits of the given hidden rows; ``soft_cap`` (Gemma 2): cap * tanh(logits / cap)."""
    if weights.lm_head is None:
        logits = linear(hidden, weights.embed, "NH,VH->NV", jnp.float32, row_tile)
    else:
        logits = linear(hidden, weights.lm_head, "NH,HV->NV", jnp.float32, row_tile)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits
