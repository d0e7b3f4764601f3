"""A model step compiled for an NVIDIA GPU on a machine without one: XLA's deviceless compile.

The CUDA PJRT plugin compiles for a *compile-only* device described by a target config (the
GPU's facts: SMs, shared memory, bandwidth, compute capability) instead of an attached one. The
optimized HLO it returns says what a step launches on that GPU (its fusions, the kernels' custom
calls, what is written in float32 or copied) without spending device time: count the kernels of
a change before it reaches the GPU, and measure only what the count cannot say.

What differs from the device's own compile: XLA does not autotune without a GPU, so each GEMM
is the Triton fusion its heuristics pick, where the device's autotuner may take cuBLAS (whose
calls cannot absorb element-wise producers or consumers, so a fusion boundary next to a GEMM
can move too). Fusions of element-wise ops, reductions and the kernels' custom calls are XLA's
usual ones. The times are the device's to say.

Needs the CUDA plugin in the environment (no GPU, driver or CUDA libraries):

    python -m pip install "jax-cuda13-plugin==0.11.2" "jax-cuda13-pjrt==0.11.2"

in a virtual environment of its own (``scripts/deviceless_env`` makes ``.venv-deviceless``:
beside the tests' ``.venv`` the plugin would be found by every test process). Then

    .venv-deviceless/bin/python -m benchmarks.probes.step_kernels --deviceless h100 --bucket 16

The kernels' dispatch reads the backend at trace time (``jax.default_backend()``, the device's
compute capability): ``as_gpu`` answers those as the compile-only GPU would, so the step takes
the paths it takes on that GPU (Mosaic GPU attention on Hopper, cuDNN for whole prompts, W8A8
for fp8 weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What XLA's GPU compiler reads of a device (``GpuTargetConfigProto``'s device info)."""

    name: str  # as the driver names it (jax's device_kind)
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    clock_ghz: float
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int


# NVIDIA's published figures for the SXM parts; the H200 differs in memory only.
H100 = GpuFacts(
    name="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    sms=132,
    memory_bytes=80 * 2**30,
    memory_bandwidth=3.35e12,
    l2_bytes=50 * 2**20,
    clock_ghz=1.98,
    shared_memory_per_sm=228 * 1024,
    shared_memory_per_block_optin=227 * 1024,
)
GPUS = {
    "h100": H100,
    "h200": dataclasses.replace(
        H100, name="NVIDIA H200", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12
    ),
}


def target_config(gpu: GpuFacts) -> str:
    """The text-format ``GpuTargetConfigProto`` of ``gpu``."""
    major, minor = gpu.compute_capability
    hopper = "  feature_extension: ACCELERATED_FEATURES\n" if major == 9 else ""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {gpu.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.memory_bandwidth)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
{hopper}  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  device_address_bits: 64
  name: "{gpu.name}"
}}
platform_name: "CUDA"
device_description_str: "{gpu.name}"
"""


@functools.cache
def compile_only_device(gpu: str) -> Any:
    """A compile-only device of the GPU named (``GPUS``'s keys), from the CUDA plugin."""
    from jax.experimental import topologies

    # Before the backends start: the plugin would check the CUDA libraries' versions (none are
    # installed) and try to open a GPU beside the CPU backend.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    facts = GPUS[gpu]
    try:
        topology = topologies.get_topology_desc(
            gpu, "cuda", target_config=target_config(facts), topology="1x1x1"
        )
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise SystemExit(
            f"a deviceless compile needs the CUDA plugin (jax-cuda13-plugin and jax-cuda13-pjrt "
            f"{jax.__version__}; scripts/deviceless_env installs them): {e}"
        ) from e
    return topology.devices[0]


class _AsSeen:
    """The compile-only device with the attributes the dispatchers read of a real one."""

    platform = "gpu"

    def __init__(self, device: Any, facts: GpuFacts) -> None:
        self._device = device
        self.compute_capability = "{}.{}".format(*facts.compute_capability)
        self.core_count = facts.sms

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)


@contextlib.contextmanager
def as_gpu(gpu: str) -> Iterator[Any]:
    """Within: ``jax.default_backend()`` is ``"gpu"`` and ``jax.devices()`` the compile-only
    device of ``gpu``, as the kernels' dispatch reads them at trace time. Yields the device."""
    device = compile_only_device(gpu)
    seen = [_AsSeen(device, GPUS[gpu])]
    saved = {name: getattr(jax, name) for name in ("default_backend", "devices", "device_count")}
    jax.default_backend = lambda: "gpu"  # type: ignore[assignment]
    jax.devices = lambda *args, **kwargs: seen  # type: ignore[assignment]
    jax.device_count = lambda *args, **kwargs: 1  # type: ignore[assignment]
    try:
        yield device
    finally:
        for name, value in saved.items():
            setattr(jax, name, value)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The step to compile: a model directory and what the engine would be started with."""

    model: Path
    tokens: int  # the step's token bucket
    quantization: str | None = None  # fp8 | int8
    kv_cache_dtype: str = "auto"  # auto | fp8
    max_loras: int = 0  # LoRA slots of rank ``max_lora_rank`` (0: off)
    max_lora_rank: int = 16
    whole_prompts: bool = False  # a pooling runner's attention over whole prompts
    num_pages: int = 2048
    page_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256


def step_hlo(spec: StepSpec, gpu: str) -> str:
    """The optimized HLO text of ``spec``'s model step, compiled for ``gpu`` without one."""
    with as_gpu(gpu) as device:
        fn, args, kwargs = _abstract_step(spec, jax.sharding.SingleDeviceSharding(device))
        return fn.lower(*args, **kwargs).compile().as_text()


def _abstract_step(spec: StepSpec, sharding: Any) -> tuple[Any, tuple, dict]:
    """The jitted model step and its arguments' shapes, each placed on ``sharding``."""
    from jaxserve.config import ModelConfig
    from jaxserve.models.batch import Batch
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner.model_weights import abstract_model_weights
    from jaxserve.runner.programs import jitted_model_step
    from jaxserve.runner.step_programs import pack_step

    config: ModelConfig = load_model_config(spec.model)
    dtype = jnp.bfloat16
    weights = abstract_model_weights(config, dtype, _scheme(spec))
    kv_dtype = dtype if spec.kv_cache_dtype == "auto" else jnp.float8_e4m3fn
    kv_cache = [_kv_pages(config, spec, kv_dtype) for _ in range(config.num_layers)]
    kv_scales = None if spec.kv_cache_dtype == "auto" else ((1.0, 1.0),) * config.num_layers
    pages_per_seq = -(-spec.max_model_len // spec.page_size)
    num_seqs = min(spec.tokens, spec.max_num_seqs)
    batch = Batch.padding(spec.tokens, num_seqs, pages_per_seq, spec.num_pages * spec.page_size)
    slots = np.zeros(spec.tokens, np.int32) if spec.max_loras else None
    packed, layout = pack_step(batch, None, slots)
    previous_ids = jax.ShapeDtypeStruct((spec.max_num_seqs,), jnp.int32)
    kwargs = {"lora_weights": _lora_stacks(config, spec, dtype)} if spec.max_loras else {}
    fn = jitted_model_step(config, kv_scales, whole_prompts=_whole_prompts(spec))
    args = (weights, kv_cache, jax.ShapeDtypeStruct(packed.shape, packed.dtype), previous_ids)
    placed = jax.tree.map(lambda a: _placed(a, sharding), (args, kwargs))
    return fn, (*placed[0], layout), placed[1]


def _placed(shape: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)


def _scheme(spec: StepSpec) -> Any:
    """The quantize-on-load scheme, with W8A8 where an fp8 GPU turns it on."""
    from jaxserve.models.quant_scheme import check_device, resolve_scheme

    scheme = resolve_scheme(spec.quantization, spec.model, "dummy")
    if scheme is None:
        return None
    return check_device(scheme, "gpu", "deviceless", 9.0)


def _kv_pages(config: Any, spec: StepSpec, kv_dtype: Any) -> tuple[Any, Any]:
    from jaxserve.models.batch import kv_page_shapes

    k_shape, v_shape = kv_page_shapes(config, spec.num_pages, spec.page_size)
    return jax.ShapeDtypeStruct(k_shape, kv_dtype), jax.ShapeDtypeStruct(v_shape, kv_dtype)


def _lora_stacks(config: Any, spec: StepSpec, dtype: Any) -> Any:
    from jaxserve.models import lora

    shapes = lora.lora_shapes(config, spec.max_loras, spec.max_lora_rank)
    return jax.eval_shape(lambda: lora.zeros(shapes, dtype))


def _whole_prompts(spec: StepSpec) -> Any:
    """A pooling runner's whole-prompt attention (``runner/pooling_attention.py``), or None."""
    if not spec.whole_prompts:
        return None
    from jaxserve.models.decoder import WholePromptAttention
    from jaxserve.runner.buckets import next_power_of_2
    from jaxserve.runner.pooling_attention import causal_prompt_attention
    from jaxserve.runner.segment_attention import segment_attention_form

    implementation, _ = segment_attention_form(jnp.bfloat16)
    attend = functools.partial(
        causal_prompt_attention,
        implementation=implementation,
        tile=next_power_of_2(spec.max_model_len),
    )
    return WholePromptAttention(jax.jit(attend, static_argnames=("sm_scale",)))
