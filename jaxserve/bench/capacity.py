"""``jaxserve capacity``: how many tokens of KV cache fit, without loading weights.

Reads only ``config.json`` and prints what ``jaxserve launch`` would log at start-up (weight
memory, KV bytes per token, blocks, tokens, maximum concurrency at full context), from the same
function (``jaxserve.runner.capacity.plan_capacity``), for the current device or a named one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

from jaxserve.config import ModelConfig
from jaxserve.engine_config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    SpeculativeConfig,
    default_model_dir,
    dtype_name,
    kv_cache_dtype_name,
    sample_rows,
    weight_dtype,
)
from jaxserve.flag_names import command_flags, in_flag_terms
from jaxserve.hf_cache import resolve_model_dir
from jaxserve.models.families.counting import num_active_params, num_params
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.quant_scheme import QuantScheme, resolve_scheme
from jaxserve.runner.batch_size import BatchSize, ceiling_for, planned_batch_size
from jaxserve.runner.buckets import next_power_of_2, token_buckets_for
from jaxserve.runner.capacity import (
    CPU_DEVICE_MEMORY_BYTES,
    DEVICE_MEMORY_BYTES,
    MLA_PATH,
    Capacity,
    CapacityError,
    GiB,
    choose_mla_path,
    data_parallel_lines,
    detect_device_memory,
    plan_capacity,
)
from jaxserve.runner.drafter_plan import planned_drafter_bytes
from jaxserve.units import COUNT_RULE, human_bytes, human_count, human_int

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Flag defaults are EngineConfig's, as in `jaxserve launch`, so the two plan alike.
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


class DeviceBytes(int):
    """A device's memory in bytes, and the device it was named by (``H200``), if it was."""

    device: str | None = None


def parse_memory(text: str) -> int:
    """'H200', '141GB', '80 GiB', '16G', '17179869184' -> bytes (a ``DeviceBytes`` that keeps
    the device's name when one was given)."""
    for name, size in DEVICE_MEMORY_BYTES.items():
        if text.strip().lower() == name.lower():
            named = DeviceBytes(size)
            named.device = name
            return named
    try:
        return human_bytes(text)
    except argparse.ArgumentTypeError:
        names = ", ".join(DEVICE_MEMORY_BYTES)
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a size like 141GB / 80GiB or a device: {names}"
        ) from None


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "model",
        nargs="?",
        default=None,
        help="model directory with config.json, or a model id (org/name) in the local Hugging "
        "Face cache (default: the demo model)",
    )
    add(
        "--max-model-len",
        type=human_int,
        default=None,
        help=f"context per request ({COUNT_RULE}: lowercase k is 1,000 and uppercase K is "
        "1,024, as in vLLM); default: the model's maximum",
    )
    add(
        "--gpu-memory-utilization",
        "--memory-utilization",
        type=float,
        default=_ENGINE_DEFAULTS["gpu_memory_utilization"],
        dest="memory_utilization",
        metavar="FRACTION",
        help="fraction of device memory for weights + KV cache",
    )
    add(
        "--device-memory",
        type=parse_memory,
        default=None,
        help="device memory as a size (141GB, 80GiB) or a device "
        f"({', '.join(DEVICE_MEMORY_BYTES)}); default: the current device",
    )
    add(
        "--dtype",
        type=dtype_name,
        default=_ENGINE_DEFAULTS["dtype"],
        choices=DTYPES,
        help="weight dtype; auto is what serve uses: bfloat16 on accelerators, float32 on the CPU",
    )
    add(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8 or int8 weights quantized on load, as serve's flag; default: the "
        "checkpoint's quantization_config, else none",
    )
    add(
        "--kv-cache-dtype",
        default=_ENGINE_DEFAULTS["kv_cache_dtype"],
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype, as serve takes it: auto = the weight dtype; fp8 (= fp8_e4m3) "
        "and fp8_e5m2 take one byte per element",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_ENGINE_DEFAULTS["tensor_parallel_size"],
        help="devices per model replica: each holds 1/N of the weights and KV heads",
    )
    add(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=_ENGINE_DEFAULTS["data_parallel_size"],
        help="model replicas on one host, as serve's flag: each has its own KV cache of the "
        "size printed, on its own --tensor-parallel-size devices",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts split whole over the devices, as serve's flag (sizes the "
        "experts' share of the headroom)",
    )
    add(
        "--block-size",
        type=int,
        default=_ENGINE_DEFAULTS["block_size"],
        help="tokens per KV-cache block",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=_ENGINE_DEFAULTS["max_num_seqs"],
        help="sequences in one step at most (sizes the sampler's share of the headroom); "
        "default: the device's, as launch picks it (printed)",
    )
    add(
        "--max-num-batched-tokens",
        type=human_int,
        default=_ENGINE_DEFAULTS["max_num_batched_tokens"],
        help="tokens in one step at most (sizes the activation headroom)",
    )
    add(
        "--enable-lora",
        action="store_true",
        help="count the LoRA adapter slots' memory, as serve's flag (docs/lora.md)",
    )
    add(
        "--max-loras",
        type=int,
        default=_ENGINE_DEFAULTS["max_loras"],
        help="adapter slots on the device, with --enable-lora",
    )
    add(
        "--max-lora-rank",
        type=int,
        default=_ENGINE_DEFAULTS["max_lora_rank"],
        help="the slots' rank, with --enable-lora: each slot holds A [in, rank] and "
        "B [rank, out] of every projection",
    )
    add(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='the drafter, as serve\'s flag (e.g. \'{"method": "eagle3", "model": "DIR"}\'): '
        "a model drafter's weights, pages and kept target states come out of the KV cache's "
        "budget (docs/speculative_decoding.md)",
    )
    add("--json", action="store_true", help="print the numbers as JSON")


def run_capacity(args: argparse.Namespace) -> int:
    try:
        model_dir, config = _checked_model(args)
    except ValueError as exc:
        print(
            f"error: {in_flag_terms(str(exc), command_flags(add_capacity_arguments))}",
            file=sys.stderr,
        )
        return 2
    max_model_len = args.max_model_len or config.max_position_embeddings
    try:
        quant = resolve_scheme(args.quantization, model_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    memory, on_cpu = _device_memory(args)
    dtype = weight_dtype(args.dtype, on_cpu)
    kv_dtype = kv_cache_dtype_name(args.kv_cache_dtype, dtype)
    plan_for = functools.partial(
        _plan_for, args, config, max_model_len, memory, dtype, quant, kv_dtype
    )
    batch = None  # the default --max-num-seqs, when the flag is not given
    max_num_seqs = args.max_num_seqs
    try:
        if max_num_seqs is None:
            batch = planned_batch_size(
                lambda n: plan_for(n).num_tokens,
                ceiling=ceiling_for(*_device_kind(args), memory),
                max_model_len=max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            max_num_seqs = batch.max_num_seqs
        cap = _with_drafter(
            args, plan_for(max_num_seqs), config, model_dir, dtype, max_model_len, max_num_seqs
        )
    except CapacityError as exc:
        _print_capacity_error(exc, on_cpu)
        return 1
    except (ValueError, WeightsError) as exc:  # LoRA on latent attention; a drafter's files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if on_cpu:
        print(
            "No accelerator found: JAX sees only the CPU, so this plans as `jaxserve launch` "
            f"would run here ({CPU_DEVICE_MEMORY_BYTES / GiB:.2f} GiB, {dtype} weights). To plan "
            "for a device, pass --device-memory H200 (or a size such as 80GB).",
            file=sys.stderr,
        )
    plan = _Plan(
        model_dir, config, memory, on_cpu, dtype, quant, kv_dtype, cap, max_num_seqs, batch
    )
    if args.json:
        print(json.dumps(_plan_json(args, plan), indent=2))
        return 0
    _print_plan(args, plan)
    return 0


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What ``run_capacity`` planned, for the JSON or the lines that print it."""

    model_dir: Path
    config: ModelConfig
    memory: int  # device bytes planned for
    on_cpu: bool
    dtype: str  # the weights' dtype name
    quant: QuantScheme | None
    kv_dtype: str
    cap: Capacity
    max_num_seqs: int  # planned for: the flag's, or the default (batch)
    batch: BatchSize | None  # the default's reason; None: the flag was given


def _checked_model(args: argparse.Namespace) -> tuple[Path, ModelConfig]:
    """The checks serve makes of the same flags, then the model's directory and config (a
    ValueError names what is wrong)."""
    EngineConfig(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        speculative_config=args.speculative_config,
    )
    model_dir = resolve_model_dir(args.model) if args.model else default_model_dir()
    return model_dir, load_model_config(model_dir)


def _plan_for(
    args: argparse.Namespace,
    config: ModelConfig,
    max_model_len: int,
    memory: int,
    dtype: str,
    quant: QuantScheme | None,
    kv_dtype: str,
    max_num_seqs: int,
) -> Capacity:
    """``plan_capacity`` of the flags, with ``max_num_seqs`` sequences a step (and their
    drafts' sampler rows with ``--speculative-config``, as the engine sizes them)."""
    spec = SpeculativeConfig.of(args.speculative_config) if args.speculative_config else None
    return plan_capacity(
        config,
        max_model_len=max_model_len,
        device_memory_bytes=memory,
        memory_utilization=args.memory_utilization,
        dtype_bytes=DTYPE_BYTES[dtype],
        quant=quant,
        kv_cache_dtype=kv_dtype,
        block_size=args.block_size,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=token_buckets_for(args.max_num_batched_tokens)[-1],
        max_num_seqs=next_power_of_2(sample_rows(max_num_seqs, spec)),
        expert_parallel=args.enable_expert_parallel,
        reference_attention=_plans_attention_reference(args, config, dtype),
        mla_path=_planned_mla_path(args, config, dtype, kv_dtype),
        lora_slots=(args.max_loras, args.max_lora_rank) if args.enable_lora else None,
    )


def _with_drafter(
    args: argparse.Namespace,
    cap: Capacity,
    config: ModelConfig,
    model_dir: Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
) -> Capacity:
    """``cap`` less the speculative drafter's memory (``planned_drafter_bytes``: what the
    engine measures once it loads and takes out of the KV cache's budget), if one is named."""
    if args.speculative_config is None:
        return cap
    spec = SpeculativeConfig.of(args.speculative_config)
    num_bytes = planned_drafter_bytes(
        spec,
        config,
        model_dir,
        dtype_bytes=DTYPE_BYTES[dtype],
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if num_bytes == 0:
        return cap
    return cap.with_drafter(num_bytes, spec.drafter)


def _device_kind(args: argparse.Namespace) -> tuple[str, str]:
    """``(platform, device kind)`` planned for: a named device's (``--device-memory H200``), a
    GPU's for a size alone, else the first device's."""
    if args.device_memory is not None:
        name = getattr(args.device_memory, "device", None) or ""
        return ("tpu" if name.startswith("TPU") else "gpu"), name
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read, do not take
    import jax

    device = jax.devices()[0]
    return device.platform, device.device_kind


def _device_memory(args: argparse.Namespace) -> tuple[int, bool]:
    """The device bytes to plan for, and whether JAX sees only the CPU."""
    if args.device_memory is not None:
        return args.device_memory, False  # a device of that size
    # Reading the device's size must not take its memory (a server may be running on it).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    return detect_device_memory(), jax.default_backend() == "cpu"


def _plans_attention_reference(args: argparse.Namespace, config: ModelConfig, dtype: str) -> bool:
    """Whether the plan reserves the jnp attention reference's temporaries: not for a named
    device (H200, TPU-v5p, ...: its Pallas kernels run attention), else where this backend
    takes the reference (the CPU), as ``launch`` would here. Latent attention is planned
    apart (``mla_attention_bytes``)."""
    if config.mla is not None or args.device_memory in DEVICE_MEMORY_BYTES.values():
        return False
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read, do not take
    import jax.numpy as jnp

    from jaxserve.runner.capacity import runs_attention_reference

    return runs_attention_reference(
        config, jnp.dtype(dtype), jnp.dtype(dtype), args.block_size, args.tensor_parallel_size
    )


def _planned_mla_path(
    args: argparse.Namespace, config: ModelConfig, dtype: str, kv_dtype: str
) -> str:
    """The latent attention's path the plan reserves for (``MLA_TEMPORARY_BYTES``): a named
    device's (an NVIDIA GPU runs the Pallas Triton MLA kernel, a TPU the Mosaic TPU one), else
    this backend's, as ``launch`` would take it here (the reference on the CPU)."""
    if config.mla is None:
        return MLA_PATH
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read, do not take
    import jax.numpy as jnp

    backend = None  # this process's
    named = getattr(args.device_memory, "device", None)  # --device-memory H200, TPU-v5p, ...
    if named is not None:
        backend = "tpu" if named.startswith("TPU") else "gpu"
    fp8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
    kv = jnp.dtype(fp8.get(kv_dtype, kv_dtype))
    tp = args.tensor_parallel_size
    return choose_mla_path(config, jnp.dtype(dtype), kv, tp, backend)


def _print_capacity_error(exc: CapacityError, on_cpu: bool) -> None:
    if on_cpu:
        print(
            "error: no accelerator found (JAX sees only the CPU). To plan for a device, "
            f"pass --device-memory H200 (or any size, such as 80GB). On the CPU: {exc}",
            file=sys.stderr,
        )
    else:
        print(f"error: {exc}", file=sys.stderr)


def _plan_json(args: argparse.Namespace, plan: _Plan) -> dict:
    cap = plan.cap
    return {
        "model": str(plan.model_dir),
        "device_memory_bytes": plan.memory,
        "accelerator": not plan.on_cpu,
        "memory_utilization": args.memory_utilization,
        "dtype": plan.dtype,
        "quantization": plan.quant.method if plan.quant is not None else None,
        "kv_cache_dtype": plan.kv_dtype,
        "weight_bytes": cap.weight_bytes,
        "lora_bytes": cap.lora_bytes,
        "drafter_bytes": cap.drafter_bytes,
        "activation_bytes": cap.activation_bytes,
        "mla_temporary_bytes": cap.mla_bytes,
        "mla_path": cap.mla_path,
        "reference_attention_bytes": cap.reference_attention_bytes,
        "kv_budget_bytes": cap.kv_budget_bytes,
        "kv_bytes_per_token": cap.kv_bytes_per_token,
        "block_size": cap.block_size,
        "num_blocks": cap.num_blocks,
        "kv_cache_tokens": cap.num_tokens,
        "max_model_len": cap.max_model_len,
        "max_concurrency": cap.max_concurrency,
        "max_num_seqs": plan.max_num_seqs,
        "max_num_seqs_reason": "--max-num-seqs" if plan.batch is None else plan.batch.reason,
        "data_parallel_size": args.data_parallel_size,
        "kv_cache_tokens_all_replicas": args.data_parallel_size * cap.num_tokens,
        "max_concurrency_all_replicas": args.data_parallel_size * cap.max_concurrency,
        "num_params": num_params(plan.config),
        "num_active_params": num_active_params(plan.config),
    }


def _quantized_words(plan: _Plan) -> str:
    """What the quantization covers: the Linear weights, and a mixture of experts' routed
    experts (not a pre-quantized checkpoint's: MoE checkpoints are read as stored)."""
    if plan.config.moe is not None and plan.quant is not None:
        return "Linear weights and routed experts"
    return "Linear weights"


def _print_plan(args: argparse.Namespace, plan: _Plan) -> None:
    config = plan.config
    print(
        f"Model: {plan.model_dir} ({config.model_type}, {human_count(num_params(config))} "
        f"parameters, {plan.dtype} weights"
        + (f", {plan.quant.method} quantized {_quantized_words(plan)}" if plan.quant else "")
        + ")"
    )
    if config.moe is not None:
        print(
            f"Mixture of experts: {config.moe.num_experts} experts, {config.moe.top_k} per "
            f"token; {human_count(num_active_params(config))} parameters active per token, "
            "all experts' weights resident"
        )
    if config.mla is not None:
        print(
            f"Multi-head latent attention: the cache holds a latent of {config.mla.kv_lora_rank} "
            f"and a rotary key of {config.mla.qk_rope_head_dim} per token and layer, shared by "
            f"its {config.num_q_heads} heads"
        )
    print(
        f"Device memory: {plan.memory / GiB:.2f} GiB x {args.memory_utilization:.0%} utilization, "
        f"tensor parallel {args.tensor_parallel_size}"
        + (f", data parallel {args.data_parallel_size}" if args.data_parallel_size > 1 else "")
    )
    for line in plan.cap.lines() + data_parallel_lines(plan.cap, args.data_parallel_size):
        print(line)
    if plan.batch is not None:
        print(plan.batch.line())


def main() -> int:
    parser = argparse.ArgumentParser(prog="jaxserve capacity", description=__doc__.splitlines()[0])
    add_capacity_arguments(parser)
    return run_capacity(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
