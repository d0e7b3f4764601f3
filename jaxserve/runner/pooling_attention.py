"""How a decoder's pooling runner (``--runner pooling``) attends: over the paged KV cache, as a
generating runner does, or over whole prompts from each step's own keys and values.

A pooling request ends when its prompt has run, so its keys and values matter after its step
only to a later chunk of the same prompt or, through the prefix cache, to a later request.
With prefix caching off and a token budget that holds the longest prompt, neither happens:
the engine schedules each prompt whole (no chunking), and the model step attends causally
within each prompt (``decoder.WholePromptAttention``), writing and reading no cache. On the
H100 (2026-12-05) the cache's write took 1.8 ms and the paged attention 3.2 ms of a 33.9 ms
16,384-token Qwen3-0.6B step. The cache is still allocated: the scheduler counts its blocks.

``JAXSERVE_POOLING_ATTENTION`` chooses: ``auto`` (the default: the paged path until the
whole-prompt one is measured on the GPU), ``paged``, or ``whole``, which is an error where it
cannot apply. Whole prompts run on cuDNN's fused attention over packed sequences
(``segment_attention.packed_segment_attention``) on Hopper and later in bf16 or fp16; elsewhere
on the jnp reference over windows of the flat batch (``windowed_segment_attention``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.decoder import WholePromptAttention
from jaxserve.models.encoder.forward import segment_ids
from jaxserve.runner.buckets import next_power_of_2
from jaxserve.runner.segment_attention import (
    packed_segment_attention,
    segment_attention_form,
    windowed_segment_attention,
)
from pallas_kernels.env_choice import env_choice

POOLING_ATTENTION_ENV = "JAXSERVE_POOLING_ATTENTION"


def causal_prompt_attention(
    q: jax.Array,  # [T, N, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    cu_q_lens: jax.Array,  # i32[S + 1]  each sequence a whole prompt
    *,
    sm_scale: float,  # static
    implementation: str,  # static: "packed", "cudnn" or "xla"
    tile: int,  # static: at least the longest prompt (the windowed forms')
) -> jax.Array:  # [T, N, D]
    """Each token attends to its own prompt's tokens up to itself. Padding rows are left as the
    kernel wrote them: no later op mixes rows, and pooling sums only its sequences' rows
    (``programs.pool_step``), so zeroing them was a pass over the output for nothing."""
    segments = segment_ids(cu_q_lens, q.shape[0])
    if implementation == "packed":
        return packed_segment_attention(
            q, k, v, segments, sm_scale, cu_seq_lens=cu_q_lens, causal=True, zero_padding=False
        )
    return windowed_segment_attention(
        q, k, v, segments, sm_scale, tile=tile, implementation=implementation, causal=True
    )


def why_not_whole(
    model_config: ModelConfig, config: EngineConfig, max_model_len: int, tp: Any
) -> str | None:
    """Why this engine's prompts cannot run whole without the cache, or None."""
    if config.runner != "pooling":
        return "only a pooling runner (--runner pooling) runs prompts without their cache"
    if tp is not None:
        return "it runs on one device (no tensor or data parallelism)"
    if config.batch_invariant:
        return "batch-invariant mode pins the paged kernel's reduction, which it reads"
    if config.enable_prefix_caching:
        return "prefix caching is on, and its blocks would hold no keys: start without it"
    if config.max_num_batched_tokens < max_model_len:
        return (
            f"max_num_batched_tokens={config.max_num_batched_tokens} is less than "
            f"max_model_len={max_model_len}: a prompt must fit one step"
        )
    if model_config.mla is not None:
        return "multi-head latent attention reads its cache of latents"
    windows = {model_config.layer_window(i) for i in range(model_config.num_layers)}
    if any(w is not None and w < max_model_len for w in windows):
        return "the model has sliding-window layers shorter than max_model_len"
    if model_config.attn_logit_softcap is not None or model_config.attention_sinks:
        return "the model caps its attention logits or has attention sinks"
    return None


def whole_prompt_attention(
    model_config: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    dtype: Any,
    tp: Any,
) -> tuple[WholePromptAttention | None, str]:
    """(the whole-prompt attention, or None for the paged path; why, for the start-up log)."""
    choice = env_choice(POOLING_ATTENTION_ENV, ("auto", "paged", "whole"), "auto")
    problem = why_not_whole(model_config, config, max_model_len, tp)
    if choice == "paged":
        return None, f"the paged KV cache ({POOLING_ATTENTION_ENV}=paged)"
    if choice == "auto":
        why = problem or f"ask for whole prompts with {POOLING_ATTENTION_ENV}=whole"
        return None, f"the paged KV cache ({why})"
    if problem is not None:
        raise ValueError(f"{POOLING_ATTENTION_ENV}=whole: {problem}")
    implementation, _ = segment_attention_form(dtype)
    attend = functools.partial(
        causal_prompt_attention,
        implementation=implementation,
        tile=next_power_of_2(max_model_len),
    )
    how = {"packed": "cuDNN, packed sequences", "cudnn": "cuDNN, windows", "xla": "XLA, windows"}
    return (
        WholePromptAttention(jax.jit(attend, static_argnames=("sm_scale",))),
        f"whole prompts, no cache ({how[implementation]}; {POOLING_ATTENTION_ENV}=whole)",
    )
