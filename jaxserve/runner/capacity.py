"""How much KV cache fits: one function shared by the runner and ``jaxserve capacity``.

The budget is ``memory_utilization`` of the device's memory minus the weights (per device under
tensor parallelism) and the activation headroom of the largest compiled step; what remains is
cut into blocks. The capacity lines use vLLM's words so operators read them the same way.

When every layer of the model has a sliding window of W tokens, a running sequence holds only
the blocks of its last W positions and the one being written (the rest go back to the pool), so
the concurrency at full context counts min(max_model_len, W + block_size) tokens per request. A
hybrid model (Gemma 2/3, with global layers) keeps every block of a request, as one KV pool
serves all layers: it counts max_model_len.

The KV cache dtype (``--kv-cache-dtype``: the weights' dtype, or fp8 at one byte an element)
sets the bytes per token: an fp8 cache holds twice the tokens of a bf16 one. The size line
names it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.engine_config import KV_DTYPE_BYTES, EngineConfig
from jaxserve.models.batch import kv_bytes_per_token
from jaxserve.models.lora import lora_shapes
from jaxserve.models.quant_scheme import QuantScheme, weight_bytes
from jaxserve.runner.buckets import next_power_of_2, token_buckets_for
from jaxserve.runner.sampling import PROMPT_LOGPROBS_CHUNK
from jaxserve.units import cdiv
from pallas_kernels.mla import mosaic_gpu as mla_mosaic
from pallas_kernels.mla import reference as mla_reference
from pallas_kernels.mla import tpu as mla_tpu
from pallas_kernels.mla import triton as mla_triton
from pallas_kernels.ragged_paged_attention import reference as attention_reference

GiB = 1024**3
# The CPU backend reports no memory: its KV budget is a fraction of this (or of
# --device-memory), so CPU runs stay small and `jaxserve capacity` can reproduce them.
CPU_DEVICE_MEMORY_BYTES = 2 * GiB

# Memory per device of accelerators people plan for: what JAX's allocator can use, the figure
# `launch` plans with (bytes_limit at XLA_PYTHON_CLIENT_MEM_FRACTION=1), where it was measured;
# the others are datasheet figures, a few percent below what such devices report.
DEVICE_MEMORY_BYTES: dict[str, int] = {
    # One H200, JAX 0.11.2, driver 580.159.04 (2026-12-02): bytes_limit 150,109,945,856; NVML
    # total 150,754,820,096 (nvidia-smi's 143,771 MiB) less 644,939,776 the driver reserves.
    "H200": 150_109_945_856,
    "H100-80GB": 80 * 10**9,
    "H100-94GB": 94 * 10**9,
    "A100-80GB": 80 * 10**9,
    "A100-40GB": 40 * 10**9,
    "L40S": 48 * 10**9,
    "L4": 24 * 10**9,
    "TPU-v4": 32 * GiB,
    "TPU-v5e": 16 * GiB,
    "TPU-v5p": 95 * GiB,
    "TPU-v6e": 32 * GiB,
}


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def reserve_device_memory(fraction: float) -> None:
    """Size XLA's GPU allocator to at least ``fraction`` of the device, as
    ``gpu_memory_utilization`` asks. The backend reads the setting when it starts, so once it
    has started this changes nothing (``detect_device_memory`` then divides by the fraction it
    started with). A larger fraction already set is kept: a trainer in the same process sets
    ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` and ``gpu_memory_utilization=0.5`` to keep the rest
    of the pool for its own arrays (docs/training.md)."""
    import os

    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    current = os.environ.get(MEM_FRACTION_ENV)
    try:
        kept = current is not None and float(current) >= fraction
    except ValueError:  # not a number: JAX would refuse it; the engine's share replaces it
        kept = False
    if not kept:
        os.environ[MEM_FRACTION_ENV] = str(fraction)


def detect_device_memory() -> int:
    """Memory of the first device; on GPU, undoes XLA_PYTHON_CLIENT_MEM_FRACTION."""
    import os

    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        if device.platform == "gpu":  # XLA_PYTHON_CLIENT_ALLOCATOR=platform reports no limit
            return gpu_memory_without_limit(device.device_kind, nvidia_smi_total_bytes)
        return CPU_DEVICE_MEMORY_BYTES
    limit = int(stats["bytes_limit"])
    if device.platform == "gpu":
        return int(limit / float(os.environ.get(MEM_FRACTION_ENV, 0.75)))
    return limit


def gpu_memory_without_limit(device_kind: str, total_bytes: Callable[[], int | None]) -> int:
    """A GPU's memory when its allocator reports no limit (the platform allocator): the
    table's figure for the device's kind (``NVIDIA H200`` -> ``H200``), else the driver's total
    (``total_bytes``), else an error: planning for a guess would start a server that runs out
    of memory mid-request."""
    kind = device_kind.upper()
    for name in sorted(DEVICE_MEMORY_BYTES, key=len, reverse=True):
        model, _, size = name.upper().partition("-")
        if model in kind.split() and (not size or size in kind.replace(" ", "")):
            return DEVICE_MEMORY_BYTES[name]
    total = total_bytes()
    if total:
        return total
    raise CapacityError(
        f"the {device_kind} reports no memory limit (XLA_PYTHON_CLIENT_ALLOCATOR=platform?) "
        "and nvidia-smi gave no total: start it with XLA's default allocator"
    )


def nvidia_smi_total_bytes() -> int | None:
    """The first GPU's memory as the driver reports it, or None without nvidia-smi."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return int(out.split()[0]) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class CapacityError(ValueError):
    """The model (or one full-length request) does not fit in the memory budget."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    device_memory_bytes: int
    memory_utilization: float
    weight_bytes: int  # per device
    activation_bytes: int  # headroom reserved for the largest step
    kv_budget_bytes: int
    kv_bytes_per_token: int  # per device, all layers, K and V
    block_size: int
    num_blocks: int
    max_model_len: int
    sliding_window: int | None = None  # when every layer slides: the window, else None
    kv_cache_dtype: str | None = None  # what the cache stores (fp8_e4m3, bfloat16, ...)
    mla_bytes: int = 0  # of activation_bytes: one latent attention call's temporaries
    mla_path: str | None = None  # the latent attention's path (MLA_PATH), with mla_bytes
    reference_attention_bytes: int = 0  # of activation_bytes: the jnp attention reference's
    lora_bytes: int = 0  # the adapter slots (--enable-lora), per device
    lora_slots: tuple[int, int] | None = None  # (--max-loras, --max-lora-rank) with LoRA on
    drafter_bytes: int = 0  # a model drafter's weights, pages and kept states, per device
    drafter: str | None = None  # what it is, for the start-up line

    @property
    def step_bytes(self) -> int:
        """Of ``activation_bytes``: a step's temporaries, all but what the compiled programs
        keep (``programs_bytes``), which warm-up's compile holds before the cache is made."""
        return max(0, self.activation_bytes - programs_bytes(self.device_memory_bytes))

    def with_drafter(self, num_bytes: int, what: str) -> Capacity:
        """This plan with ``num_bytes`` (a speculative drafter's device memory, measured once
        it loaded: ``Runner.reserve_for_drafter``) taken from the KV cache's budget; a
        ``CapacityError`` where one full-length request no longer fits."""
        budget = self.kv_budget_bytes - num_bytes
        block_bytes = self.kv_bytes_per_token * self.block_size
        if budget < block_bytes:
            raise CapacityError(
                f"the drafter ({what}: {num_bytes / GiB:.2f} GiB) leaves no room for the KV "
                f"cache in its {self.kv_budget_bytes / GiB:.2f} GiB; raise "
                "--gpu-memory-utilization or draft with a smaller model"
            )
        num_blocks = budget // block_bytes
        _check_full_length_fits(num_blocks, self.block_size, self.max_model_len)
        return dataclasses.replace(
            self,
            kv_budget_bytes=budget,
            num_blocks=num_blocks,
            drafter_bytes=num_bytes,
            drafter=what,
        )

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tokens_per_request(self) -> int:
        """KV tokens one request of max_model_len tokens holds at once."""
        if self.sliding_window is None:
            return self.max_model_len
        return min(self.max_model_len, self.sliding_window + self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once."""
        return self.num_tokens / self.tokens_per_request

    def lines(self) -> list[str]:
        lora = []
        if self.lora_slots is not None:
            slots, rank = self.lora_slots
            lora = [
                f"LoRA adapter slots take {self.lora_bytes / GiB:.2f} GiB per device ({slots} "
                f"slots of rank {rank}, every projection's A and B)"
            ]
        return [
            f"Model weights take {self.weight_bytes / GiB:.2f} GiB per device; "
            f"activation headroom {self.activation_bytes / GiB:.2f} GiB"
            + (
                f" (of which {self.mla_bytes / GiB:.2f} GiB for multi-head latent attention's "
                f"temporaries on the {MLA_PATH_NAMES[self.mla_path]} path, per step, not per "
                "max model len)"
                if self.mla_path is not None
                else ""
            )
            + (
                f" (of which {self.reference_attention_bytes / GiB:.2f} GiB for the pure-jnp "
                "attention reference's temporaries: tokens x max model len)"
                if self.reference_attention_bytes
                else ""
            ),
            *lora,
            *(
                [
                    f"The speculative drafter takes {self.drafter_bytes / GiB:.2f} GiB per "
                    f"device ({self.drafter}), out of the KV cache's budget"
                ]
                if self.drafter is not None
                else []
            ),
            f"Available KV cache memory: {self.kv_budget_bytes / GiB:.2f} GiB "
            f"({self.kv_bytes_per_token:,} bytes per token, {self.num_blocks:,} blocks of "
            f"{self.block_size})",
            f"KV cache size: {self.num_tokens:,} tokens"
            + (f" (KV cache dtype {self.kv_cache_dtype})" if self.kv_cache_dtype else ""),
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x"
            + (
                f" (sliding window: {self.tokens_per_request:,} tokens held per request)"
                if self.tokens_per_request < self.max_model_len
                else ""
            ),
        ]


def data_parallel_lines(capacity: Capacity, data_parallel_size: int) -> list[str]:
    """What ``data_parallel_size`` replicas of ``capacity`` hold together (each replica has
    its own KV cache: a request's blocks live in one of them)."""
    if data_parallel_size <= 1:
        return []
    n = data_parallel_size
    return [
        f"Data parallel: {n} replicas; KV cache size: {capacity.num_tokens:,} tokens per "
        f"replica, {n * capacity.num_tokens:,} tokens in all",
        f"Maximum concurrency for {capacity.max_model_len:,} tokens per request: "
        f"{capacity.max_concurrency:.2f}x per replica, {n * capacity.max_concurrency:.2f}x in all",
    ]


def kv_heads_per_device(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads are split over devices, or replicated when there are more devices than heads."""
    return max(1, num_kv_heads // tensor_parallel_size)


def expert_activation_bytes(
    config: ModelConfig,
    num_tokens: int,
    dtype_bytes: int,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
) -> int:
    """The temporaries of one layer's experts (``models/moe.py``) for a step of ``num_tokens``
    tokens, per device; 0 for a dense model.

    R = tokens x top_k rows, one per (token, chosen expert): the rows gathered in expert order
    [R, H], gate, up and hidden [R, M], down [R, H], back in token order [R, H], the f32
    weighted rows of the combine [R, H], the router's f32 logits, scores and choice [T, E],
    and the i32 sort order, its inverse and the expert ids [R]. A tensor-parallel device holds
    1/N of M. Under expert parallelism each device routes ceil(T / N) tokens and runs the rows
    of all N devices' worst case through its whole experts, N x ceil(T / N) x top_k rows,
    beside the all-to-all's send, receive and return buffers [rows, H].
    The grouped matmuls add nothing on GPU (the Pallas kernel writes its output only) and on
    TPU; XLA's ragged_dot on the GPU (``JAXSERVE_GROUPED_MATMUL=xla``) would add a dense
    [R, E, H] expansion that no reserve can hold at prefill sizes.
    """
    moe = config.moe
    if moe is None:
        return 0
    hidden, k = config.hidden_size, moe.top_k
    inner = moe.intermediate_size
    router = 3 * 4 * num_tokens * moe.num_experts
    if expert_parallel:
        n = tensor_parallel_size
        local_tokens = cdiv(num_tokens, n)
        rows = n * local_tokens * k
        exchange = 3 * rows * hidden * dtype_bytes  # send, receive, return
        combine = 4 * local_tokens * k * hidden
    else:
        rows = num_tokens * k
        inner = cdiv(inner, tensor_parallel_size)
        exchange, combine = 0, 4 * rows * hidden
    mlp = rows * (3 * hidden + 3 * inner) * dtype_bytes  # rows, gate/up/hidden, down, reorder
    return router + 3 * 4 * rows + mlp + combine + exchange


def cache_bytes_per_token(config: ModelConfig, tensor_parallel_size: int, itemsize: int) -> int:
    """Bytes one token occupies in the KV cache of one device, all layers: K and V of its KV
    heads (split over the devices); for multi-head latent attention its latent c_kv and
    rotary key k_pe, once (the same on every device)."""
    if config.mla is not None:
        (_, latent), (_, rope_dim) = config.kv_cache_dims
        return config.num_layers * (latent + rope_dim) * itemsize
    return kv_bytes_per_token(
        config.num_layers,
        kv_heads_per_device(config.num_kv_heads, tensor_parallel_size),
        config.head_dim,
        itemsize,
    )


# What the compiled programs keep in the device's allocator once warm-up has compiled them (their
# constants and the compiler's leftovers), beyond the weights: measured on an H100 after a full
# warm-up, 0.17-0.52 GiB (bf16, with and without LoRA) and 0.66 GiB (fp8 weights and cache, on
# an empty compilation cache), 2026-12-06. Unplanned, it came out of the steps' headroom: the
# fp8 engine kept 1.83 of a planned 2.48 GiB beside its cache, and its first sampler step ran
# out of memory. Planned here (or 1/32 of a small device), the cache is that much smaller.
PROGRAMS_BYTES = 768 * 1024**2


# The largest sampler variant's temporaries, in f32 copies of its logits [rows, vocab]: XLA plans
# 9.1 for the variant that does everything (sort, bias, top logprobs, token mask), 7-8 for the
# sorting ones, 5 for plain sampling (memory analysis on the CPU, 2026-12-06; the test
# compiles each variant and checks it). An H100 engine at --max-num-seqs 256 (rows of 256)
# asked for 1.16 GiB in a sampler step, 9.45 copies, where the plan had kept 6.
SAMPLER_F32_COPIES = 10


def programs_bytes(device_memory_bytes: int) -> int:
    """What the plan keeps for the compiled programs (``PROGRAMS_BYTES``, or 1/32 of a small
    device)."""
    return min(PROGRAMS_BYTES, device_memory_bytes // 32)


def activation_bytes(
    config: ModelConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype_bytes: int,
    device_memory_bytes: int,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
) -> int:
    """A conservative estimate of the largest step's temporary buffers, plus a slack for
    the compiler's workspace (512 MiB, or 1/16 of a small device) and what the compiled
    programs keep on the device (``PROGRAMS_BYTES``)."""
    per_token = (4 * config.intermediate_size + 6 * config.hidden_size) * dtype_bytes
    if config.mla is not None:  # each head's query (A), absorbed query and output (L), value
        mla = config.mla
        heads = max(1, config.num_q_heads // tensor_parallel_size)  # split over the devices
        per_token += heads * (mla.qk_head_dim + 2 * mla.kv_lora_rank + mla.v_head_dim) * dtype_bytes
    experts = expert_activation_bytes(
        config, max_num_batched_tokens, dtype_bytes, tensor_parallel_size, expert_parallel
    )
    # The sampler's rows (``SAMPLER_F32_COPIES``), or a chunk of prompt logprobs when that is
    # larger: on the H200 a chunk takes 6.0 f32 copies of its logits, so 8 here.
    chunk = min(PROMPT_LOGPROBS_CHUNK, max_num_batched_tokens)
    sampler = max(SAMPLER_F32_COPIES * max_num_seqs, 8 * chunk) * config.vocab_size * 4
    slack = min(512 * 1024**2, device_memory_bytes // 16)
    programs = programs_bytes(device_memory_bytes)
    return max_num_batched_tokens * per_token + experts + sampler + slack + programs


# What each path of multi-head latent attention allocates in one call, besides its inputs and
# output: (tokens, heads per device, kv_lora_rank, rope dims, block size, pages per sequence,
# the cache's element size, the query's) -> bytes. A kernel declares its own here beside the
# reference's (``pallas_kernels.mla``), under the path names of ``mla.dispatch``; the plan
# takes the path the model runs (``choose_mla_path``; ``MLA_PATH`` where none is given).
MLA_TEMPORARY_BYTES: dict[str, Callable[[int, int, int, int, int, int, int, int], int]] = {
    "reference": mla_reference.temporary_bytes,
    "triton": mla_triton.temporary_bytes,
    "interpret": mla_triton.temporary_bytes,  # the same launch, run by the interpreter
    "mosaic": mla_mosaic.temporary_bytes,
    "mosaic_interpret": mla_mosaic.temporary_bytes,  # the same launch, run by the interpreter
    "tpu": mla_tpu.temporary_bytes,
}
MLA_PATH = "reference"
# What the first capacity line calls each path.
MLA_PATH_NAMES = {
    "reference": "reference",
    "triton": "Pallas Triton kernel",
    "interpret": "Pallas Triton kernel (interpret mode)",
    "mosaic": "Pallas Mosaic GPU kernel",
    "mosaic_interpret": "Pallas Mosaic GPU kernel (interpret mode)",
    "tpu": "Pallas Mosaic TPU kernel",
}


def choose_mla_path(
    config: ModelConfig,
    dtype: Any,
    kv_dtype: Any,
    tensor_parallel_size: int = 1,
    backend: str | None = None,  # a named device's ("gpu", "tpu"); None: this process's
) -> str:
    """The path the model's latent attention takes (``mla.dispatch.path_for``: the Triton
    kernel on an NVIDIA GPU, the Mosaic TPU kernel on a TPU, with tensor parallelism too; the
    reference on the CPU)."""
    from pallas_kernels.mla import dispatch as mla_dispatch

    assert config.mla is not None
    heads = max(1, config.num_q_heads // tensor_parallel_size)
    m = config.mla
    path, _ = mla_dispatch.path_for(
        heads, m.kv_lora_rank, m.qk_rope_head_dim, dtype, kv_dtype, tensor_parallel_size, backend
    )
    return path


def mla_attention_bytes(
    config: ModelConfig,
    num_tokens: int,
    max_model_len: int,
    block_size: int,
    tensor_parallel_size: int = 1,
    dtype_bytes: int = 2,
    kv_dtype_bytes: int | None = None,  # the cache's element size; None: dtype_bytes
    path: str = MLA_PATH,  # the latent attention's path (``choose_mla_path``)
) -> int:
    """The temporaries of one multi-head latent attention call in the largest step, per
    device, as its path declares them (``MLA_TEMPORARY_BYTES``); 0 for other families. The
    reference walks each row's positions in blocks sized by the step's rows, so this grows
    with the token bucket and a block, not with max_model_len (the page table's width only
    caps a block at decode sizes)."""
    if config.mla is None:
        return 0
    heads = max(1, config.num_q_heads // tensor_parallel_size)
    return MLA_TEMPORARY_BYTES[path](
        num_tokens,
        heads,
        config.mla.kv_lora_rank,
        config.mla.qk_rope_head_dim,
        block_size,
        cdiv(max_model_len, block_size),
        dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes,
        dtype_bytes,
    )


def reference_attention_bytes(
    config: ModelConfig,
    num_tokens: int,
    max_model_len: int,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> int:
    """The temporaries of one call of the pure-jnp attention reference
    (``pallas_kernels.ragged_paged_attention.reference``) in the largest step, per device: every
    row gathers and scores the whole page table, so this grows with tokens x max_model_len.
    0 for latent attention (``mla_attention_bytes``). Reserved only where the reference is the
    path (the CPU, ``JAXSERVE_ATTENTION=reference``, a shape no kernel takes); the kernels write
    their output only."""
    if config.mla is not None:
        return 0
    return attention_reference.temporary_bytes(
        num_tokens,
        max(1, config.num_q_heads // tensor_parallel_size),
        kv_heads_per_device(config.num_kv_heads, tensor_parallel_size),
        config.head_dim,
        cdiv(max_model_len, block_size) * block_size,
        sinks=config.attention_sinks,
    )


def _planned_activations(
    config: ModelConfig,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    dtype_bytes: int,
    kv_dtype_bytes: int,
    device_memory_bytes: int,
    tensor_parallel_size: int,
    expert_parallel: bool,
    reference_attention: bool,
    mla_path: str,
) -> tuple[int, int, int]:
    """(latent attention's temporaries, the attention reference's, all the activations)."""
    mla = mla_attention_bytes(
        config,
        max_num_batched_tokens,
        max_model_len,
        block_size,
        tensor_parallel_size,
        dtype_bytes,
        kv_dtype_bytes,
        mla_path,
    )
    attention = 0
    if reference_attention:
        attention = reference_attention_bytes(
            config, max_num_batched_tokens, max_model_len, block_size, tensor_parallel_size
        )
    activations = (
        mla
        + attention
        + activation_bytes(
            config,
            max_num_batched_tokens,
            max_num_seqs,
            dtype_bytes,
            device_memory_bytes,
            tensor_parallel_size,
            expert_parallel,
        )
    )
    return mla, attention, activations


def lora_slot_bytes(
    config: ModelConfig,
    max_loras: int,
    max_lora_rank: int,
    dtype_bytes: int = 2,
    tensor_parallel_size: int = 1,
) -> int:
    """Device bytes of the adapter slots, per device: per slot, layer and projection
    (models/lora.py's stacks: attention on every layer, the MLP on layers without experts) A
    [R, in] and B [R, out] in the model dtype; under tensor parallelism the B of q, k, v, gate
    and up split on their output, the A of o and down on their input (parallel/sharding.py's
    ``lora_specs``), the rest replicated. Latent attention: a ``ValueError``."""
    shapes = lora_shapes(config, max_loras, max_lora_rank)
    tp, kv = tensor_parallel_size, min(tensor_parallel_size, config.num_kv_heads)
    splits = {"q_b": tp, "k_b": kv, "v_b": kv, "o_a": tp, "gate_b": tp, "up_b": tp, "down_a": tp}
    total = 0
    for layer in range(len(shapes.dims)):
        for name, shape in shapes.layer_arrays(layer).items():
            total += math.prod(shape) // splits.get(name, 1)
    return total * dtype_bytes


def plan_capacity(
    config: ModelConfig,
    *,
    max_model_len: int,
    device_memory_bytes: int,
    memory_utilization: float,
    dtype_bytes: int = 2,
    quant: QuantScheme | None = None,
    kv_cache_dtype: str | None = None,  # engine_config.kv_cache_dtype_name; None: dtype_bytes
    block_size: int = 16,
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    num_blocks_override: int | None = None,
    expert_parallel: bool = False,
    reference_attention: bool = False,  # the jnp reference runs attention (no kernel)
    mla_path: str = MLA_PATH,  # latent attention's path (choose_mla_path)
    lora_slots: tuple[int, int] | None = None,  # (--max-loras, --max-lora-rank) with LoRA on
) -> Capacity:
    kv_dtype_bytes = KV_DTYPE_BYTES[kv_cache_dtype] if kv_cache_dtype else dtype_bytes
    weights, lora = _resident_bytes(config, dtype_bytes, quant, tensor_parallel_size, lora_slots)
    mla, attention, activations = _planned_activations(
        config,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        dtype_bytes=dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        device_memory_bytes=device_memory_bytes,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel=expert_parallel,
        reference_attention=reference_attention,
        mla_path=mla_path,
    )
    block_bytes = block_size * cache_bytes_per_token(config, tensor_parallel_size, kv_dtype_bytes)
    if num_blocks_override is not None:
        num_blocks, budget = num_blocks_override, num_blocks_override * block_bytes
    else:
        budget = _kv_budget(device_memory_bytes, memory_utilization, weights, activations, lora)
        num_blocks = budget // block_bytes
    _check_full_length_fits(num_blocks, block_size, max_model_len)
    return Capacity(
        device_memory_bytes=device_memory_bytes,
        memory_utilization=memory_utilization,
        weight_bytes=weights,
        activation_bytes=activations,
        kv_budget_bytes=budget,
        kv_bytes_per_token=block_bytes // block_size,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        sliding_window=config.all_layers_window,
        kv_cache_dtype=kv_cache_dtype,
        mla_bytes=mla,
        mla_path=mla_path if config.mla is not None else None,
        reference_attention_bytes=attention,
        lora_bytes=lora,
        lora_slots=lora_slots,
    )


def _resident_bytes(
    config: ModelConfig,
    dtype_bytes: int,
    quant: QuantScheme | None,
    tensor_parallel_size: int,
    lora_slots: tuple[int, int] | None,
) -> tuple[int, int]:
    """(weights, LoRA slots) per device. Quantized Linear weights count at their own bytes
    (values, scales, zero points); every expert of a mixture of experts, split over the devices
    (tensor or expert parallel)."""
    weights = weight_bytes(config, dtype_bytes, quant) // tensor_parallel_size
    if lora_slots is None:
        return weights, 0
    return weights, lora_slot_bytes(config, *lora_slots, dtype_bytes, tensor_parallel_size)


def _kv_budget(
    device_memory_bytes: int, memory_utilization: float, weights: int, activations: int, lora: int
) -> int:
    budget = int(device_memory_bytes * memory_utilization) - weights - activations - lora
    if budget <= 0:
        raise CapacityError(
            f"the weights ({weights / GiB:.2f} GiB) and activations ({activations / GiB:.2f} GiB)"
            + (f" and LoRA adapter slots ({lora / GiB:.2f} GiB)" if lora else "")
            + f" do not fit in {memory_utilization:.0%} of {device_memory_bytes / GiB:.2f} GiB; "
            "raise --gpu-memory-utilization or --tensor-parallel-size"
        )
    return budget


def _check_full_length_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    # NOTE: a prompt of max_model_len tokens prefilled in one chunk holds all its blocks
    # during that step, window or not: the pool must hold one full-length request.
    needed = cdiv(max_model_len, block_size)
    if num_blocks < needed:
        raise CapacityError(
            f"max_model_len={max_model_len:,} needs {needed:,} KV blocks but only "
            f"{num_blocks:,} fit ({num_blocks * block_size:,} tokens); lower --max-model-len "
            "or raise --gpu-memory-utilization"
        )


def engine_capacity(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: Any,
    quant: QuantScheme | None,
    kv_cache_dtype: str,
    kv_dtype: Any = None,  # the cache's jnp dtype; None: dtype
) -> Capacity:
    """``plan_capacity`` of an engine's settings: its largest token bucket and sequence bucket,
    the device's memory unless ``device_memory_bytes`` says otherwise, and the attention
    reference's temporaries where it is the path this backend takes."""
    memory = config.device_memory_bytes  # what the KV budget is a fraction of
    tp = config.tensor_parallel_size
    reference = model_config.mla is None and runs_attention_reference(
        model_config, dtype, kv_dtype or dtype, config.block_size, tp
    )
    mla_path = MLA_PATH
    if model_config.mla is not None:
        mla_path = choose_mla_path(model_config, dtype, kv_dtype or dtype, tp)
    return plan_capacity(
        model_config,
        max_model_len=config.resolved_max_model_len(model_config),
        device_memory_bytes=detect_device_memory() if memory is None else memory,
        memory_utilization=config.gpu_memory_utilization,
        dtype_bytes=dtype.itemsize,
        quant=quant,
        kv_cache_dtype=kv_cache_dtype,
        block_size=config.block_size,
        tensor_parallel_size=config.tensor_parallel_size,
        max_num_batched_tokens=token_buckets_for(config.max_num_batched_tokens)[-1],
        max_num_seqs=next_power_of_2(config.max_sample_rows),  # the sampler's rows
        num_blocks_override=config.num_gpu_blocks_override,
        expert_parallel=config.enable_expert_parallel,
        reference_attention=reference,
        mla_path=mla_path,
        lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
    )


def runs_attention_reference(
    model_config: ModelConfig, dtype: Any, kv_dtype: Any, block_size: int, tensor_parallel_size: int
) -> bool:
    """Whether the plan reserves the jnp attention reference's temporaries: where
    ``dispatch.ragged_paged_attention`` takes it for this model on an accelerator (a shape or
    GPU no kernel takes), or anywhere ``JAXSERVE_ATTENTION=reference`` asks for it. Not on the
    CPU by default: its budget is a nominal ``CPU_DEVICE_MEMORY_BYTES``, and the reference's
    rows x max_model_len (2 GiB for the demo model's 2,048-token steps) would leave it no KV
    cache, while the host's memory is what the step really takes."""
    import jax

    from pallas_kernels.ragged_paged_attention.dispatch import choose_kernel, requested_attention

    heads = max(1, model_config.num_q_heads // tensor_parallel_size)
    kv_heads = kv_heads_per_device(model_config.num_kv_heads, tensor_parallel_size)
    q = jax.ShapeDtypeStruct((1, heads, model_config.head_dim), dtype)
    k_pages = jax.ShapeDtypeStruct((1, block_size, kv_heads, model_config.head_dim), kv_dtype)
    if choose_kernel(q, k_pages)[0] != "reference":
        return False
    return jax.default_backend() != "cpu" or requested_attention() == "reference"
