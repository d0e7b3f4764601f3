"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, GPT-OSS; DeepSeek's grouped routing) as pure
functions.

``moe_block(x, weights, config, act)`` replaces the dense MLP of a layer: ``route`` picks each
token's ``top_k`` experts and their weights from the router logits, ``run_experts`` runs every
(token, expert) pair as a grouped matmul and sums each token's pairs, and a shared expert, where
the model has one, adds a dense MLP over every token. Under expert parallelism the runner swaps
``run_experts`` for ``run_experts_all_to_all`` inside ``shard_map``
(``runner/parallel/sharding.py``).

Shapes are fixed by the token count alone: T tokens make T * top_k rows sorted by expert, and
only the group sizes (data) change with the routing, so a new routing never recompiles. The
padding tokens of a step's bucket get the expert id E, past every group: they sort last and
no expert runs them (a decode step of one sequence in a 16-token bucket reads the weights of
its own top_k experts only).

With ``--quantization fp8 | int8`` the routed experts are ``quant.QArray``s (values [E, H, M] /
[E, M, H] in fp8 e4m3 or int8, f32 scales [E, M] / [E, H] per expert and output channel): the
grouped matmuls read them weight-only (``grouped_matmul``'s ``scale``), the activations staying
in the model's dtype. The router and shared expert are not quantized.

GPT-OSS adds biases (on the router logits, and per expert on gate, up and down) and its own
gated activation, the clamped swiglu (``clamped_swiglu``), in place of ``act(gate) * up``. The
gate and up biases ride with the grouped matmuls (each row takes its expert's); the down bias,
a per-expert constant, is added outside the experts as the routing-weighted sum of the token's
experts' biases, so a tensor-parallel all-reduce never counts it twice.

Einsum letters: T tokens, H hidden, E experts, M expert intermediate, S shared-expert
intermediate, R rows (T * top_k, one per token and chosen expert).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import MoeConfig
from jaxserve.models.quant import QArray, dequantize
from jaxserve.units import cdiv
from pallas_kernels.grouped_matmul import dispatch

# Stacked experts: plain [E, ...], or quantized (values [E, in, out], scales [E, out]).
Experts = jax.Array | QArray

Activation = Callable[[jax.Array], jax.Array]
# (gate [R, M], up [R, M]) -> [R, M]: an expert's gated activation in place of act(gate) * up
Glu = Callable[[jax.Array, jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoeWeights:
    """One layer's experts (a view of its ``LayerWeights``, nothing copied)."""

    router: jax.Array  # [H, E]
    w_gate: Experts  # [E, H, M]
    w_up: Experts  # [E, H, M]
    w_down: Experts  # [E, M, H]
    router_bias: jax.Array | None = None  # f32[E]  e_score_correction_bias (DeepSeek-V3)
    shared_gate: jax.Array | None = None  # [H, S]  the shared expert, a dense MLP
    shared_up: jax.Array | None = None  # [H, S]
    shared_down: jax.Array | None = None  # [S, H]
    shared_router: jax.Array | None = None  # [H, 1]  its output times sigmoid(x @ this)
    router_logit_bias: jax.Array | None = None  # [E]  added to the router logits (GPT-OSS)
    gate_bias: jax.Array | None = None  # [E, M]  per-expert biases (GPT-OSS)
    up_bias: jax.Array | None = None  # [E, M]
    down_bias: jax.Array | None = None  # [E, H]


# (x[T, H], expert_ids i32[T, k], expert_weights f32[T, k], w_gate, w_up, w_down, *, act,
#  and where the model has them gate_bias, up_bias, glu) -> [T, H]
ExpertsFn = Callable[..., jax.Array]


def clamped_swiglu(
    gate: jax.Array,  # [R, M]
    up: jax.Array,  # [R, M]
    *,
    limit: float,
    alpha: float,
) -> jax.Array:  # [R, M]
    """GPT-OSS's gated activation: the gate capped at ``limit`` (above only), the up projection
    held to [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


def expert_glu(config: MoeConfig) -> Glu | None:
    """The experts' gated activation when it is not ``act(gate) * up`` (GPT-OSS), else None."""
    if config.swiglu_limit is None:
        return None
    return functools.partial(clamped_swiglu, limit=config.swiglu_limit, alpha=config.swiglu_alpha)


def num_experts_of(w: Experts) -> int:
    """E of stacked experts, plain or quantized."""
    return (w.q if isinstance(w, QArray) else w).shape[0]


def grouped_matmul(
    rows: jax.Array,  # [R, K]  sorted by expert
    w: Experts,  # [E, K, N]
    group_sizes: jax.Array,  # i32[E]
) -> jax.Array:  # [R, N]
    """One grouped matmul over plain or quantized experts (weight-only: rows stay as they
    are, the values are converted inside the matmul and each output column scaled)."""
    if isinstance(w, QArray):
        return dispatch.grouped_matmul(rows, jnp.asarray(w.q), group_sizes, jnp.asarray(w.scale))
    return dispatch.grouped_matmul(rows, w, group_sizes)


def row_bias(
    bias: jax.Array,  # [E, M]
    group_sizes: jax.Array,  # i32[E]
    num_rows: int,
) -> jax.Array:  # [R, M]; zeros past the groups' sum
    """Each row's expert's bias, rows in expert order as ``group_sizes`` counts them."""
    ends = jnp.cumsum(group_sizes)  # i32[E]
    expert = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
    return jnp.take(bias, expert, axis=0, mode="fill", fill_value=0)


def route(
    logits: jax.Array,  # f32[T, E]
    config: MoeConfig,
    bias: jax.Array | None = None,  # f32[E]  steers the choice only (DeepSeek-V3)
) -> tuple[jax.Array, jax.Array]:  # (weights f32[T, k], expert ids i32[T, k])
    """Each token's ``top_k`` experts and their weights, as Hugging Face's routers pick them."""
    if config.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if config.n_group > 1:  # DeepSeek: keep the topk_group groups whose two best score most
        num_tokens, num_experts = choice.shape
        grouped = choice.reshape(num_tokens, config.n_group, num_experts // config.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # f32[T, G]
        kept = jax.lax.top_k(group_scores, config.topk_group)[1]  # i32[T, topk_group]
        rows = jnp.arange(num_tokens)[:, None]
        is_kept = jnp.zeros(group_scores.shape, bool).at[rows, kept].set(True)  # bool[T, G]
        is_kept = jnp.repeat(is_kept, num_experts // config.n_group, axis=1)  # bool[T, E]
        choice = jnp.where(is_kept, choice, -jnp.inf)
    ids = jax.lax.top_k(choice, config.top_k)[1]  # i32[T, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # f32[T, k]
    if config.norm_topk_prob:
        denominator = weights.sum(-1, keepdims=True)
        if config.scoring == "sigmoid":  # DeepSeek's guard; a softmax sum is never 0
            denominator = denominator + 1e-20
        weights = weights / denominator
    return weights * config.routed_scaling_factor, ids.astype(jnp.int32)


def sort_by_expert(
    expert_ids: jax.Array,  # i32[T, k]
    num_experts: int,
) -> tuple[jax.Array, jax.Array]:  # (order i32[R], group sizes i32[E])
    """Rows (token * k + slot) in expert order, and how many rows each expert has."""
    flat = expert_ids.reshape(-1)  # i32[R]
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop")
    return order.astype(jnp.int32), group_sizes


def expert_mlp(
    rows: jax.Array,  # [R, H]  sorted by expert
    group_sizes: jax.Array,  # i32[E]  rows of each expert, in order; may sum to less than R
    w_gate: Experts,  # [E, H, M]
    w_up: Experts,  # [E, H, M]
    w_down: Experts,  # [E, M, H]
    act: Activation,
    gate_bias: jax.Array | None = None,  # [E, M]
    up_bias: jax.Array | None = None,  # [E, M]
    glu: Glu | None = None,  # in place of act(gate) * up
) -> jax.Array:  # [R, H]; rows past the groups' sum are zeros
    """Each row through its expert's gated MLP: three grouped matmuls."""
    # NOTE: pallas_kernels.grouped_matmul: jax.lax.ragged_dot on TPU and CPU, our Pallas
    # Triton kernel on GPUs, where XLA expands a ragged dot into a dense dot over every expert.
    # Either way the shapes depend on the row count only, so routing never recompiles.
    # benchmarks/moe.py measures both against the roofline on the H200.
    gate = grouped_matmul(rows, w_gate, group_sizes)  # [R, M]
    up = grouped_matmul(rows, w_up, group_sizes)  # [R, M]
    if gate_bias is not None:
        gate = gate + row_bias(gate_bias, group_sizes, rows.shape[0]).astype(gate.dtype)
    if up_bias is not None:
        up = up + row_bias(up_bias, group_sizes, rows.shape[0]).astype(up.dtype)
    hidden = act(gate) * up if glu is None else glu(gate, up)  # [R, M]
    return grouped_matmul(hidden, w_down, group_sizes)  # [R, H]


def run_experts(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # i32[T, k]
    expert_weights: jax.Array,  # f32[T, k]
    w_gate: Experts,  # [E, H, M]
    w_up: Experts,  # [E, H, M]
    w_down: Experts,  # [E, M, H]
    *,
    act: Activation,
    gate_bias: jax.Array | None = None,  # [E, M]
    up_bias: jax.Array | None = None,  # [E, M]
    glu: Glu | None = None,
) -> jax.Array:  # [T, H]
    """Sum over each token's experts of weight * expert(x), all experts on this device."""
    num_tokens, top_k = expert_ids.shape
    order, group_sizes = sort_by_expert(expert_ids, num_experts_of(w_gate))
    rows = x[order // top_k]  # [R, H]
    out = expert_mlp(rows, group_sizes, w_gate, w_up, w_down, act, gate_bias, up_bias, glu)
    return combine(out, order, expert_weights, x.dtype)


def inverse_permutation(order: jax.Array) -> jax.Array:  # i32[R] -> i32[R]
    """Where each row went: ``inverse[order[i]] == i``."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def combine(
    out: jax.Array,  # [R, H]  in expert order
    order: jax.Array,  # i32[R]  the token row (token * k + slot) of each
    expert_weights: jax.Array,  # f32[T, k]
    dtype: jnp.dtype,
) -> jax.Array:  # [T, H]
    """Rows back in token order, weighted and summed over each token's k experts."""
    num_tokens, top_k = expert_weights.shape
    # NOTE: the inverse permutation and a gather, not a scatter-add: the sum over k is then in
    # slot order, the same on every device and every run.
    per_slot = out[inverse_permutation(order)].reshape(num_tokens, top_k, -1)  # [T, k, H]
    weighted = per_slot.astype(jnp.float32) * expert_weights[..., None]
    return weighted.sum(1).astype(dtype)


def this_devices_tokens(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # i32[T, k]
    expert_weights: jax.Array,  # f32[T, k]
    no_expert: int,  # E: past every device's experts
    axis_name: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [t, H], i32[t, k], f32[t, k]
    """Device d's tokens [d * t, (d + 1) * t), t = ceil(T / n); past T, padding rows routed to
    ``no_expert``."""
    num_devices = jax.lax.axis_size(axis_name)
    device = jax.lax.axis_index(axis_name)
    num_tokens = expert_ids.shape[0]
    local_tokens = cdiv(num_tokens, num_devices)  # t; past T: padding of no expert
    padding = local_tokens * num_devices - num_tokens
    x = jnp.pad(x, ((0, padding), (0, 0)))
    expert_ids = jnp.pad(expert_ids, ((0, padding), (0, 0)), constant_values=no_expert)
    expert_weights = jnp.pad(expert_weights, ((0, padding), (0, 0)))
    start = device * local_tokens
    x = jax.lax.dynamic_slice_in_dim(x, start, local_tokens)  # [t, H]
    expert_ids = jax.lax.dynamic_slice_in_dim(expert_ids, start, local_tokens)  # i32[t, k]
    expert_weights = jax.lax.dynamic_slice_in_dim(expert_weights, start, local_tokens)
    return x, expert_ids, expert_weights


def run_received(
    received: jax.Array,  # [n, C, H]  the rows each device sent here
    received_ids: jax.Array,  # i32[n, C]  their local expert; num_local: an empty row
    experts: tuple[Experts, Experts, Experts],  # this device's w_gate, w_up, w_down
    act: Activation,
    gate_bias: jax.Array | None,
    up_bias: jax.Array | None,
    glu: Glu | None,
) -> jax.Array:  # [n, C, H]  the results, as received
    """The received rows through this device's experts (empty rows sort last, run by none)."""
    w_gate, w_up, w_down = experts
    num_local = num_experts_of(w_gate)
    num_devices, capacity, hidden_size = received.shape
    received_ids = received_ids.reshape(-1)  # i32[n * C]; empty rows sort last
    local_order = jnp.argsort(received_ids, stable=True).astype(jnp.int32)
    local_sizes = jnp.zeros(num_local, jnp.int32).at[received_ids].add(1, mode="drop")
    local_rows = received.reshape(-1, hidden_size)[local_order]  # [n * C, H]
    out = expert_mlp(
        local_rows, local_sizes, w_gate, w_up, w_down, act, gate_bias, up_bias, glu
    )  # [n * C, H]
    out = out[inverse_permutation(local_order)]  # [n * C, H] as received
    return out.reshape(num_devices, capacity, -1)  # [n, C, H] by source


def run_experts_all_to_all(
    x: jax.Array,  # [T, H]  every token, the same on every device
    expert_ids: jax.Array,  # i32[T, k]
    expert_weights: jax.Array,  # f32[T, k]
    w_gate: Experts,  # [E / n, H, M]  this device's experts
    w_up: Experts,  # [E / n, H, M]
    w_down: Experts,  # [E / n, M, H]
    *,
    act: Activation,
    axis_name: str,
    gate_bias: jax.Array | None = None,  # [E / n, M]  this device's experts'
    up_bias: jax.Array | None = None,  # [E / n, M]
    glu: Glu | None = None,
) -> jax.Array:  # [T, H], the same on every device
    """``run_experts`` under expert parallelism, inside ``shard_map`` over ``axis_name``.

    Device d owns experts [d * E / n, (d + 1) * E / n) and routes tokens [d * T / n, ...):
    it sends each of its rows to the device that owns the row's expert (one all-to-all),
    runs the rows it receives through its experts, sends the results back (a second
    all-to-all), combines its tokens and gathers every device's tokens.
    """
    num_devices = jax.lax.axis_size(axis_name)
    num_local = num_experts_of(w_gate)
    num_tokens, top_k = expert_ids.shape
    x, expert_ids, expert_weights = this_devices_tokens(
        x, expert_ids, expert_weights, num_local * num_devices, axis_name
    )  # [t, H], i32[t, k], f32[t, k]
    local_tokens = x.shape[0]

    # Send: rows sorted by expert are sorted by owner too. Each owner gets a slot of the
    # worst case (every row), so no row is ever dropped and the shapes stay fixed.
    capacity = local_tokens * top_k  # C
    order, group_sizes = sort_by_expert(expert_ids, num_local * num_devices)
    owner_sizes = group_sizes.reshape(num_devices, num_local)  # i32[n, E / n]
    owner_counts = owner_sizes.sum(1)  # i32[n]
    owner_starts = jnp.cumsum(owner_counts) - owner_counts  # i32[n]
    sorted_ids = expert_ids.reshape(-1)[order]  # i32[C]
    rows = x[order // top_k]  # [C, H]
    owner = sorted_ids // num_local  # i32[C]; n for a padding token's rows
    slot = jnp.arange(capacity) - owner_starts[jnp.minimum(owner, num_devices - 1)]  # i32[C]
    # A padding row's owner n is out of bounds: the scatters drop it, it is sent nowhere.
    send = jnp.zeros((num_devices, capacity, x.shape[1]), x.dtype).at[owner, slot].set(rows)
    send_ids = jnp.full((num_devices, capacity), num_local, jnp.int32)  # num_local: empty
    send_ids = send_ids.at[owner, slot].set(sorted_ids % num_local)

    received = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=False)  # [n, C, H] by source
    received_ids = jax.lax.all_to_all(send_ids, axis_name, 0, 0, tiled=False)  # i32[n, C]
    out = run_received(
        received, received_ids, (w_gate, w_up, w_down), act, gate_bias, up_bias, glu
    )  # [n, C, H] by source

    returned = jax.lax.all_to_all(out, axis_name, 0, 0, tiled=False)  # [n, C, H] by owner
    mine = jnp.where(
        (owner < num_devices)[:, None], returned[jnp.minimum(owner, num_devices - 1), slot], 0
    )  # [C, H]  in this device's expert order
    local = combine(mine, order, expert_weights, x.dtype)  # [t, H]
    return jax.lax.all_gather(local, axis_name, axis=0, tiled=True)[:num_tokens]  # [T, H]


def shared_expert(
    x: jax.Array,  # [T, H]
    weights: MoeWeights,
    act: Activation,
) -> jax.Array:  # [T, H]
    """The dense MLP every token goes through beside its routed experts."""
    assert weights.shared_gate is not None and weights.shared_up is not None
    assert weights.shared_down is not None
    gate = jnp.einsum("TH,HS->TS", x, weights.shared_gate)
    up = jnp.einsum("TH,HS->TS", x, weights.shared_up)
    out = jnp.einsum("TS,SH->TH", act(gate) * up, weights.shared_down)
    if weights.shared_router is not None:
        out = out * jax.nn.sigmoid(jnp.einsum("TH,HO->TO", x, weights.shared_router))
    return out


def moe_block(
    x: jax.Array,  # [T, H]
    weights: MoeWeights,
    config: MoeConfig,
    act: Activation,
    experts_fn: ExpertsFn | None = None,
    num_valid_tokens: jax.Array | None = None,  # i32[]  the rest of x is a bucket's padding
) -> jax.Array:  # [T, H]
    """The experts' MLP of one layer: route, run each token's experts, add the shared one."""
    experts_fn = experts_fn or run_experts
    logits = router_logits(x, weights)
    expert_weights, expert_ids = route(logits, config, weights.router_bias)
    if num_valid_tokens is not None:  # padding: expert E (no group), weight 0
        is_valid = (jnp.arange(x.shape[0]) < num_valid_tokens)[:, None]  # bool[T, 1]
        expert_ids = jnp.where(is_valid, expert_ids, config.num_experts)
        expert_weights = jnp.where(is_valid, expert_weights, 0.0)
    # Only what the model has: the sharded experts_fn passes each to its shard_map by name.
    extra: dict[str, Any] = {
        name: value
        for name, value in (
            ("gate_bias", weights.gate_bias),
            ("up_bias", weights.up_bias),
            ("glu", expert_glu(config)),
        )
        if value is not None
    }
    out = experts_fn(
        x,
        expert_ids,
        expert_weights,
        weights.w_gate,
        weights.w_up,
        weights.w_down,
        act=act,
        **extra,
    )
    if weights.down_bias is not None:
        out = out + weighted_down_bias(expert_ids, expert_weights, weights.down_bias, x.dtype)
    if weights.shared_gate is not None:
        out = out + shared_expert(x, weights, act)
    return out


def router_logits(x: jax.Array, weights: MoeWeights) -> jax.Array:  # [T, H] -> f32[T, E]
    logits = jnp.einsum("TH,HE->TE", x, weights.router, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    if weights.router_logit_bias is not None:
        logits = logits + weights.router_logit_bias.astype(jnp.float32)
    return logits


def weighted_down_bias(
    expert_ids: jax.Array,  # i32[T, k]; E (a padding token's) has no bias
    expert_weights: jax.Array,  # f32[T, k]
    down_bias: jax.Array,  # [E, H]
    dtype: jnp.dtype,
) -> jax.Array:  # [T, H]
    """Sum over each token's experts of weight * that expert's down-projection bias."""
    bias = jnp.take(down_bias, expert_ids, axis=0, mode="fill", fill_value=0)  # [T, k, H]
    return jnp.einsum("TK,TKH->TH", expert_weights, bias.astype(jnp.float32)).astype(dtype)


def reference_moe(
    x: jax.Array,  # [T, H]
    weights: MoeWeights,
    config: MoeConfig,
    act: Activation,
) -> jax.Array:  # [T, H]
    """The same layer as a dense loop over every expert (the oracle of the tests)."""
    expert_weights, expert_ids = route(router_logits(x, weights), config, weights.router_bias)
    glu = expert_glu(config)
    out = jnp.zeros(x.shape, jnp.float32)
    w_gate, w_up, w_down = (
        dequantize(w, x.dtype) if isinstance(w, QArray) else w
        for w in (weights.w_gate, weights.w_up, weights.w_down)
    )
    for expert in range(w_gate.shape[0]):
        gate, up = x @ w_gate[expert], x @ w_up[expert]  # [T, M]
        if weights.gate_bias is not None and weights.up_bias is not None:
            gate, up = gate + weights.gate_bias[expert], up + weights.up_bias[expert]
        y = act(gate) * up if glu is None else glu(gate, up)
        y = y @ w_down[expert]  # [T, H]
        if weights.down_bias is not None:
            y = y + weights.down_bias[expert]
        y = y.astype(jnp.float32)
        weight = jnp.where(expert_ids == expert, expert_weights, 0.0).sum(-1)  # f32[T]
        out = out + weight[:, None] * y
    out = out.astype(x.dtype)
    if weights.shared_gate is not None:
        out = out + shared_expert(x, weights, act)
    return out
