"""When the MLP's gate/up GEMM applies SwiGLU in its epilogue (``mosaic_gpu``), read at trace
time.

``choose`` says, from ``JAXSERVE_SWIGLU_MATMUL`` and the device, how this process's dense MLPs
multiply by their fused gate/up weight: ``auto`` (the default: the Mosaic GPU kernel on a
process of one Hopper GPU, for steps of at least ``MIN_TOKENS`` tokens over a hidden size of at
most ``AUTO_MAX_K``), ``off`` (XLA's GEMM, then SwiGLU as a pass of its own), ``on`` (the
kernel wherever: natively on a GPU, in Pallas interpret mode elsewhere, for tests). Several
devices a model keep XLA's path (the fused weight's columns split over them). ``takes``
answers for one call's shapes (static: the step's bucket), ``describe`` writes the start-up log
line. ``JAXSERVE_GELU_MATMUL`` does the same for an encoder's intermediate GEMM.

Measured on an H100 (benchmarks/RESULTS.md, 2026-12-07): at the Qwen3-Embedding-0.6B MLP (K =
1,024, 16,384 rows) the kernel takes 0.300 ms against XLA's GEMM and pass 0.370 (0.040 against
0.054 at 128 rows); at Llama-3-8B's (K = 4,096, 2,048 rows) 0.726 against 0.680: there the pass
is 9% of XLA's GEMM (0.057 of 0.623 ms) and the kernel runs at 86% of XLA's GEMM speed. The
pass's share of the GEMM falls as 1 / K (it reads and writes the product once; the GEMM does
2 K FLOPs an element), about 0.35 x 1,024 / K, so ``auto`` takes the kernel up to K = 2,048.
BGE-large's GELU (K = 1,024): 0.278 ms against 0.297.
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.env_choice import devices_per_model, env_choice
from pallas_kernels.swiglu_matmul import mosaic_gpu

SWIGLU_ENV = "JAXSERVE_SWIGLU_MATMUL"
GELU_ENV = "JAXSERVE_GELU_MATMUL"  # an encoder's intermediate GEMM, its bias and exact GELU
SWIGLU_CHOICES = ("off", "auto", "on")
_NAMES = {  # switch -> (the activation, the GEMM it rides on)
    SWIGLU_ENV: ("SwiGLU", "gate/up GEMM"),
    GELU_ENV: ("GELU", "intermediate GEMM (bias and exact GELU)"),
}
MIN_TOKENS = 128  # ``auto``: the steps whose pass costs more than a launch (prefill, pooling)
AUTO_MAX_K = 2048  # ``auto``: the hidden sizes where the pass costs a sixth of the GEMM or more
# The persistent, warp-specialized form where the rows fill its tiles of 2 x 128, else the
# simple form (``mosaic_gpu``'s module docstring)
CONFIGS = (
    mosaic_gpu.SwigluMatmulConfig(warp_specialized=True),
    mosaic_gpu.SwigluMatmulConfig(),
)
# ``JAXSERVE_EPILOGUE_SCHEDULE``: how the persistent form's two compute warpgroups share the
# work: ``cooperative`` (the default until the other is timed: both on each tile, their
# epilogues together while the tensor cores wait) or ``pingpong`` (each its own tile in turn,
# one's epilogue beside the other's products).
SCHEDULE_ENV = "JAXSERVE_EPILOGUE_SCHEDULE"
SCHEDULES = ("cooperative", "pingpong")


def schedule() -> str:
    return env_choice(SCHEDULE_ENV, SCHEDULES, "cooperative")


def configs() -> tuple[mosaic_gpu.SwigluMatmulConfig, ...]:
    """The SwiGLU kernel's configs in order of preference, for this process's schedule."""
    if schedule() == "pingpong":
        return (mosaic_gpu.SWIGLU_PINGPONG_CONFIG, *CONFIGS)
    return CONFIGS


def gelu_config() -> mosaic_gpu.SwigluMatmulConfig:
    """The GELU kernel's config for this process's schedule."""
    if schedule() == "pingpong":
        return mosaic_gpu.GELU_PINGPONG_CONFIG
    return mosaic_gpu.GELU_CONFIG


def requested(env: str = SWIGLU_ENV) -> str:
    """``JAXSERVE_SWIGLU_MATMUL`` or ``JAXSERVE_GELU_MATMUL`` (default ``auto``), validated."""
    return env_choice(env, SWIGLU_CHOICES, "auto")


def choose(env: str = SWIGLU_ENV) -> tuple[str, str]:
    """``("mosaic_gpu" | "interpret" | "xla", why)``: how dense MLPs meet their gate/up weight
    (``env``: how encoders meet their intermediate weight) in this process."""
    value, backend = requested(env), jax.default_backend()
    if value == "off":
        return "xla", f"{env}=off"
    if devices_per_model() > 1:
        return "xla", f"{devices_per_model()} devices a model: the kernel is not partitioned"
    if value == "on":
        if backend == "gpu":
            return "mosaic_gpu", f"{env}=on"
        return "interpret", f"{env}=on, Pallas interpret mode on the {backend} backend"
    if backend != "gpu":
        return "xla", f"the kernel is Mosaic GPU; this is the {backend} backend"
    capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
    if not capability.startswith("9"):
        return "xla", f"compute capability {capability}: the kernel's wgmma is Hopper's (9.x)"
    return "mosaic_gpu", f"{env}=auto"


def takes(x: Any, w: Any) -> str | None:
    """The kernel's mode (``"mosaic_gpu"`` or ``"interpret"``) for ``x [T, K] @ w [K, 2N]``,
    or None for XLA's GEMM and pass: where ``choose`` says so, the shapes do not fit, or
    (``auto``) outside ``auto_fits``."""
    path, _ = choose()
    if path == "xla":
        return None
    if requested() == "auto" and not auto_fits(x):
        return None
    if config_for(x, w) is None:
        return None
    return path


def auto_fits(x: Any) -> bool:
    """``auto``'s rule for ``x [T, K]``: at least ``MIN_TOKENS`` rows, K at most
    ``AUTO_MAX_K``."""
    return x.shape[0] >= MIN_TOKENS and x.shape[1] <= AUTO_MAX_K


def config_for(x: Any, w: Any) -> mosaic_gpu.SwigluMatmulConfig | None:
    """The first of ``configs()`` that takes these shapes, or None."""
    fits = (c for c in configs() if mosaic_gpu.unsupported_reason(x, w, c) is None)
    return next(fits, None)


def swiglu_matmul(x: jax.Array, w: jax.Array, mode: str) -> jax.Array:
    """``silu(x @ w_gate) * (x @ w_up)`` on the kernel, in ``mode`` (``takes``'s answer)."""
    config = config_for(x, w)
    assert config is not None, "takes() answered for these shapes"
    return mosaic_gpu.swiglu_matmul(x, w, config=config, interpret=mode == "interpret")


def describe(env: str = SWIGLU_ENV) -> str:
    """The start-up log line, e.g. ``SwiGLU: XLA's gate/up GEMM, then a pass of its own
    (JAXSERVE_SWIGLU_MATMUL=off)``."""
    (name, gemm), (path, why) = _NAMES[env], choose(env)
    if path == "xla":
        return f"{name}: XLA's {gemm}, then a pass of its own ({why})"
    mode = "Pallas Mosaic GPU kernel" + (" in interpret mode" if path == "interpret" else "")
    auto = requested(env) == "auto"
    steps = (
        f"steps of at least {MIN_TOKENS} tokens and a hidden size of at most {AUTO_MAX_K}"
        if auto
        else "every step"
    )
    return f"{name}: in the {gemm}'s epilogue on the {mode}, {steps} where its tiles fit ({why})"


def gelu_takes(x: Any, w: Any, b: Any) -> str | None:
    """``takes`` for an encoder's ``gelu(x [T, H] @ w [H, I] + b)`` (``JAXSERVE_GELU_MATMUL``):
    the kernel's mode, or None for XLA's GEMM and GELU pass."""
    path, _ = choose(GELU_ENV)
    if path == "xla" or (requested(GELU_ENV) == "auto" and not auto_fits(x)):
        return None
    config = gelu_config()
    if mosaic_gpu.unsupported_reason(x, w, config, views=1) is not None or b.dtype != x.dtype:
        return None
    return path


def gelu_matmul(x: jax.Array, w: jax.Array, b: jax.Array, mode: str) -> jax.Array:
    """``gelu(x @ w + b)`` (exact GELU) on the kernel, in ``mode`` (``gelu_takes``'s answer)."""
    return mosaic_gpu.gelu_matmul(x, w, b, config=gelu_config(), interpret=mode == "interpret")
