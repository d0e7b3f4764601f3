"""Multi-head latent attention: one entry point, a Pallas kernel (Triton, Mosaic GPU, Mosaic
TPU) or the reference.

``ragged_paged_mla_attention`` has the reference's signature (``models/mla.py`` calls it) and
picks, at trace time, from ``JAXSERVE_MLA`` and the backend:
  auto      (the default) on an NVIDIA GPU, when the call runs on one device (the process
            has one, or the call is inside a ``shard_map``: under tensor parallelism
            ``runner/parallel/sharding.py`` gives each device its query heads and the whole
            latent cache): on Hopper the Pallas Mosaic GPU kernel (``mosaic``) where it takes
            the shapes (below), else the Pallas Triton kernel (``triton``) where the shapes and
            dtypes are its (bf16 or fp16 queries over a cache of their dtype or fp8; latent
            dims multiples of 16, rope dims of 8), with the reason; on a TPU the Pallas Mosaic
            TPU kernel (``tpu``) where ``tpu.unsupported_reason`` takes the shapes (bf16 or f32
            queries over a cache of their dtype or fp8; latent widths multiples of 128, page
            sizes of 16), on the same one-device condition; the pure-jnp reference
            (``reference``) anywhere else;
  on        the kernel wherever it takes the shapes: natively on a GPU (outside a
            ``shard_map`` with several devices XLA runs it whole on every device), the TPU
            kernel on a TPU, in Pallas interpret mode on another backend;
  interpret the kernel in Pallas interpret mode on any backend (tests, debugging);
  off       the reference;
  mosaic    the Pallas Mosaic GPU kernel (``mosaic_gpu``: Hopper wgmma, FlashMLA's blocking)
            wherever it takes the shapes (bf16 or fp16 over a cache of their dtype, no fp8;
            latent 128 to 512, heads in multiples of 8, see its ``unsupported_reason``):
            natively on a Hopper GPU, in Mosaic GPU interpret mode on another backend (whose
            XLA CPU client needs 4 threads, ``NPROC`` or CPUs, for the kernel's 3 warpgroups);
            elsewhere what ``on`` takes (the Triton kernel, or the reference).
``auto`` takes the Mosaic GPU kernel on Hopper since each of its native cases passes
(``benchmarks/probes/native_cases.py``, an H100, 2026-12-07) and it is the faster kernel in
every cell measured: one DeepSeek-V3 layer's decode at 64 x 4,096 in 207.6 against the Triton
kernel's 481.8 us, 749.4 against 1,610.0 at 256 x 4,096; the 5-layer step 3.25 against 3.36
ms at batch 1, 15.04 against 16.31 at 64 (``benchmarks/mla.py``, an H100, 2026-12-07).
``JAXSERVE_ATTENTION=reference`` (``attention_env``) takes the reference here too, unless
``JAXSERVE_MLA`` asks for a kernel. ``choose`` says which path a model's shapes take and why;
``path_for`` the same for a model's dimensions (capacity planning, for this backend or a named
device's); ``describe`` writes the start-up log's attention line for a model with MLA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.attention_env import ATTENTION_ENV, requested_attention
from pallas_kernels.env_choice import devices_per_model, env_choice
from pallas_kernels.kv_cache import Scale
from pallas_kernels.mla import mosaic_gpu, reference, tpu, triton

MLA_ENV = "JAXSERVE_MLA"
MLA_CHOICES = ("auto", "on", "interpret", "off", "mosaic")

# What the start-up log calls each path.
MLA_KERNEL_NAMES = {
    "triton": "Pallas Triton MLA kernel",
    "interpret": "Pallas Triton MLA kernel in interpret mode",
    "mosaic": "Pallas Mosaic GPU MLA kernel",
    "mosaic_interpret": "Pallas Mosaic GPU MLA kernel in interpret mode",
    "tpu": "Pallas Mosaic TPU MLA kernel",
    "reference": "pure-jnp reference",
}


def requested() -> str:
    """``JAXSERVE_MLA`` (default ``auto``), validated."""
    return env_choice(MLA_ENV, MLA_CHOICES, "auto")


def in_shard_map() -> bool:
    """Whether this trace is inside a ``shard_map`` (its mesh axes manual): the call then runs
    on each device's block of the arrays, a kernel's own launch per device."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def choose(
    q_latent: Any,  # [T, N, L]: an array or a jax.ShapeDtypeStruct (only shape and dtype read)
    q_pe: Any,  # [T, N, R]
    ckv_pages: Any,  # [P, page_size, 1, L]
    kpe_pages: Any,  # [P, page_size, 1, R]
    *,
    per_device: bool | None = None,  # the call sees one device's heads; None: in_shard_map()
    backend: str | None = None,  # the backend to choose for; None: jax.default_backend()
) -> tuple[str, str]:
    """``("triton" | "interpret" | "mosaic" | "mosaic_interpret" | "tpu" | "reference", why)``:
    the path these shapes take here."""
    value = requested()
    backend = backend or jax.default_backend()
    per_device = in_shard_map() if per_device is None else per_device
    if value == "mosaic":
        return _choose_mosaic(q_latent, q_pe, ckv_pages, kpe_pages, per_device, backend)
    if value == "off":
        return "reference", f"{MLA_ENV}=off"
    if value == "auto":
        if requested_attention() == "reference":
            return "reference", f"{ATTENTION_ENV}=reference"
        if backend not in ("gpu", "tpu"):
            return (
                "reference",
                f"the MLA kernels are for GPUs and TPUs; this is the {backend} backend",
            )
        if devices_per_model() > 1 and not per_device:
            return "reference", (
                f"{devices_per_model()} devices a model and the call is not split over the "
                f"heads by a shard_map ({MLA_ENV}=on runs it whole on every device)"
            )
    if backend == "tpu" and value in ("auto", "on"):
        return _choose_tpu(q_latent, q_pe, ckv_pages, kpe_pages, value, per_device)
    if value == "auto" and backend == "gpu":
        return _choose_auto_gpu(q_latent, q_pe, ckv_pages, kpe_pages, per_device)
    reason = triton.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        return "reference", f"the Pallas Triton MLA kernel does not run this model ({reason})"
    where = _where(q_latent, per_device)
    if value == "interpret" or backend != "gpu":
        return (
            "interpret",
            f"{MLA_ENV}={value}, Pallas interpret mode on the {backend} backend{where}",
        )
    return "triton", f"{MLA_ENV}=on{where}"


def _where(q_latent: Any, per_device: bool) -> str:
    """The reason's note of a call under a ``shard_map``: the heads a device holds."""
    return f", {q_latent.shape[1]} heads a device under a shard_map" if per_device else ""


def _mosaic_gpu_reason(q_latent, q_pe, ckv_pages, kpe_pages) -> str | None:
    """Why the Mosaic GPU kernel cannot run these shapes natively on this GPU, or None."""
    reason = mosaic_gpu.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is None and not _is_hopper():
        return "it needs a Hopper GPU (wgmma, compute capability 9.x)"
    return reason


def _choose_mosaic(q_latent, q_pe, ckv_pages, kpe_pages, per_device: bool, backend: str):
    """``JAXSERVE_MLA=mosaic``: the Mosaic GPU kernel natively on Hopper, in interpret mode on
    another backend; where it cannot run, the path ``on`` takes, with the reason."""
    where = _where(q_latent, per_device)
    if backend == "gpu":
        reason = _mosaic_gpu_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    else:
        reason = mosaic_gpu.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is None and backend != "gpu":
        reason = mosaic_gpu.interpreter_unsupported_reason()
    if reason is None:
        if backend == "gpu":
            return "mosaic", f"{MLA_ENV}=mosaic{where}"
        return (
            "mosaic_interpret",
            f"{MLA_ENV}=mosaic, Mosaic GPU interpret mode on the {backend} backend{where}",
        )
    path, why = _choose_on(q_latent, q_pe, ckv_pages, kpe_pages, per_device, backend)
    return path, f"the Mosaic GPU MLA kernel does not run this model ({reason}); {why}"


def _choose_auto_gpu(q_latent, q_pe, ckv_pages, kpe_pages, per_device: bool):
    """``auto`` on an NVIDIA GPU: the Mosaic GPU kernel on Hopper where it takes the shapes,
    else the Triton kernel where it does, with the reason, else the reference."""
    where = _where(q_latent, per_device)
    mosaic = _mosaic_gpu_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if mosaic is None:
        return "mosaic", f"{MLA_ENV}=auto on a Hopper GPU{where}"
    reason = triton.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        return "reference", (
            f"neither MLA kernel runs this model (Mosaic GPU: {mosaic}; Pallas Triton: {reason})"
        )
    why = f"{MLA_ENV}=auto on an NVIDIA GPU{where}; the Mosaic GPU MLA kernel does not run "
    return "triton", f"{why}this model ({mosaic})"


def _choose_tpu(q_latent, q_pe, ckv_pages, kpe_pages, value: str, per_device: bool):
    """``choose`` on a TPU: the Mosaic TPU kernel where it takes the shapes."""
    reason = tpu.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        return "reference", f"the Pallas Mosaic TPU MLA kernel does not run this model ({reason})"
    where = _where(q_latent, per_device)
    return "tpu", f"{MLA_ENV}={value} on a TPU{where}"


def _choose_on(q_latent, q_pe, ckv_pages, kpe_pages, per_device: bool, backend: str):
    """What ``JAXSERVE_MLA=on`` takes: the Triton kernel (interpret mode off a GPU)."""
    reason = triton.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        return "reference", f"the Pallas Triton MLA kernel does not run this model ({reason})"
    where = _where(q_latent, per_device)
    if backend != "gpu":
        return "interpret", f"Pallas interpret mode on the {backend} backend{where}"
    return "triton", f"the Pallas Triton MLA kernel{where}"


def _is_hopper() -> bool:
    """Whether this process's GPU runs wgmma (compute capability 9.x); true where there is no
    GPU here (a named device's plan: ``--device-memory H200``)."""
    if jax.default_backend() != "gpu":
        return True
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return major == "9"


def path_for(
    num_heads: int,  # query heads per device
    latent: int,  # kv_lora_rank
    rope_dim: int,  # qk_rope_head_dim
    dtype: Any,  # the activations'
    kv_dtype: Any,  # the cache's
    tensor_parallel_size: int = 1,
    backend: str | None = None,  # None: this process's backend
) -> tuple[str, str]:
    """``choose`` for a model's dimensions: the path its latent attention takes (the runner
    splits the heads over a ``shard_map`` under tensor parallelism)."""
    shape = jax.ShapeDtypeStruct

    def array(*dims: int, dtype: Any) -> jax.ShapeDtypeStruct:
        return shape(dims, jnp.dtype(dtype))

    return choose(
        array(1, num_heads, latent, dtype=dtype),
        array(1, num_heads, rope_dim, dtype=dtype),
        array(1, 16, 1, latent, dtype=kv_dtype),
        array(1, 16, 1, rope_dim, dtype=kv_dtype),
        per_device=tensor_parallel_size > 1,
        backend=backend,
    )


def describe(
    num_heads: int,  # query heads per device
    latent: int,  # kv_lora_rank
    rope_dim: int,  # qk_rope_head_dim
    dtype: Any,  # the activations'
    kv_dtype: Any,  # the cache's
    tensor_parallel_size: int = 1,
) -> str:
    """The start-up log's attention line for a model with MLA, e.g. ``Attention: Pallas Mosaic
    GPU MLA kernel (multi-head latent attention: JAXSERVE_MLA=auto on a Hopper GPU)`` or
    ``Attention: pure-jnp reference (multi-head latent attention: the MLA kernels are for GPUs
    and TPUs; this is the cpu backend)``."""
    path, why = path_for(num_heads, latent, rope_dim, dtype, kv_dtype, tensor_parallel_size)
    return f"Attention: {MLA_KERNEL_NAMES[path]} (multi-head latent attention: {why})"


def ragged_paged_mla_attention(
    q_latent: jax.Array,  # [T, N, L]
    q_pe: jax.Array,  # [T, N, R]
    ckv_pages: jax.Array,  # [P, page_size, 1, L]
    kpe_pages: jax.Array,  # [P, page_size, 1, R]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
) -> jax.Array:  # [T, N, L], q_latent's dtype
    """Latent attention on the path ``choose`` picks for these shapes."""
    args = (q_latent, q_pe, ckv_pages, kpe_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    options: dict[str, Any] = dict(sm_scale=sm_scale, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    path, _ = choose(q_latent, q_pe, ckv_pages, kpe_pages)
    is_scaled = ckv_scale is not None or kpe_scale is not None
    if path in ("mosaic", "mosaic_interpret") and not is_scaled:  # (scales: an fp8 cache's)
        return mosaic_gpu.ragged_paged_mla_attention(
            *args, sm_scale=sm_scale, interpret=path == "mosaic_interpret"
        )
    if path == "reference":
        return reference.ragged_paged_mla_attention(*args, **options)
    if path == "tpu":
        return tpu.ragged_paged_mla_attention(*args, **options)
    interpret = path in ("interpret", "mosaic_interpret")
    return triton.ragged_paged_mla_attention(*args, **options, interpret=interpret)
