"""The grouped matmul of a mixture of experts' experts: one entry point, chosen by backend.

``grouped_matmul(lhs, rhs, group_sizes)`` has ``jax.lax.ragged_dot``'s semantics: ``lhs[R, K]``
sorted by group, ``rhs[G, K, N]``, ``group_sizes i32[G]`` summing to at most R; row r of a
group g is ``lhs[r] @ rhs[g]``, and the rows past the sum are zeros. It picks, at trace time:
  gpu -> the Pallas Triton kernel (``triton``, any NVIDIA GPU):
         XLA's GPU ``RaggedDotRewriter`` turns a ragged dot into a dense dot over every group,
         each row broadcast to [G, K] and masked: G times the FLOPs and a G-times temporary
         (Qwen3-30B-A3B has 128 experts; its 1,024-8,192-token steps needed 70-98 GiB);
  tpu, cpu -> ``jax.lax.ragged_dot`` (TPU has its own grouped matmul; the CPU is for tests).
The Triton kernel rather than Mosaic GPU (the design's main GPU path): it runs on every NVIDIA
GPU, not Hopper only, and jax's own Mosaic GPU grouped matmul
(``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``) unrolls its groups at compile time;
benchmarks/moe.py times all three paths on the H200. The Pallas Triton backend warns at
lowering that it is deprecated (jax 0.11) but ships and runs.
Quantized experts (``--quantization fp8 | int8``) pass ``rhs`` in fp8 e4m3 or int8 with
``scale f32[G, N]``, weight-only: the kernel converts each weight tile in registers and scales
its output columns; ``ragged_dot`` multiplies the weights converted to ``lhs``'s dtype (in XLA)
and scales each row's f32 sums by its group's scales.
``JAXSERVE_GROUPED_MATMUL`` overrides the choice: ``auto`` (the default, as above), ``triton``
(the kernel on any backend: interpreted off the GPU, for tests) or ``xla`` (``ragged_dot``
everywhere, to compare). ``choose_grouped_matmul`` says which runs and why, for the start-up
log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.env_choice import env_choice

GROUPED_MATMUL_ENV = "JAXSERVE_GROUPED_MATMUL"
GROUPED_MATMUL_CHOICES = ("auto", "triton", "xla")
# What the start-up log calls each path.
GROUPED_MATMUL_NAMES = {
    "triton": "Pallas Triton grouped matmul",
    "xla": "jax.lax.ragged_dot",
}


def requested_grouped_matmul() -> str:
    """``JAXSERVE_GROUPED_MATMUL`` (default ``auto``), validated."""
    return env_choice(GROUPED_MATMUL_ENV, GROUPED_MATMUL_CHOICES, "auto")


def choose_grouped_matmul(
    lhs,  # [R, K]: an array or a jax.ShapeDtypeStruct (only shape and dtype are read)
    rhs,  # [G, K, N]: likewise
    scale=None,  # [G, N]: likewise, with a quantized rhs
) -> tuple[str, str | None]:
    """The path ``grouped_matmul`` takes on this backend: ``("triton" | "xla", why, or None
    when it is the backend's first choice)``. The kernel runs interpreted off the GPU."""
    backend = jax.default_backend()
    requested = requested_grouped_matmul()
    if requested == "xla":
        return "xla", f"{GROUPED_MATMUL_ENV}=xla"
    if backend != "gpu" and requested == "auto":
        return "xla", None
    from pallas_kernels.grouped_matmul import triton

    reason = triton.unsupported_reason(lhs, rhs, scale)
    if reason is not None:
        return "xla", f"the Triton grouped matmul does not run it ({reason})"
    if backend != "gpu":
        return "triton", f"{GROUPED_MATMUL_ENV}=triton: interpreted on the {backend}"
    return "triton", None


def grouped_matmul(
    lhs: jax.Array,  # [R, K]  sorted by group
    rhs: jax.Array,  # [G, K, N]  lhs's dtype, or fp8 e4m3 / int8 values with a scale
    group_sizes: jax.Array,  # i32[G]  rows of each group, in order; may sum to less than R
    scale: jax.Array | None = None,  # f32[G, N]  per (group, output column) of a quantized rhs
) -> jax.Array:  # [R, N], lhs's dtype; rows past the groups' sum are zeros
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (times each row's group's ``scale``) on
    the best path for the backend."""
    path, _ = choose_grouped_matmul(lhs, rhs, scale)
    if path == "triton":
        from pallas_kernels.grouped_matmul import triton

        interpret = jax.default_backend() != "gpu"
        return triton.grouped_matmul(lhs, rhs, group_sizes, scale, interpret=interpret)
    if scale is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return scaled_ragged_dot(lhs, rhs, group_sizes, scale)


def scaled_ragged_dot(
    lhs: jax.Array,  # [R, K]  sorted by group
    rhs: jax.Array,  # [G, K, N]  fp8 e4m3 / int8 values
    group_sizes: jax.Array,  # i32[G]
    scale: jax.Array,  # f32[G, N]
) -> jax.Array:  # [R, N], lhs's dtype
    """The XLA path over quantized weights: ``ragged_dot`` on the values converted to lhs's
    dtype, each row's f32 sums times its group's scales."""
    sums = jax.lax.ragged_dot(
        lhs, rhs.astype(lhs.dtype), group_sizes, preferred_element_type=jnp.float32
    )  # f32[R, N]
    return (sums * row_scale(scale, group_sizes, lhs.shape[0])).astype(lhs.dtype)


def row_scale(
    scale: jax.Array,  # f32[G, N]
    group_sizes: jax.Array,  # i32[G]
    num_rows: int,
) -> jax.Array:  # f32[R, N]; zeros past the groups' sum
    """Each row's group's scales, rows in group order as ``group_sizes`` counts them."""
    ends = jnp.cumsum(group_sizes)  # i32[G]
    group = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
    return jnp.take(scale, group, axis=0, mode="fill", fill_value=0)
