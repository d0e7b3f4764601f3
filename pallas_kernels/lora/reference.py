"""The LoRA product's semantics in pure jnp: two dense products over every slot with the tokens'
one-hot slot between them (``jaxserve/models/lora.py``'s first form). The oracle of the Triton
kernel (``triton``) and the path ``dispatch`` takes off the GPU; same signature as the kernel's.

``x [T, X]``, ``a [M, n * R, X]`` (n projections that read the same input, their A matrices
joined on the rank axis: q, k, v; gate, up; stored X-minor, as PEFT writes lora_A), ``bs`` n
arrays ``[M, R, O_i]``, ``token_slots i32[T]``: 0 is no adapter (a zero term), s >= 1 is row
s - 1 of the stacks. Returns the n terms ``[T, O_i]`` in x's dtype; ``x @ A`` is rounded to x's
dtype before ``@ B``, as the model's einsums do. ``x_scale [X]``: the input is ``x_scale * x``
(a norm's weight times its unscaled rows, rounded as ``rms_norm`` rounds it), which the kernel
applies as it reads x.

Two forms of the same product, by the step's size (``form``):
  gemm     two einsums (XLA's GEMMs): prefill-sized steps, and every step off the GPU;
  reduced  both products as float32 multiply-and-sum, no GEMM: for decode-sized steps on the
           GPU, where each GEMM is a launch or two (a split-K GEMM and its reduce) for a few
           microseconds of work. XLA makes each shrink one reduction kernel over A's minor
           axis and, for one slot of rank 16 (``SUMMED_MAX_TERMS``), fuses each expand into the
           kernel that adds it to the base output (a deviceless H100 compile of the
           Llama-3-8B batch-1 step: 5 kernels a layer beside the base model's where the GEMMs
           add 16); with more slots or a higher rank the expands stay GEMMs (15 at 4 slots).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.env_choice import env_choice

# The largest step (tokens) that takes the reduced form on the GPU: above it a shrink re-reads
# x once per rank column, and the tensor cores' GEMM is the cheaper.
REDUCED_MAX_TOKENS = 64
# ``auto`` (the reduced form for GPU steps of at most REDUCED_MAX_TOKENS tokens, else the
# GEMMs), ``gemm`` or ``reduced`` (either everywhere: to compare them, and for tests).
FORM_ENV = "JAXSERVE_LORA_DENSE"
FORMS = ("auto", "gemm", "reduced")


def form(num_tokens: int) -> str:
    """``"gemm"`` or ``"reduced"``: the dense product's form for a step of ``num_tokens``
    tokens here (read at trace time)."""
    value = env_choice(FORM_ENV, FORMS, "auto")
    if value != "auto":
        return value
    on_gpu = jax.default_backend() == "gpu"
    return "reduced" if on_gpu and num_tokens <= REDUCED_MAX_TOKENS else "gemm"


def describe_form() -> str:
    """The dense product's form for the start-up line: ``"GEMMs"``, ``"GEMMs; float32 sums
    for steps of at most 64 tokens"`` (a GPU), or the one ``JAXSERVE_LORA_DENSE`` forces."""
    value = env_choice(FORM_ENV, FORMS, "auto")
    if value == "gemm":
        return f"GEMMs, {FORM_ENV}=gemm"
    if value == "reduced":
        return f"float32 sums, {FORM_ENV}=reduced"
    if jax.default_backend() == "gpu":
        return f"GEMMs; float32 sums for steps of at most {REDUCED_MAX_TOKENS} tokens"
    return "GEMMs"


def scaled_input(x: jax.Array, x_scale: jax.Array | None) -> jax.Array:
    """``x_scale * x`` (the product ``models.layers.rms_norm`` returns), or x."""
    return x if x_scale is None else x_scale * x


def slot_mask(token_slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:  # [T, M]
    """Each token's one-hot slot row (all zeros for the base model)."""
    rows = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
    return (token_slots[:, None] == rows[None, :]).astype(dtype)


def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none
    mask: jax.Array | None = None,  # [T, M]  ``slot_mask``, when the caller has it already
    x_scale: jax.Array | None = None,  # [X]  x's columns scaled first (``scaled_input``)
) -> tuple[jax.Array, ...]:  # n x [T, O_i]
    """Every slot's shrink, masked to each token's own slot, then every slot's expand summed
    (one slot is non-zero per token), in the form ``form`` picks."""
    x = scaled_input(x, x_scale)
    if mask is None:
        mask = slot_mask(token_slots, a.shape[0], x.dtype)
    return form_deltas(x, a, bs, mask, form(x.shape[0]))


def form_deltas(
    x: jax.Array,  # [T, X]  scaled already
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    mask: jax.Array,  # [T, M]
    how: str,  # "gemm" or "reduced" (see the module docstring)
) -> tuple[jax.Array, ...]:  # n x [T, O_i]
    """``lora_deltas``'s product in the form ``how``: ``gemm``, two einsums; ``reduced``, ``x @
    A`` as a float32 sum over X rounded to x's dtype, masked, then each expand a float32 sum
    over the slots' R (``_expand``)."""
    if how == "gemm":
        xa = jnp.einsum("TX,MRX->TMR", x, a) * mask[:, :, None]  # [T, M, n * R]
    else:
        f32 = jnp.float32
        xa = (x[:, None, None, :].astype(f32) * a[None].astype(f32)).sum(-1)  # [T, M, n * R]
        xa = (xa * mask[:, :, None].astype(f32)).astype(x.dtype)
    parts = jnp.split(xa, len(bs), axis=2)
    expand = _expand if how == "reduced" else _gemm_expand
    return tuple(expand(p, b) for p, b in zip(parts, bs, strict=True))


def _gemm_expand(p: jax.Array, b: jax.Array) -> jax.Array:  # [T, M, R] x [M, R, O] -> [T, O]
    return jnp.einsum("TMR,MRO->TO", p, b)


# The expand's terms (slots x rank) up to which it is written as one float32 sum: XLA then
# fuses it into the kernel that adds it to the base output. Above 16 terms XLA transposes B
# for the sum at every step (a deviceless H100 compile), and the GEMM is the cheaper; rank-1
# updates written out one by one fuse at any count, but 64 of them took a Llama-3-8B step's
# compile from 10 to 219 s.
SUMMED_MAX_TERMS = 16


def _expand(p: jax.Array, b: jax.Array) -> jax.Array:  # [T, M, R] x [M, R, O] -> [T, O]
    """One projection's expand in the reduced form: a float32 sum over the slots' R, or the
    GEMM for more than SUMMED_MAX_TERMS terms."""
    if p.shape[1] * p.shape[2] > SUMMED_MAX_TERMS:
        return _gemm_expand(p, b)
    f32 = jnp.float32
    return (p[:, :, :, None].astype(f32) * b[None].astype(f32)).sum((1, 2)).astype(p.dtype)
