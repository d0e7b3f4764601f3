"""The bodies of the runner's jitted programs: model step, sampler and prompt logprobs.

Pure functions of arrays; ``runner.py`` wraps each in ``jax.jit`` (the only jit sites) with
its static arguments, and warm-up compiles them for every shape bucket. The model step and the
sampler take their per-step inputs packed in one buffer (``packing.py``) with its layout as a
static argument, so each step sends one array to each program.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import decoder
from jaxserve.models.batch import KVCache
from jaxserve.models.layers import Weights
from jaxserve.models.lora import LoraInputs, LoraWeights
from jaxserve.models.quant import INVARIANT_ROW_TILE
from jaxserve.runner import sampling
from jaxserve.runner.packing import Layout, unpack
from jaxserve.runner.sampling import (
    NUM_TOP_LOGPROBS,
    PROMPT_LOGPROBS_CHUNK,
    SamplerFlags,
)
from jaxserve.units import cdiv
from pallas_kernels.ragged_paged_attention import dispatch


def model_step(
    weights: Weights,
    kv_cache: KVCache,
    packed: jax.Array,  # i32[N]: (Batch, source) packed as ``layout`` says
    previous_ids: jax.Array,  # i32[S_max]  the previous step's sampled ids
    layout: Layout,  # static
    *,
    config: ModelConfig,
    attention_fn: decoder.StepAttention | None = None,
    kv_scales: tuple[tuple[float, float], ...] | None = None,  # an fp8 cache's, per layer
    experts_fn: Any = None,  # moe.ExpertsFn: a mixture of experts' sharded experts
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
    lora_weights: LoraWeights | None = None,  # the adapter slots (--enable-lora)
    aux_layers: tuple[int, ...] | None = None,  # an EAGLE-3 drafter's (see below)
) -> tuple[KVCache, jax.Array] | tuple[KVCache, jax.Array, jax.Array]:
    """The model over one step's batch. A pending input token (``source`` >= 0: the step
    before this one was still sampling it when this one was built) is read from that step's
    sampled ids, on the device. With ``lora_weights`` the packed inputs also carry each
    token's adapter slot (``step_programs.pack_step``). With ``aux_layers`` (an EAGLE-3
    drafter reads them) the step also returns the residual stream entering each of those
    layers, joined: [T, len(aux_layers) * H] (``decoder.forward_with_aux``)."""
    batch, source, *token_slots = unpack(packed, layout)
    lora = None
    if lora_weights is not None:
        lora = LoraInputs(lora_weights, token_slots[0])
    input_ids = feed_pending(batch.input_ids, source, previous_ids)
    batch = dataclasses.replace(batch, input_ids=input_ids)
    # NOTE: the step returns only the hidden states; gathering each sequence's last row here
    # (so the sampler would depend on the sequence bucket alone) changed the step's fusions
    # and cost 4-8% of offline throughput on the H200.
    if aux_layers:
        kv_cache, hidden, aux = decoder.forward_with_aux(
            weights,
            kv_cache,
            batch,
            config,
            aux_layers,
            attention_fn,
            kv_scales=kv_scales,
            experts_fn=experts_fn,
            lora=lora,
            row_tile=row_tile,
        )
        return kv_cache, hidden, jnp.concatenate(aux, axis=-1)
    return decoder.forward(
        weights,
        kv_cache,
        batch,
        config,
        attention_fn,
        kv_scales=kv_scales,
        experts_fn=experts_fn,
        row_tile=row_tile,
        lora=lora,
    )


def jitted_model_step(
    model_config: ModelConfig,
    kv_scales: Any,
    tp: Any = None,
    batch_invariant: bool = False,
    lora_shardings: Any = None,
    aux_layers: tuple[int, ...] | None = None,
    whole_prompts: decoder.WholePromptAttention | None = None,
    fp8_weights: bool = False,
) -> Any:
    """``model_step`` jitted, the KV cache donated (updated in place); ``tp``: the runner's
    ``TensorParallel``, whose attention, experts and shardings it takes; ``batch_invariant``:
    each row's result independent of its step (docs/determinism.md): GEMMs in fixed row tiles,
    attention with its reduction pinned. ``lora_shardings`` (LoRA under tensor parallelism:
    the adapter stacks' ``LoraWeights`` of shardings): the step takes the stacks as a sixth
    positional argument (jit takes no keyword argument beside ``in_shardings``).
    ``whole_prompts``: a pooling runner's attention over whole prompts, in place of the paged
    cache's (``pooling_attention.py``). ``fp8_weights``: its GEMMs read fp8 weights, compiled
    under ``compiler_options``' set for them."""
    step = functools.partial(
        model_step,
        config=model_config,
        attention_fn=whole_prompts or step_attention(tp, batch_invariant),
        kv_scales=kv_scales,
        row_tile=invariant_row_tile(batch_invariant),
        aux_layers=aux_layers,
    )
    shardings: dict[str, Any] = {}
    if tp is not None:
        step = functools.partial(step, experts_fn=tp.experts_fn)
        in_shardings, out_shardings = tp.step_shardings()
        if aux_layers:  # the aux states [T, A * H], replicated as the hidden states are
            out_shardings = (*out_shardings, tp.replicated)
        if lora_shardings is not None:
            step = _lora_positional(step)
            in_shardings = (*in_shardings, lora_shardings)
        shardings = dict(in_shardings=in_shardings, out_shardings=out_shardings)
    # static: the layout of the packed inputs
    return jax.jit(
        step,
        static_argnums=(4,),
        donate_argnames=("kv_cache",),
        compiler_options=compiler_options(batch_invariant, fp8_weights, whole_prompts is not None),
        **shardings,
    )


def _lora_positional(step: Any) -> Any:
    """``step`` with the adapter stacks after the layout, positionally."""

    def step_with_lora(weights, kv_cache, packed, previous_ids, layout, lora_weights):
        return step(weights, kv_cache, packed, previous_ids, layout, lora_weights=lora_weights)

    return step_with_lora


def jitted_head_programs(
    model_config: ModelConfig, max_seq_bucket: int, tp: Any = None, batch_invariant: bool = False
) -> Any:
    """(logits, sampler, prompt logprobs) jitted; with ``tp``, the logits replicated, as
    warm-up lowers the samplers (which gather them anyway); ``batch_invariant``: the head's
    GEMM in fixed row tiles, as the model step's."""
    soft_cap = model_config.final_logit_softcap  # Gemma 2's, in both logits programs
    out = {} if tp is None else {"out_shardings": tp.replicated}
    row_tile = invariant_row_tile(batch_invariant)
    logits = functools.partial(logits_step, soft_cap=soft_cap, row_tile=row_tile)
    sample = functools.partial(sample_step, num_rows=max_seq_bucket)
    prompt_lp = functools.partial(prompt_logprobs_step, soft_cap=soft_cap, row_tile=row_tile)
    options = invariant_compiler_options(batch_invariant)
    return (
        jax.jit(logits, static_argnames=("layout", "tied"), compiler_options=options, **out),
        jax.jit(sample, static_argnames=("layout", "flags")),
        jax.jit(prompt_lp, static_argnames=("tied",), compiler_options=options),
    )


# Batch-invariant mode's XLA options on a GPU: every GEMM on cuBLAS, picked by the shape's
# heuristic, not timed. XLA's autotuner times candidate kernels for each program it compiles,
# and each token bucket is a program of its own: two buckets could run the same [128, K] tile
# on kernels of another split of K (other bits) when their timings came out near each other.
# Measured on the H200 (benchmarks/probes/batch_invariant_bits.py, 2026-12-05): untimed Triton
# GEMMs still gave a 2,048-token prompt step other bits in 11 of 45 rows; cuBLAS at autotune
# level 0 kept every bit in all three scenarios.
INVARIANT_GPU_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def invariant_compiler_options(batch_invariant: bool) -> dict[str, Any]:
    """XLA's options for every program in batch-invariant mode (none off the GPU)."""
    if batch_invariant and jax.default_backend() == "gpu":
        return dict(INVARIANT_GPU_OPTIONS)
    return {}


# XLA's options for the programs of fp8 weights on a GPU (issue 36, item 5: an fp8 cold start
# took 146-168 s on the H200 against 77 s in bf16). Compiled without a GPU (a deviceless H200,
# 2026-12-07), the fp8 steps of 16 and 2,048 tokens took 2-3.5 s longer than bf16's: the rest
# was XLA's autotuner timing each GEMM's candidates. Measured on an H100 the same day
# (benchmarks/probes/fp8_compile.py; benchmarks/reports/2026-12-07-session-fifteen): the
# 2,048-token fp8 step compiled in 40.9 s autotuned against 7.7 s untimed (autotune level 0),
# and ran in 30.96 against 30.49 ms; the 16-token step 16.1 against 11.6 s, 4.96 against 4.62
# ms (the autotuner's timer warned of its own accuracy). cuBLAS for every GEMM made the
# 16-token step 3.4x slower. A cold launch to every bucket: bf16 89.2 s, fp8 untimed 107.3 s,
# fp8 autotuned cut off past 170 s. So the fp8 programs take "autotune0".
FP8_XLA_OPTIONS_ENV = "JAXSERVE_FP8_XLA_OPTIONS"
FP8_XLA_OPTION_SETS: dict[str, dict[str, Any]] = {
    "default": {},  # the autotuner times each GEMM's candidates
    "autotune0": {"xla_gpu_autotune_level": 0},  # each GEMM by its shape's heuristic
    "cublas": {"xla_gpu_enable_triton_gemm": False},  # no Triton GEMMs to time
    "cublas-autotune0": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0},
}
FP8_XLA_OPTIONS_DEFAULT = "autotune0"


def fp8_xla_options_name() -> str:
    """The option set the fp8 programs take (``$JAXSERVE_FP8_XLA_OPTIONS``); a ValueError
    names the variable and the sets when it names none of them."""
    return _option_set_name(FP8_XLA_OPTIONS_ENV, FP8_XLA_OPTIONS_DEFAULT)


def _option_set_name(env: str, default: str) -> str:
    """The name of one of ``FP8_XLA_OPTION_SETS`` that ``$env`` gives (``default`` unset)."""
    name = os.environ.get(env, "").strip() or default
    if name not in FP8_XLA_OPTION_SETS:
        raise ValueError(f"{env}={name!r} must be one of {', '.join(FP8_XLA_OPTION_SETS)}")
    return name


def compiler_options(
    batch_invariant: bool, fp8_weights: bool = False, pooling: bool = False, encoder: bool = False
) -> dict[str, Any]:
    """XLA's options for a program with GEMMs: batch-invariant mode's, else, for fp8 weights
    on a GPU, the set ``$JAXSERVE_FP8_XLA_OPTIONS`` names, for a pooling step without cache
    (``pooling``: a decoder's whole prompts, or an ``encoder``'s step) the set
    ``$JAXSERVE_POOLING_XLA_OPTIONS`` names (each has its default), an encoder's with XLA's
    dot merger off (``ENCODER_GPU_XLA_OPTIONS``); none otherwise."""
    if batch_invariant or jax.default_backend() != "gpu":
        return invariant_compiler_options(batch_invariant)
    if fp8_weights:
        return dict(FP8_XLA_OPTION_SETS[fp8_xla_options_name()])
    if pooling:
        options = dict(FP8_XLA_OPTION_SETS[pooling_xla_options_name(encoder)])
        return options | (ENCODER_GPU_XLA_OPTIONS if encoder else {})
    return {}


# XLA's options for the pooling steps on a GPU. With Triton GEMMs among the autotuner's
# candidates, a GEMM that takes a producer or consumer into a Triton fusion and then times
# slower than cuBLAS goes back to cuBLAS with those ops split out: in the 16,384-token Qwen3
# embedding step compiled on an H100, each residual add ran as a pass of its own (cuBLAS's
# beta 0) and one norm's weight as another, where a compile without Triton GEMMs adds the
# residual in the GEMM (beta 1) and norms in one pass. Timed on an H100 (2026-12-07, 10,000
# texts of 256 tokens): Qwen3-0.6B 45.9% of the bf16 peak with XLA's own options, 48.6% with
# cuBLAS's and the per-head norm kernel; BGE-large 44.9% against 44.8% with cuBLAS's (its
# biases then went into the GEMMs through a broadcast pass each), so the encoder keeps XLA's.
POOLING_XLA_OPTIONS_ENV = "JAXSERVE_POOLING_XLA_OPTIONS"
# XLA's dot merger joins GEMMs of one input below a size (32 MB): a BERT layer's q and k
# projections (2 MB each at BGE-large) became one GEMM whose biases could not ride in its
# epilogue, so each was added in a pass of its own (2 x 21.5 us a layer of the H100's
# 16,384-token BGE-large step, 2026-12-07; a deviceless H100 compile with the merger off keeps
# the three GEMMs, each with its bias inside). An encoder's step turns it off.
ENCODER_GPU_XLA_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
POOLING_XLA_OPTIONS_DEFAULT = "cublas"  # a decoder's whole prompts
ENCODER_XLA_OPTIONS_DEFAULT = "default"


def pooling_xla_options_name(encoder: bool = False) -> str:
    """The option set the pooling steps take (``$JAXSERVE_POOLING_XLA_OPTIONS``, one of
    ``FP8_XLA_OPTION_SETS``'s names; unset, ``cublas`` for a decoder, ``default`` for an
    encoder)."""
    default = ENCODER_XLA_OPTIONS_DEFAULT if encoder else POOLING_XLA_OPTIONS_DEFAULT
    return _option_set_name(POOLING_XLA_OPTIONS_ENV, default)


def holds_fp8(tree: Any) -> bool:
    """Whether any array of ``tree`` (a model's or a drafter's weights, or their shapes) is
    fp8: its programs' GEMMs read fp8 weights (``compiler_options``)."""
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    return any(getattr(leaf, "dtype", None) in fp8 for leaf in jax.tree.leaves(tree))


def describe_fp8_compile() -> str:
    """The start-up log line of the fp8 programs' XLA options."""
    name = fp8_xla_options_name()
    what = {
        "default": "XLA's autotuner times each GEMM's candidates",
        "autotune0": "each GEMM by its shape's heuristic, untimed",
        "cublas": "cuBLAS for every GEMM, no Triton GEMMs to time",
        "cublas-autotune0": "cuBLAS for every GEMM, by the heuristic, untimed",
    }[name]
    return f"fp8 programs' compile: {what} ({FP8_XLA_OPTIONS_ENV}={name})"


def invariant_row_tile(batch_invariant: bool) -> int | None:
    """The GEMMs' row tile in batch-invariant mode (``quant.INVARIANT_ROW_TILE``), else None."""
    return INVARIANT_ROW_TILE if batch_invariant else None


def step_attention(tp: Any = None, batch_invariant: bool = False) -> Any:
    """The attention op of a program over the paged cache (the model step's, a drafter's):
    the kernel dispatch on one device, ``tp.attention_fn`` under tensor parallelism, each
    under one jit (``shared_attention``)."""
    attention = dispatch.ragged_paged_attention if tp is None else tp.attention_fn
    if batch_invariant:
        attention = functools.partial(attention, batch_invariant=True)
    return shared_attention(attention)


def shared_attention(attention_fn: Any) -> Any:
    """``attention_fn`` under one ``jax.jit``, so every layer's call shares one lowering.

    Lowering a Mosaic GPU kernel takes about a second of Python; called bare, each of the 32
    layers of an 8B model lowers (and embeds) its own copy in every bucket. Behind one jit the
    layers' calls have the same traced function and JAX lowers it once per bucket.
    """
    return jax.jit(attention_fn, static_argnames=("sm_scale", "sliding_window", "soft_cap"))


def _head_weights(head: jax.Array, tied: bool) -> Weights:
    """Just the output projection, as ``compute_logits`` reads it."""
    return Weights(
        embed=head if tied else None,  # type: ignore[arg-type]
        layers=[],
        final_norm=None,  # type: ignore[arg-type]
        lm_head=None if tied else head,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepSamples:
    """What the sampler program returns: the sampled ids, and the logprobs packed in one
    array (one copy to the host) when the step asked for them."""

    token_ids: jax.Array  # i32[S_max]  padded to the largest sequence bucket
    # i32[S, 2 + 2K]: per row the chosen token's logprob (f32 bits), its rank, K top ids and
    # K top logprobs (f32 bits); None unless the variant computes logprobs.
    logprobs: jax.Array | None


def unpack_logprobs(packed: np.ndarray) -> tuple[np.ndarray, ...]:
    """StepSamples.logprobs on the host -> (logprobs f32[S], ranks i32[S], top_ids i32[S, K],
    top_logprobs f32[S, K])."""
    k = (packed.shape[1] - 2) // 2
    return (
        packed[:, 0].view(np.float32),
        packed[:, 1],
        packed[:, 2 : 2 + k],
        np.ascontiguousarray(packed[:, 2 + k :]).view(np.float32),
    )


@dataclasses.dataclass(frozen=True)
class Forward:
    """A model step's output on the device, and its packed inputs there: the logits program
    reads each sequence's last row from them (``Batch.logits_indices``), so the sampler's
    rows need no second copy to the device."""

    hidden: jax.Array  # [T, H]
    packed: jax.Array  # i32[N]  the step's inputs, as ``model_step`` took them
    layout: Layout
    aux: jax.Array | None = None  # [T, A * H]  the aux layers' states (``model_step``)


def logits_step(
    head: jax.Array,  # [V, H] (tied embedding) or [H, V]
    hidden: jax.Array,  # [T, H]
    packed: jax.Array,  # i32[N]  the model step's inputs (``Forward.packed``)
    layout: Layout,  # static: theirs
    *,
    tied: bool,
    soft_cap: float | None = None,  # the model's final logit soft-capping (Gemma 2)
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> jax.Array:  # f32[S, V]
    """The logits of each sequence's last row, for the sampler.

    NOTE: a program of its own (one per token bucket), not part of each sampler variant: its
    matmul by the head is what XLA's autotuner times, on a copy of the head (1 GiB for
    Llama-3's vocabulary), and that does not fit beside the KV cache (measured on the H200:
    every sampler variant of a new bucket ran out of memory there, even alone). So these few
    compile before the cache, and the twenty sampler variants of each bucket, with no matmul,
    can compile beside it while the engine serves. The logits go through device memory
    between the two either way; the split costs one launch per step.
    """
    batch = unpack(packed, layout)[0]
    rows = hidden[batch.logits_indices]
    return decoder.compute_logits(_head_weights(head, tied), rows, soft_cap, row_tile)


def sample_step(
    logits: jax.Array,  # f32[S, V]  from ``logits_step``
    packed: jax.Array,  # i32[N]: SamplingInputs packed as ``layout`` says
    *,
    layout: Layout,
    flags: SamplerFlags,
    num_rows: int,
) -> StepSamples:
    out = sampling.sample(logits, unpack(packed, layout), flags)
    # Token ids padded to the largest sequence bucket: the next step's on-device feed of
    # pending tokens then has one shape per token bucket, all compiled at warm-up.
    token_ids = jnp.pad(out.token_ids, (0, num_rows - out.token_ids.shape[0]))
    if out.logprobs is None:
        return StepSamples(token_ids, None)
    assert out.ranks is not None and out.top_ids is not None and out.top_logprobs is not None
    as_i32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    packed_lp = jnp.concatenate(
        [as_i32(out.logprobs)[:, None], out.ranks[:, None], out.top_ids, as_i32(out.top_logprobs)],
        axis=1,
    )
    return StepSamples(token_ids, packed_lp)


def pool_step(
    hidden: jax.Array,  # [T, H]
    packed: jax.Array,  # i32[N]  the model step's inputs (``Forward.packed``)
    layout: Layout,  # static: theirs
) -> jax.Array:  # f32[S, 3, H]
    """What pooling needs of each sequence's chunk in the step, in f32: the sum of its tokens'
    hidden states, its first token's and its last token's (the pooling runner's output; the
    host sums the chunks of a prompt and picks, truncates and normalizes: ``models/pooling.py``).
    Rows past the step's sequences hold padding."""
    batch, _ = unpack(packed, layout)
    cu_q_lens = batch.cu_q_lens  # i32[S + 1]
    num_rows = cu_q_lens.shape[0] - 1
    hidden = hidden.astype(jnp.float32)
    # Token t belongs to the row r with cu_q_lens[r] <= t < cu_q_lens[r + 1]; padding tokens
    # fall past the last row, and segment_sum drops them.
    token = jnp.arange(hidden.shape[0], dtype=jnp.int32)
    row = jnp.searchsorted(cu_q_lens[1:], token, side="right")
    sums = jax.ops.segment_sum(hidden, row, num_segments=num_rows)
    first = hidden[jnp.minimum(cu_q_lens[:-1], hidden.shape[0] - 1)]
    last = hidden[batch.logits_indices]
    return jnp.stack([sums, first, last], axis=1)


def feed_pending(
    input_ids: jax.Array,  # i32[T]
    source: jax.Array,  # i32[T]  row of the previous step's samples, or -1
    previous_ids: jax.Array,  # i32[S_max]  the previous step's sampled ids
) -> jax.Array:  # i32[T]
    """Input ids with each pending token (source >= 0) taken from the previous step's samples."""
    taken = previous_ids[jnp.clip(source, 0, previous_ids.shape[0] - 1)]
    return jnp.where(source >= 0, taken, input_ids)


def flat_drafts(ids: jax.Array, size: int) -> jax.Array:  # i32[S, W] -> i32[size]
    """A drafter's drafts laid out as the ids a step takes pending tokens from: row s's draft
    j at s * W + j while that is below ``size`` (the rows past it are padding or left to the
    host: ``StepPrograms.feeds_drafts``), zeros after."""
    flat = ids.reshape(-1).astype(jnp.int32)[:size]
    return jnp.zeros(size, jnp.int32).at[: flat.shape[0]].set(flat)


def prompt_logprobs_step(
    head: jax.Array,
    hidden: jax.Array,  # [T, D]  every position of the step
    next_ids: jax.Array,  # i32[T]  the token that follows each position
    *,
    tied: bool,
    soft_cap: float | None = None,  # the model's final logit soft-capping (Gemma 2)
    row_tile: int | None = None,  # batch-invariant mode's GEMM rows (quant.linear)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs of every position, ``PROMPT_LOGPROBS_CHUNK`` rows at a time."""
    # NOTE: one pass over a 2,048-token step with a 128k vocabulary needs 2.9 GiB of logits
    # and their log-softmax, more than the activation headroom the KV cache leaves; a chunk
    # of 128 rows takes 0.39 GiB on the H200, which capacity.activation_bytes reserves.
    num_tokens = hidden.shape[0]
    chunk = min(num_tokens, PROMPT_LOGPROBS_CHUNK)
    num_chunks = cdiv(num_tokens, chunk)
    padding = num_chunks * chunk - num_tokens
    hidden = jnp.pad(hidden, ((0, padding), (0, 0))).reshape(num_chunks, chunk, -1)
    next_ids = jnp.pad(next_ids, (0, padding)).reshape(num_chunks, chunk)

    def one_chunk(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        head_weights = _head_weights(head, tied)
        logits = decoder.compute_logits(head_weights, args[0], soft_cap, row_tile)  # f32[C, V]
        return sampling.prompt_logprobs(logits, args[1], NUM_TOP_LOGPROBS)

    chosen, ranks, top_ids, top_lp = jax.lax.map(one_chunk, (hidden, next_ids))
    return (
        chosen.reshape(-1)[:num_tokens],
        ranks.reshape(-1)[:num_tokens],
        top_ids.reshape(num_chunks * chunk, -1)[:num_tokens],
        top_lp.reshape(num_chunks * chunk, -1)[:num_tokens],
    )
