"""The LoRA product's entry point: the grouped Triton kernel or the dense reference, by backend.

``lora_deltas(x, a, bs, token_slots)`` has ``reference.lora_deltas``'s semantics (one input,
n projections: their A matrices joined, one B each). It picks, at trace time:
  gpu, one device, more than ``DENSE_MAX_SLOTS`` slots -> the Pallas Triton kernels
         (``triton``: sort by slot, shrink, expand): each used slot's A and B read once,
         nothing for empty slots or the base model's tokens;
  otherwise       -> the dense one-hot product (``reference``): every slot's A and B, as
         XLA partitions it under tensor parallelism (the kernel is a custom call XLA cannot
         split; it is not under ``shard_map`` yet), and what TPUs and the CPU run; on the GPU
         steps of at most 64 tokens take it as float32 sums, no GEMM (``reference.form``).
``JAXSERVE_LORA_KERNEL`` overrides the choice: ``auto`` (the default, as above), ``triton`` (the
kernel on any backend: interpreted off the GPU, for tests) or ``reference`` (the dense product
everywhere, to compare). ``JAXSERVE_LORA_FORM`` picks the kernel's form: ``two_launch`` (the
default: shrink, then expand), ``fused`` (one launch, each output tile reducing all of X) or
``split_k`` (one launch, X split across programs, atomic adds: ``split_k.py``), to compare
them end to end; a call whose rank the one-launch forms cannot tile, or a step of more than
``ONE_LAUNCH_MAX_TOKENS`` tokens, takes two launches.
``describe`` writes the start-up log line.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels.env_choice import env_choice, one_device_triton_path
from pallas_kernels.lora import reference

LORA_KERNEL_ENV = "JAXSERVE_LORA_KERNEL"
LORA_KERNEL_CHOICES = ("auto", "triton", "reference")
LORA_FORM_ENV = "JAXSERVE_LORA_FORM"
LORA_FORMS = ("two_launch", "fused", "split_k")
# The one-launch forms are for decode-sized steps, whose LoRA terms are latency: above this,
# a step's terms are a prefill's GEMMs and two launches take them. (split_k's float32 output
# of every projection's columns at a 8,192-token step planned 42 GiB of temporaries on an
# H100, 2026-12-06.)
ONE_LAUNCH_MAX_TOKENS = 256
# Up to this many slots, ``auto`` takes the dense product on the GPU too. Timed on an H100
# (2026-12-06, rank 16, the Llama-3-8B shape): with one slot, the dense terms add 0.86 ms to the
# 5.16 ms of a batch-1 step's projections (32 layers in one program,
# ``benchmarks/probes/lora_fold.py``) where the kernel adds 1.40; end to end, batch-1 TPOT with
# one adapter 1.141x the base model's against the kernel's 1.257x, and offline throughput
# (64 x 512/256) 0.870x against 0.809x. With 8 slots the two tie at one token (1.45 against
# 1.44 ms) and the kernel is ahead offline (4,428 against 4,360 tok/s); at 64 slots each
# group's call is 1.3-2.9x slower dense (``benchmarks/lora_kernel.py``): the dense form reads
# every slot's A and B, the kernel only the used slots'. 2 to 7 slots are not measured; 4
# splits the difference.
DENSE_MAX_SLOTS = 4


def requested() -> str:
    """``JAXSERVE_LORA_KERNEL`` (default ``auto``), validated."""
    return env_choice(LORA_KERNEL_ENV, LORA_KERNEL_CHOICES, "auto")


def choose(num_slots: int | None = None) -> tuple[str, str]:
    """``("triton" | "interpret" | "reference", why)``: how the LoRA product of ``num_slots``
    adapter slots (None: any number) runs here."""
    value = requested()
    path, why = one_device_triton_path(
        LORA_KERNEL_ENV, value, forced="triton", off="reference", fallback="reference"
    )
    if value == "auto" and path == "triton" and num_slots is not None:
        slots = f"{num_slots} slot{'' if num_slots == 1 else 's'}"
        if num_slots <= DENSE_MAX_SLOTS:
            return "reference", f"{why}: {slots}, at most {DENSE_MAX_SLOTS}"
        why = f"{why}: {slots}, more than {DENSE_MAX_SLOTS}"
    return path, why


def lora_deltas(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, n * R, X]
    bs: Sequence[jax.Array],  # n x [M, R, O_i]
    token_slots: jax.Array,  # i32[T]  0: none; s: row s - 1
    mask: jax.Array | None = None,  # [T, M]  the one-hot slots, if the caller has them
    x_scale: jax.Array | None = None,  # [X]  the input is x_scale * x (``reference``)
) -> tuple[jax.Array, ...]:  # n x [T, O_i]
    """The n LoRA terms on the path ``choose`` picks (a call the kernel does not take, by
    shape or dtype, runs the reference). ``x_scale``: a norm's weight, x its unscaled rows;
    the kernel scales x as it reads it, so XLA need not write the normed rows for it."""
    path, _ = choose(a.shape[0])
    if path != "reference":
        from pallas_kernels.lora import triton

        if x_scale is not None and x_scale.dtype != x.dtype:  # the product takes a 3rd dtype
            x, x_scale = reference.scaled_input(x, x_scale), None
        if triton.unsupported_reason(x, a, bs) is None:
            return _on_the_kernel(x, a, tuple(bs), token_slots, x_scale, path)
    return reference.lora_deltas(x, a, bs, token_slots, mask, x_scale)


def _on_the_kernel(x, a, bs, token_slots, x_scale, path: str) -> tuple[jax.Array, ...]:
    """The call on the kernel's form that ``JAXSERVE_LORA_FORM`` picks."""
    from pallas_kernels.lora import split_k, triton

    interpret = path == "interpret"
    form = env_choice(LORA_FORM_ENV, LORA_FORMS, "two_launch")
    rank = a.shape[1] // len(bs)
    if not triton.one_launch_rank(rank) or x.shape[0] > ONE_LAUNCH_MAX_TOKENS:
        form = "two_launch"
    if form == "split_k":
        return split_k.lora_deltas(x, a, bs, token_slots, x_scale, interpret=interpret)
    config = triton.LoraKernelConfig(fused=form == "fused")
    return triton.lora_deltas(x, a, bs, token_slots, x_scale, config=config, interpret=interpret)


def describe(num_slots: int | None = None) -> str:
    """The start-up log line for ``num_slots`` slots (``--max-loras``), e.g. ``LoRA product:
    Pallas Triton grouped kernel (JAXSERVE_LORA_KERNEL=auto: 16 slots, more than 4)``."""
    path, why = choose(num_slots)
    name = {
        "triton": "Pallas Triton grouped kernel",
        "interpret": "Pallas Triton grouped kernel in interpret mode",
        "reference": f"dense one-hot product over every slot (XLA: {reference.describe_form()})",
    }[path]
    form = env_choice(LORA_FORM_ENV, LORA_FORMS, "two_launch")
    if path != "reference" and form != "two_launch":
        name += f", {form.replace('_', '-')} form ({LORA_FORM_ENV}={form})"
    return f"LoRA product: {name} ({why})"
