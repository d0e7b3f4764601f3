"""Multi-head latent attention: one entry point, the Pallas Triton kernel or the reference.

``ragged_paged_mla_attention`` has the reference's signature (``models/mla.py`` calls it) and
picks, at trace time, from ``JAXSERVE_MLA`` and the backend:
  auto      (the default) the Pallas Triton kernel (``triton``) on an NVIDIA GPU when the
            process has one device and the shapes and dtypes are the kernel's (bf16 or fp16
            queries over a cache of their dtype or fp8; latent and rope dims multiples of 16);
            the pure-jnp reference (``reference``) anywhere else;
  on        the kernel wherever it takes the shapes: natively on a GPU (even with several
            devices, where XLA runs it on every device over all the heads), in Pallas
            interpret mode on another backend;
  interpret the kernel in Pallas interpret mode on any backend (tests, debugging);
  off       the reference.
``JAXSERVE_ATTENTION=reference`` (``ragged_paged_attention.dispatch``) takes the reference here
too, unless ``JAXSERVE_MLA`` asks for the kernel. ``choose`` says which path a model's shapes
take and why; ``describe`` writes the start-up log's attention line for a model with MLA.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache import Scale
from pallas_kernels.mla import reference, triton
from pallas_kernels.ragged_paged_attention.dispatch import ATTENTION_ENV, requested_attention

MLA_ENV = "JAXSERVE_MLA"
MLA_CHOICES = ("auto", "on", "interpret", "off")

# What the start-up log calls each path.
MLA_KERNEL_NAMES = {
    "triton": "Pallas Triton MLA kernel",
    "interpret": "Pallas Triton MLA kernel in interpret mode",
    "reference": "pure-jnp reference",
}


def requested() -> str:
    """``JAXSERVE_MLA`` (default ``auto``), validated."""
    value = os.environ.get(MLA_ENV, "auto").strip().lower() or "auto"
    if value not in MLA_CHOICES:
        raise ValueError(f"{MLA_ENV}={value!r} must be one of {', '.join(MLA_CHOICES)}")
    return value


def choose(
    q_latent: Any,  # [T, N, L]: an array or a jax.ShapeDtypeStruct (only shape and dtype read)
    q_pe: Any,  # [T, N, R]
    ckv_pages: Any,  # [P, page_size, 1, L]
    kpe_pages: Any,  # [P, page_size, 1, R]
) -> tuple[str, str]:
    """``("triton" | "interpret" | "reference", why)``: the path these shapes take here."""
    value = requested()
    backend = jax.default_backend()
    if value == "off":
        return "reference", f"{MLA_ENV}=off"
    if value == "auto":
        if requested_attention() == "reference":
            return "reference", f"{ATTENTION_ENV}=reference"
        if backend != "gpu":
            return "reference", f"the MLA kernel is Pallas Triton; this is the {backend} backend"
        if jax.device_count() > 1:
            return "reference", (
                f"{jax.device_count()} devices: the MLA kernel is not partitioned over the "
                f"heads yet ({MLA_ENV}=on runs it on every device over all of them)"
            )
    reason = triton.unsupported_reason(q_latent, q_pe, ckv_pages, kpe_pages)
    if reason is not None:
        return "reference", f"the Pallas Triton MLA kernel does not run this model ({reason})"
    if value == "auto":
        return "triton", f"{MLA_ENV}=auto on an NVIDIA GPU"
    if value == "interpret" or backend != "gpu":
        return "interpret", f"{MLA_ENV}={value}, Pallas interpret mode on the {backend} backend"
    return "triton", f"{MLA_ENV}=on"


def describe(
    num_heads: int,  # query heads per device
    latent: int,  # kv_lora_rank
    rope_dim: int,  # qk_rope_head_dim
    dtype: Any,  # the activations'
    kv_dtype: Any,  # the cache's
) -> str:
    """The start-up log's attention line for a model with MLA, e.g. ``Attention: Pallas Triton
    MLA kernel (JAXSERVE_MLA=auto on an NVIDIA GPU)`` or ``Attention: pure-jnp reference
    (multi-head latent attention: the MLA kernel is Pallas Triton; this is the cpu backend)``."""
    shape = jax.ShapeDtypeStruct

    def pages(dim: int) -> jax.ShapeDtypeStruct:
        return shape((1, 16, 1, dim), jnp.dtype(kv_dtype))

    path, why = choose(
        shape((1, num_heads, latent), jnp.dtype(dtype)),
        shape((1, num_heads, rope_dim), jnp.dtype(dtype)),
        pages(latent),
        pages(rope_dim),
    )
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
    if path == "reference":
        return reference.ragged_paged_mla_attention(*args, **options)
    return triton.ragged_paged_mla_attention(*args, **options, interpret=path == "interpret")
