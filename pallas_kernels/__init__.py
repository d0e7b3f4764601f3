"""Attention kernels for jaxserve: one entry point, chosen by backend.

``ragged_paged_attention`` has the reference's signature and picks, at trace time, by
``jax.default_backend()``:
  gpu -> the Mosaic GPU kernel (``pallas_kernels.gpu``) on Hopper or newer, for the shapes and
         dtypes it takes (bf16, head_dim 64/128, GQA ratio 1-8, power-of-two page size >= 8);
  tpu -> ``pallas_kernels.tpu.ragged_paged_attention``, imported lazily;
  anything else, or a case the chosen kernel does not take -> the pure-jnp reference.
``sliding_window`` and ``soft_cap`` are handled inside the GPU kernel.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax

from pallas_kernels.reference import ragged_paged_attention as reference_attention
from pallas_kernels.reference import write_kv


@functools.cache
def _is_hopper_or_newer() -> bool:
    device = jax.devices("gpu")[0]
    major = str(getattr(device, "compute_capability", "0")).split(".")[0]
    return int(major) >= 9


def _tpu_kernel() -> Callable[..., jax.Array] | None:
    """The TPU kernel, or None while ``pallas_kernels.tpu`` does not provide it."""
    try:
        module = importlib.import_module("pallas_kernels.tpu")
    except ImportError:
        return None
    return getattr(module, "ragged_paged_attention", None)


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
) -> jax.Array:  # [T, Hq, D], q's dtype
    """Ragged paged attention on the best kernel for the current backend."""
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    backend = jax.default_backend()
    if backend == "gpu" and _is_hopper_or_newer():
        from pallas_kernels import gpu

        if gpu.unsupported_reason(q, k_pages, sliding_window, soft_cap) is None:
            return gpu.ragged_paged_attention(
                *args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
            )
    elif backend == "tpu":
        kernel = _tpu_kernel()
        if kernel is not None:
            return kernel(
                *args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
            )
    return reference_attention(
        *args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )


__all__ = ["ragged_paged_attention", "reference_attention", "write_kv"]
