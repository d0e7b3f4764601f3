"""Ragged paged attention: one entry point, chosen by backend.

``ragged_paged_attention`` has the reference's signature and picks, at trace time, by
``jax.default_backend()``:
  gpu -> the Mosaic GPU kernel (``mosaic_gpu``) on Hopper or newer, for the shapes and dtypes it
         takes (bf16 or fp16 queries over a cache of their dtype, head_dim 64/96/128/256, or over
         an fp8 cache at head_dim 64/128; GQA ratio 1-8, power-of-two page size >= 8); otherwise
         (an A100, L4, L40S, ... or a shape Mosaic does not take) the Pallas Triton kernel
         (``triton``: bf16 or fp16, no fp8 cache, head_dim a multiple of 16 up to 256, GQA ratio
         1-16, any page size);
  tpu -> the Mosaic TPU kernel (``tpu``), imported lazily;
  anything else, or a case no kernel takes -> the pure-jnp reference (``reference``).
``sliding_window`` and ``soft_cap`` are handled inside the GPU kernels; an fp8 cache's per-tensor
``k_scale`` / ``v_scale`` (``pallas_kernels.kv_cache``) by every path that takes fp8; attention
sinks (``sinks[Hq]``, GPT-OSS) by every path, so they never change the choice.
``choose_kernel`` says which path a model's shapes take, and why a fallback was taken, for the
start-up log.

``batch_invariant=True`` (the engine's batch-invariant mode) makes each query row's result
independent of the step it is in (its batchmates, the token bucket, the chunking of its
prompt): every kernel then walks each sequence's KV in blocks aligned to absolute positions
(block ``i`` holds positions ``[i * block_kv, (i + 1) * block_kv)``) in one pass, so keys a row
may not see add exact zeros to its online softmax, and the per-step choices that change the
reduction are pinned: no KV split on GPU (the split count follows the step's size, and a split
row is merged from partial sums), one Mosaic GPU kernel for every step on Hopper (not the
Triton kernel for decode-sized steps at head_dim 256), 64-row Triton programs (not 16 for
decode-only steps), and 16-token query blocks on TPU (the smallest bucket's). The reference
reduces over the whole page table (``pages_per_seq * page_size`` keys, fixed by
``max_model_len``) in every step already.

``q_pe`` given makes the call multi-head latent attention (DeepSeek-V2/V3, ``models/mla.py``):
``q`` is the absorbed query ``q_latent`` [T, Hq, L], ``k_pages`` the latent c_kv and ``v_pages``
the rotary key k_pe, ``k_scale`` / ``v_scale`` their fp8 scales; ``mla.dispatch`` picks its path
(batch-invariant mode does not reach it). One op for both, so the runner's attention
(``shard_map``-ed over the heads under tensor parallelism) serves either.

``JAXSERVE_ATTENTION`` (``attention_env``) overrides the choice on a GPU: ``auto`` (the
default, as above),
``mosaic`` (Mosaic GPU or the reference, never Triton), ``triton`` (the Triton kernel even on
Hopper: for benchmarking it there) or ``reference`` (the jnp reference on any backend).

``JAXSERVE_FP8_ATTENTION`` picks how the Mosaic GPU kernel reads an fp8 cache (``mosaic_gpu``'s
module docstring has both): ``native`` (the default: fp8 wgmmas, K read as stored, V transposed
in fp8; each query row quantized to e4m3 at its own scale and the softmax probabilities P
rounded to e4m3) or ``convert`` (each K and V tile converted to the queries' dtype in shared memory,
bf16 wgmmas; the reference's results to bf16 rounding). The kernel takes an fp8 cache at
head_dim 64 and 128, the sizes the native path's tests run (13 passed natively). On an
H100 (2026-12-06) native ran decode at batch 64 x 4,096 context in 219 us against bf16's 355
(1.62x; convert 1.36x), and its error against the bf16 cache's attention was the fp8 cache's
own plus a tenth (relative, Frobenius: 7.0% against convert's 6.2% at 1,024 context, 10.0%
against 9.9% at 4,096); against the reference over the same quantized pages it is 2.3-3.3%
where convert's is 0.2%. ``choose_kernel`` names the fp8 path in its reason when the cache is
fp8, so the start-up line reads e.g. ``Attention: Pallas Mosaic GPU kernel (fp8 cache read by
fp8 wgmmas, queries and probabilities in e4m3: JAXSERVE_FP8_ATTENTION=native)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from pallas_kernels.attention_env import ATTENTION_ENV, requested_attention
from pallas_kernels.env_choice import env_choice
from pallas_kernels.kv_cache import Scale, is_quantized
from pallas_kernels.mla import dispatch as mla_dispatch
from pallas_kernels.ragged_paged_attention import reference


def _compute_capability() -> str:
    return str(getattr(jax.devices("gpu")[0], "compute_capability", "unknown"))


@functools.cache
def _is_hopper_or_newer() -> bool:
    major = _compute_capability().split(".")[0]
    return major.isdigit() and int(major) >= 9


# What the start-up log calls each path.
KERNEL_NAMES = {
    "gpu": "Pallas Mosaic GPU kernel",
    "triton": "Pallas Triton kernel",
    "tpu": "Pallas Mosaic TPU kernel",
    "reference": "pure-jnp reference",
}

# Measured on the H200 (benchmarks/RESULTS.md, 2026-12-03): at head_dim 256 the Triton kernel
# decodes 1.1-1.7x faster than the Mosaic one, which is 2.5x faster on a step with a long prefill.
TRITON_HEAD_DIMS = (256,)
# Batch-invariant mode's TPU query block: the smallest token bucket's (runner/buckets.py), so
# every bucket cuts its queries alike (the kernel takes min(block, tokens)).
INVARIANT_TPU_Q_TOKENS = 16
TRITON_MAX_TOKENS = 512

FP8_ATTENTION_ENV = "JAXSERVE_FP8_ATTENTION"
FP8_ATTENTION_CHOICES = ("native", "convert")
# What the start-up log says of each fp8 path of the Mosaic GPU kernel.
FP8_PATHS = {
    "convert": "fp8 cache converted to bf16 in shared memory",
    "native": "fp8 cache read by fp8 wgmmas, queries and probabilities in e4m3",
}


def requested_fp8_attention() -> str:
    """``JAXSERVE_FP8_ATTENTION`` (default ``native``), validated."""
    return env_choice(FP8_ATTENTION_ENV, FP8_ATTENTION_CHOICES, "native")


def _fp8_path_note(k_pages: Any) -> str | None:
    """The Mosaic GPU kernel's fp8 path for this cache, for ``choose_kernel``'s reason; None
    for a bf16 / fp16 cache."""
    if not is_quantized(k_pages.dtype):
        return None
    path = requested_fp8_attention()
    return f"{FP8_PATHS[path]}: {FP8_ATTENTION_ENV}={path}"


def _triton_decodes_faster(q: Any, requested: str) -> bool:
    """Whether a step Mosaic can run goes to the Triton kernel on Hopper: decode-sized steps
    (``q``'s token bucket) at the head sizes where Triton measured faster."""
    return (
        requested == "auto" and q.shape[-1] in TRITON_HEAD_DIMS and q.shape[0] <= TRITON_MAX_TOKENS
    )


def _gpu_choice(
    q: Any, k_pages: Any, requested: str, batch_invariant: bool = False
) -> tuple[str, str | None]:
    """Mosaic GPU where it runs, else the Triton kernel, else the reference; and why."""
    if requested == "triton":
        why = f"{ATTENTION_ENV}=triton"
    elif not _is_hopper_or_newer():
        why = (
            "the Mosaic GPU kernel needs Hopper or newer (compute capability 9.0); "
            f"this GPU has {_compute_capability()}"
        )
    else:
        from pallas_kernels.ragged_paged_attention import mosaic_gpu

        reason = mosaic_gpu.unsupported_reason(q, k_pages)
        if reason is None and (batch_invariant or not _triton_decodes_faster(q, requested)):
            return "gpu", _fp8_path_note(k_pages)
        why = (
            f"the Mosaic GPU kernel does not run this model ({reason})"
            if reason is not None
            else f"faster than the Mosaic GPU kernel at head_dim {q.shape[-1]} in steps of up "
            f"to {TRITON_MAX_TOKENS} tokens; larger steps take the Mosaic GPU kernel"
        )
    if requested == "mosaic":
        return "reference", f"{why}; {ATTENTION_ENV}=mosaic"
    from pallas_kernels.ragged_paged_attention import triton

    reason = triton.unsupported_reason(q, k_pages)
    if reason is not None:
        return "reference", f"{why}; the Triton kernel does not run it either ({reason})"
    return "triton", why


def choose_kernel(
    q: Any,  # [T, Hq, D]: an array or a jax.ShapeDtypeStruct (only shape and dtype are read)
    k_pages: Any,  # [P, page_size, Hkv, D]: likewise
    batch_invariant: bool = False,
) -> tuple[str, str | None]:
    """The path ``ragged_paged_attention`` takes on this backend for these shapes and dtypes:
    ``("gpu" | "triton" | "tpu" | "reference", why this backend's first choice was not taken,
    or None)``; on the Mosaic GPU kernel with an fp8 cache the second names its fp8 path
    (``JAXSERVE_FP8_ATTENTION``) instead.
    """
    backend = jax.default_backend()
    requested = requested_attention()
    if requested == "reference":
        return "reference", f"{ATTENTION_ENV}=reference"
    if backend == "gpu":
        return _gpu_choice(q, k_pages, requested, batch_invariant)
    if backend == "tpu":
        return "tpu", None
    return "reference", f"no Pallas kernel runs on the {backend} backend"


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: jax.Array | None = None,  # [Hq]  attention sinks (GPT-OSS)
    batch_invariant: bool = False,  # each row's result independent of its step (see above)
    q_pe: jax.Array | None = None,  # [T, Hq, R]: latent attention (see below)
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Ragged paged attention on the best kernel for the current backend (with ``q_pe``:
    latent attention, see the module docstring)."""
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if q_pe is not None:
        return mla_dispatch.ragged_paged_mla_attention(
            q, q_pe, *args[1:], sm_scale=sm_scale, ckv_scale=k_scale, kpe_scale=v_scale
        )
    options: dict[str, Any] = dict(
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    if k_scale is not None or v_scale is not None:  # a bf16 cache calls every path as before
        options.update(k_scale=k_scale, v_scale=v_scale)
    if sinks is not None:  # a model without sinks calls every path as before
        options.update(sinks=sinks)
    kernel, _ = choose_kernel(q, k_pages, batch_invariant)
    if kernel == "gpu":
        from pallas_kernels.ragged_paged_attention import mosaic_gpu

        native = is_quantized(k_pages.dtype) and requested_fp8_attention() == "native"
        config = mosaic_gpu.served_config(q, k_pages, page_indices, native, batch_invariant)
        if config != mosaic_gpu.KernelConfig():  # the default config calls the kernel as before
            options.update(config=config)
        return mosaic_gpu.ragged_paged_attention(*args, **options)
    if kernel == "triton":  # (an fp8 cache: converted in registers, scaled in the kernel)
        from pallas_kernels.ragged_paged_attention import triton

        if batch_invariant:
            options.update(config=triton.TritonConfig(num_splits=1, block_rows=64))
        return triton.ragged_paged_attention(*args, **options)
    if kernel == "tpu":
        from pallas_kernels.ragged_paged_attention import tpu

        if batch_invariant:
            options.update(num_q_tokens_per_block=INVARIANT_TPU_Q_TOKENS)
        return tpu.ragged_paged_attention(*args, **options)
    return reference.ragged_paged_attention(*args, **options)
