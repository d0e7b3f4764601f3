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
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.engine_config import KV_DTYPE_BYTES, EngineConfig
from jaxserve.models.batch import kv_bytes_per_token
from jaxserve.models.quant_scheme import QuantScheme, weight_bytes
from jaxserve.runner.buckets import next_power_of_2, token_buckets_for
from jaxserve.runner.sampling import PROMPT_LOGPROBS_CHUNK
from jaxserve.units import cdiv

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


def reserve_device_memory(fraction: float) -> None:
    """Size XLA's GPU allocator to ``fraction`` of the device, as ``gpu_memory_utilization``
    asks. It reads the setting when the backend starts: call before anything touches a device
    (no effect once the process has started it)."""
    import os

    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)


def detect_device_memory() -> int:
    """Memory of the first device; on GPU, undoes XLA_PYTHON_CLIENT_MEM_FRACTION."""
    import os

    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return CPU_DEVICE_MEMORY_BYTES
    limit = int(stats["bytes_limit"])
    if device.platform == "gpu":
        return int(limit / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)))
    return limit


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
        return [
            f"Model weights take {self.weight_bytes / GiB:.2f} GiB per device; "
            f"activation headroom {self.activation_bytes / GiB:.2f} GiB",
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
    the compiler's workspace (512 MiB, or 1/16 of a small device)."""
    per_token = (4 * config.intermediate_size + 6 * config.hidden_size) * dtype_bytes
    if config.mla is not None:  # each head's query (A), absorbed query and output (L), value
        mla = config.mla
        heads = config.num_q_heads
        per_token += heads * (mla.qk_head_dim + 2 * mla.kv_lora_rank + mla.v_head_dim) * dtype_bytes
    experts = expert_activation_bytes(
        config, max_num_batched_tokens, dtype_bytes, tensor_parallel_size, expert_parallel
    )
    # The sampler's rows (f32 logits, scaled, noise, sort, ...), or a chunk of prompt logprobs
    # when that is larger: on the H200 a chunk takes 6.0 f32 copies of its logits, so 8 here.
    chunk = min(PROMPT_LOGPROBS_CHUNK, max_num_batched_tokens)
    sampler = max(6 * max_num_seqs, 8 * chunk) * config.vocab_size * 4
    slack = min(512 * 1024**2, device_memory_bytes // 16)
    return max_num_batched_tokens * per_token + experts + sampler + slack


def mla_reference_bytes(
    config: ModelConfig, num_tokens: int, max_model_len: int, block_size: int
) -> int:
    """The temporaries of multi-head latent attention's reference (``pallas_kernels.mla``, its
    only path) in the largest step, 0 for other families: each row gathers its sequence's
    latents and rotary keys (in the cache's dtype, then float32: counted at 4 bytes each) and
    scores every position for every head twice (scores, probabilities), over max_model_len
    positions."""
    if config.mla is None:
        return 0
    positions = cdiv(max_model_len, block_size) * block_size
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    per_position = latent * (4 + 4) + 2 * config.num_q_heads * 4
    return num_tokens * positions * per_position


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
) -> Capacity:
    kv_dtype_bytes = KV_DTYPE_BYTES[kv_cache_dtype] if kv_cache_dtype else dtype_bytes
    # Quantized Linear weights count at their own bytes (values, scales, zero points).
    # NOTE: every expert of a mixture of experts is counted: all stay resident, split over the
    # devices whether by slices (tensor parallel) or whole experts (expert parallel).
    weights = weight_bytes(config, dtype_bytes, quant) // tensor_parallel_size
    activations = activation_bytes(
        config,
        max_num_batched_tokens,
        max_num_seqs,
        dtype_bytes,
        device_memory_bytes,
        tensor_parallel_size,
        expert_parallel,
    ) + mla_reference_bytes(config, max_num_batched_tokens, max_model_len, block_size)
    per_token = cache_bytes_per_token(config, tensor_parallel_size, kv_dtype_bytes)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        budget = num_blocks * block_size * per_token
    else:
        budget = int(device_memory_bytes * memory_utilization) - weights - activations
        if budget <= 0:
            raise CapacityError(
                f"the weights ({weights / GiB:.2f} GiB) and activations "
                f"({activations / GiB:.2f} GiB) do not fit in {memory_utilization:.0%} of "
                f"{device_memory_bytes / GiB:.2f} GiB; raise --gpu-memory-utilization or "
                "--tensor-parallel-size"
            )
        num_blocks = budget // (block_size * per_token)
    _check_full_length_fits(num_blocks, block_size, max_model_len)
    return Capacity(
        device_memory_bytes=device_memory_bytes,
        memory_utilization=memory_utilization,
        weight_bytes=weights,
        activation_bytes=activations,
        kv_budget_bytes=budget,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        sliding_window=config.all_layers_window,
        kv_cache_dtype=kv_cache_dtype,
    )


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
) -> Capacity:
    """``plan_capacity`` of an engine's settings: its largest token bucket and sequence bucket,
    the device's memory unless ``device_memory_bytes`` says otherwise."""
    memory = config.device_memory_bytes  # what the KV budget is a fraction of
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
        max_num_seqs=next_power_of_2(config.max_num_seqs),
        num_blocks_override=config.num_gpu_blocks_override,
        expert_parallel=config.enable_expert_parallel,
    )
