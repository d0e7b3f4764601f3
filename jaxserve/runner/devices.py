"""What the runner runs on, in the start-up log's words: devices, model and dtype, attention path.

``ModelRunner`` logs ``startup_lines`` before it loads the weights, so the first lines of a
start say where the model runs and how. ``quiet_backend_probe`` keeps JAX's backend probe out of
the default log: JAX tries every backend it knows and logs, at INFO, ``Unable to initialize
backend 'tpu'`` on every GPU and CPU host, which reads like an error but is not one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig, kv_cache_dtype_name, weight_dtype
from jaxserve.models.families.counting import num_params
from jaxserve.models.kv_scales import FP8_KV_DTYPES
from jaxserve.models.loading.orbax_checkpoint import (
    Manifest,
    is_converted_checkpoint,
    read_manifest,
    served_dtype,
    served_quantization,
)
from jaxserve.models.quant import INVARIANT_ROW_TILE
from jaxserve.models.quant_scheme import (
    FP8_MIN_COMPUTE_CAPABILITY,
    QuantScheme,
    check_device,
    resolve_scheme,
)
from jaxserve.runner.capacity import kv_heads_per_device
from jaxserve.runner.programs import describe_fp8_compile
from pallas_kernels.fp8_matmul import dispatch as fp8_dispatch
from pallas_kernels.grouped_matmul.dispatch import GROUPED_MATMUL_NAMES, choose_grouped_matmul
from pallas_kernels.lora import dispatch as lora_dispatch
from pallas_kernels.mla import dispatch as mla_dispatch
from pallas_kernels.qk_norm_rope import dispatch as qk_dispatch
from pallas_kernels.ragged_paged_attention.dispatch import KERNEL_NAMES, choose_kernel
from pallas_kernels.skinny_matmul import dispatch as skinny_dispatch
from pallas_kernels.swiglu_matmul import dispatch as swiglu_dispatch

_LOG = logging.getLogger(__name__)
_PROBE_LOGGER = "jax._src.xla_bridge"
_PROBE_MESSAGE = "Unable to initialize backend"


class _BackendProbeFilter(logging.Filter):
    """Turns JAX's failed-backend-probe records into DEBUG records (shown only at debug level)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and record.getMessage().startswith(_PROBE_MESSAGE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_backend_probe() -> None:
    """Log JAX's ``Unable to initialize backend ...`` at DEBUG; call before the backend starts."""
    logger = logging.getLogger(_PROBE_LOGGER)
    if not any(isinstance(f, _BackendProbeFilter) for f in logger.filters):
        logger.addFilter(_BackendProbeFilter())


def start_backend() -> None:
    """Start JAX's backend (its first device query does) and log how long that took: on a GPU
    it creates the client and takes the memory ``reserve_device_memory`` allows."""
    started = time.perf_counter()
    devices = jax.devices()
    _LOG.info(
        "Started the %s backend (%d x %s) in %.1f s",
        platform_name(devices[0]),
        len(devices),
        devices[0].device_kind,
        time.perf_counter() - started,
    )


def resolve_dtype(config: EngineConfig) -> jnp.dtype:
    """``auto``: bfloat16 on accelerators, float32 on the CPU (``weight_dtype``); of a converted
    checkpoint, its own (another ``--dtype`` raises ``ConvertedCheckpointError``)."""
    converted = converted_manifest(config)
    if converted is not None:
        return jnp.dtype(served_dtype(converted, config.model_dir, config.dtype))
    return jnp.dtype(weight_dtype(config.dtype, on_cpu=jax.default_backend() == "cpu"))


def converted_manifest(config: EngineConfig) -> Manifest | None:
    """The manifest of a checkpoint ``jaxserve convert`` wrote, when the model is one."""
    if config.load_format == "dummy" or not is_converted_checkpoint(config.model_dir):
        return None
    return read_manifest(config.model_dir)


def resolve_quantization(config: EngineConfig) -> QuantScheme | None:
    """The quantization served (``--quantization`` or the checkpoint's), checked against the
    first device: fp8 on a GPU without fp8 raises ``QuantizationError``; fp8 GPUs get W8A8."""
    quantization = config.quantization
    converted = converted_manifest(config)
    if converted is not None:  # quantized on conversion: as a quantize-on-load scheme
        quantization = served_quantization(converted, config.model_dir, quantization)
    scheme = resolve_scheme(quantization, config.model_dir, config.load_format)
    return None if scheme is None else on_first_device(scheme)


def resolve_drafter_quantization(
    quantization: str | None, model_dir: str | os.PathLike[str]
) -> QuantScheme | None:
    """A speculative drafter's quantization (``speculative_config``'s ``quantization``, or
    its checkpoint's), checked against the first device as the target's is."""
    scheme = resolve_scheme(quantization, Path(model_dir))
    return None if scheme is None else on_first_device(scheme)


def on_first_device(scheme: QuantScheme) -> QuantScheme:
    """``scheme`` as the first device runs it (``check_device``: W8A8 on fp8 GPUs)."""
    device = jax.devices()[0]
    return check_device(scheme, device.platform, device.device_kind, compute_capability(device))


def compute_capability(device: jax.Device) -> float | None:
    """An NVIDIA GPU's compute capability ("9.0") as a number; None for other devices (ROCm
    names an architecture, "gfx942")."""
    try:
        return float(getattr(device, "compute_capability", None) or "")
    except ValueError:
        return None


class DeviceSupportError(ValueError):
    """The device cannot run what the configuration asks for (names both)."""


def has_fp8(device: jax.Device) -> bool:
    """Whether the device stores and converts fp8 (CPUs and TPUs through XLA; NVIDIA GPUs
    from compute capability 8.9)."""
    if device.platform != "gpu":
        return True
    capability = compute_capability(device)  # None (ROCm): not supported
    return capability is not None and capability >= FP8_MIN_COMPUTE_CAPABILITY


def resolve_kv_dtype(config: EngineConfig, dtype: jnp.dtype) -> jnp.dtype:
    """The KV cache's dtype: ``auto`` the weights' ``dtype``, ``fp8`` e4m3, ``fp8_e5m2`` e5m2.

    fp8 on a device without it is a ``DeviceSupportError`` naming the device and the dtype,
    never a silent bf16 cache."""
    name = kv_cache_dtype_name(config.kv_cache_dtype, jnp.dtype(dtype).name)
    if name not in FP8_KV_DTYPES:
        return jnp.dtype(dtype)
    device = jax.devices()[0]
    if not has_fp8(device):
        capability = getattr(device, "compute_capability", "unknown")
        raise DeviceSupportError(
            f"--kv-cache-dtype {config.kv_cache_dtype} ({name}) needs fp8 support: an NVIDIA "
            "GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{device.device_kind} has compute capability {capability}. Use --kv-cache-dtype "
            "auto on this device"
        )
    return FP8_KV_DTYPES[name]


def platform_name(device: jax.Device) -> str:
    """``cuda``, ``rocm``, ``tpu`` or ``cpu``."""
    if device.platform != "gpu":
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def describe_devices(tensor_parallel_size: int) -> str:
    """``Devices: 1 x NVIDIA H200 (cuda)``; ``Devices: 8 x cpu, tensor parallel over 8``."""
    devices = jax.devices()
    first = devices[0]
    kind, platform = first.device_kind, platform_name(first)
    line = f"Devices: {len(devices)} x {kind}"
    if kind.lower() != platform:
        line += f" ({platform})"
    if tensor_parallel_size > 1:
        line += f", tensor parallel over {tensor_parallel_size}"
    elif len(devices) > 1:
        line += ", the model runs on the first"
    return line


def describe_model(
    model_config: ModelConfig, config: EngineConfig, dtype: jnp.dtype, max_model_len: int
) -> str:
    """``Model: DIR (llama, 4 layers, 8.4M parameters), dtype float32 (auto: ...), ...``."""
    params = num_params(model_config)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    if config.dtype == "auto" and converted_manifest(config) is not None:
        why = "auto: the converted checkpoint's"
    elif config.dtype == "auto":
        on_cpu = jax.default_backend() == "cpu"
        why = "auto: float32 on the CPU" if on_cpu else "auto: bfloat16 on accelerators"
    else:
        why = "--dtype"
    weights = "random weights (--load-format dummy)" if config.load_format == "dummy" else None
    num_layers = model_config.num_layers
    layers = f"{num_layers} layer{'' if num_layers == 1 else 's'}"
    return (
        f"Model: {config.model_dir} ({model_config.model_type}, {layers}, {size} parameters"
        f"{', ' + weights if weights else ''}), dtype {jnp.dtype(dtype).name} ({why}), "
        f"max model len {max_model_len:,}"
    )


def describe_attention(
    model_config: ModelConfig,
    dtype: jnp.dtype,
    block_size: int,
    tensor_parallel_size: int,
    kv_dtype: jnp.dtype | None = None,  # the cache's; None: dtype
) -> str:
    """``Attention: Pallas Mosaic GPU kernel``; or the path taken instead (the Pallas Triton
    kernel below Hopper, the reference) and why, e.g. ``Attention: Pallas Triton kernel (the
    Mosaic GPU kernel needs Hopper or newer (compute capability 9.0); this GPU has 8.0)``."""
    num_q_heads = max(1, model_config.num_q_heads // tensor_parallel_size)  # per device
    mla = model_config.mla
    if mla is not None:
        return mla_dispatch.describe(
            num_q_heads,
            mla.kv_lora_rank,
            mla.qk_rope_head_dim,
            dtype,
            kv_dtype or dtype,
            tensor_parallel_size,
        )
    num_kv_heads = kv_heads_per_device(model_config.num_kv_heads, tensor_parallel_size)
    head_dim = model_config.head_dim
    q = jax.ShapeDtypeStruct((1, num_q_heads, head_dim), dtype)
    k_pages = jax.ShapeDtypeStruct((1, block_size, num_kv_heads, head_dim), kv_dtype or dtype)
    kernel, reason = choose_kernel(q, k_pages)
    line = f"Attention: {KERNEL_NAMES[kernel]}"
    return f"{line} ({reason})" if reason else line


def describe_batch_invariance() -> str:
    """The start-up log's line for ``--batch-invariant``."""
    return (
        f"Batch-invariant mode: on (each sequence's logits bitwise independent of its batch "
        f"and chunking; GEMMs in {INVARIANT_ROW_TILE}-row tiles, attention unsplit)"
    )


def describe_experts(
    model_config: ModelConfig, config: EngineConfig, dtype: jnp.dtype = jnp.bfloat16
) -> str | None:
    """``Experts: 128, 8 per token (Pallas Triton grouped matmul), expert parallel over 4``
    (``jax.lax.ragged_dot`` on TPU and CPU, and why when the backend's first choice is not
    taken); None for a dense model."""
    moe = model_config.moe
    if moe is None:
        return None
    hidden, inner = model_config.hidden_size, moe.intermediate_size
    path, reason = choose_grouped_matmul(
        jax.ShapeDtypeStruct((1, hidden), dtype),
        jax.ShapeDtypeStruct((moe.num_experts, hidden, inner), dtype),
    )
    how = GROUPED_MATMUL_NAMES[path] + (f": {reason}" if reason else "")
    line = f"Experts: {moe.num_experts}, {moe.top_k} per token ({how})"
    if moe.shared_intermediate_size:
        line += ", a shared expert"
    tp = config.tensor_parallel_size
    if tp > 1:
        how = "expert parallel" if config.enable_expert_parallel else "each split"
        line += f", {how} over {tp}"
    return line


def uses_compact_samplers(config: EngineConfig) -> bool:
    """``sampler_variants`` resolved: "auto" is compact on the CPU backend."""
    if config.sampler_variants == "auto":
        return jax.default_backend() == "cpu"
    return config.sampler_variants == "compact"


def describe_samplers(config: EngineConfig) -> str:
    """``Sampler: 3 variants per sequence bucket (compact ...)``, or all 20."""
    if uses_compact_samplers(config):
        return (
            "Sampler: 3 programs per sequence bucket (greedy, plain sampling, everything: "
            "--sampler-variants compact)"
        )
    return "Sampler: 20 programs per sequence bucket, each doing what its batch needs"


def startup_lines(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: jnp.dtype,
    max_model_len: int,
    quant: QuantScheme | None = None,
    kv_dtype: jnp.dtype | None = None,
) -> list[str]:
    tp = config.tensor_parallel_size
    experts = describe_experts(model_config, config, dtype)
    lines = [
        describe_devices(tp),
        describe_model(model_config, config, dtype, max_model_len),
        describe_attention(model_config, dtype, config.block_size, tp, kv_dtype),
        skinny_dispatch.describe(),
        *([fp8_dispatch.describe()] if _per_channel_fp8(quant) else []),
        *([swiglu_dispatch.describe()] if _swiglu_kernel_may_run(model_config, quant) else []),
        *([qk_dispatch.describe()] if model_config.qk_norm else []),
        *([describe_fp8_compile()] if _fp8_on_gpu(quant) else []),
        describe_samplers(config),
        *([experts] if experts else []),
        *([describe_batch_invariance()] if config.batch_invariant else []),
        *([lora_dispatch.describe(config.max_loras)] if config.enable_lora else []),
    ]
    return lines + ([quant.describe()] if quant is not None else [])


def _swiglu_kernel_may_run(model_config: ModelConfig, quant: QuantScheme | None) -> bool:
    """A dense SwiGLU MLP over unquantized weights, with the SwiGLU kernel not switched off:
    the start-up log names its path (``JAXSERVE_SWIGLU_MATMUL``)."""
    asked = swiglu_dispatch.requested() != "off"
    return asked and model_config.hidden_act == "silu" and quant is None


def _fp8_on_gpu(quant: QuantScheme | None) -> bool:
    """fp8 weights on a GPU: their programs compile under ``describe_fp8_compile``'s options."""
    return quant is not None and quant.weight_format == "fp8" and jax.default_backend() == "gpu"


def _per_channel_fp8(quant: QuantScheme | None) -> bool:
    """Weights the fp8-matmul kernel can read: fp8 with one scale per output channel."""
    return quant is not None and quant.weight_format == "fp8" and quant.group_size is None
