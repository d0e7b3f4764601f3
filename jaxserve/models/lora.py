"""LoRA adapters on the device: every adapter slot's A and B matrices stacked per projection, and
the per-token product ``x @ A[slot] @ B[slot]`` the decoder adds to each projection's output.

``LoraWeights`` holds, per layer, the stacks of ``--max-loras`` slots, each zero-padded to
``--max-lora-rank`` (``R``), with the adapter's scaling folded into B; a projection an adapter
does not target is zeros in its slot. The stacks keep one shape whatever is loaded, so writing an
adapter into a slot (``runner/lora_slots.py``, from ``loading/peft_adapter.py``'s host arrays)
compiles nothing. Each token carries its slot (``LoraInputs.token_slots``, i32[T]): 0 is the base
model (no adapter), slot s >= 1 is row s - 1 of the stacks.

The product (``lora_delta``) is a segmented matmul written as two dense products over all
slots, the tokens' one-hot slot mask between them: ``x [T, in]`` times each slot's ``A [R, in]``
(stored X-minor, as PEFT writes lora_A) -> ``[T, M, R]``, masked to each token's own slot, then
``@ B [M * R, out]``. It is exact (other slots contribute
zeros), has no gather or sort, and costs ``M * R`` extra columns per projection: with 8 slots of
rank 16 that is 128 columns beside q_proj's 4,096. ``lora_delta_ragged`` is the same product with
``jax.lax.ragged_dot`` over tokens sorted by slot (tested equal). The decoder's projections
(``qkv_deltas`` ... ``down_delta``) take the product from ``pallas_kernels.lora.dispatch``: on
one NVIDIA GPU with more than 4 slots the grouped Pallas Triton kernel (tokens sorted by slot,
each used slot's A and B read once, none of an empty slot's), elsewhere this dense form
(docs/lora.md).

Einsum letters: T tokens, M slots, R rank, H hidden, I intermediate; X a projection's inputs and
O its outputs (flattened heads).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from pallas_kernels.lora import dispatch, reference

# The projections an adapter may target, PEFT's module names -> ours. q/k/v share one input
# (their A matrices are joined: one GEMM), as do gate/up.
LORA_MODULES = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraLayer:
    """One layer's slots. A matrices are stored ``[M, R, in]`` (X-minor, PEFT's lora_A
    layout); those of projections that read the same input are joined on their rank axis (q, k,
    v; gate, up). B matrices are scaled by the adapter's scaling."""

    qkv_a: jax.Array  # [M, 3R, H]  q, k, v
    q_b: jax.Array  # [M, R, N*D]
    k_b: jax.Array  # [M, R, K*D]
    v_b: jax.Array  # [M, R, K*D]
    o_a: jax.Array  # [M, R, N*D]
    o_b: jax.Array  # [M, R, H]
    gate_up_a: jax.Array | None  # [M, 2R, H]  gate, up; None on a layer with experts
    gate_b: jax.Array | None  # [M, R, I]
    up_b: jax.Array | None  # [M, R, I]
    down_a: jax.Array | None  # [M, R, I]
    down_b: jax.Array | None  # [M, R, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeights:
    layers: list[LoraLayer]


@dataclasses.dataclass(frozen=True)
class LoraShapes:
    """The stacks' geometry: slots, rank, and each projection's (in, out) per layer."""

    num_slots: int  # M = --max-loras
    max_rank: int  # R = --max-lora-rank
    # module -> (in, out), e.g. "q" -> (H, N * D); gate/up/down absent on layers with experts
    dims: tuple[dict[str, tuple[int, int]], ...]

    def layer_arrays(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Field of ``LoraLayer`` -> its shape, for ``layer`` (absent fields: None)."""
        m, r, dims = self.num_slots, self.max_rank, self.dims[layer]
        shapes: dict[str, tuple[int, ...]] = {
            "qkv_a": (m, 3 * r, dims["q"][0]),
            "o_a": (m, r, dims["o"][0]),
        }
        for name in ("q", "k", "v", "o"):
            shapes[f"{name}_b"] = (m, r, dims[name][1])
        if "gate" in dims:
            shapes["gate_up_a"] = (m, 2 * r, dims["gate"][0])
            shapes["down_a"] = (m, r, dims["down"][0])
            for name in ("gate", "up", "down"):
                shapes[f"{name}_b"] = (m, r, dims[name][1])
        return shapes


def lora_shapes(config: ModelConfig, max_loras: int, max_rank: int) -> LoraShapes:
    """The stacks of a model: attention on every layer, the MLP on layers without experts.
    Latent attention (DeepSeek-V3) has other projections: a ``ValueError``."""
    if config.mla is not None:
        raise ValueError(
            f"LoRA adapters are not supported on multi-head latent attention "
            f"(model_type={config.model_type!r}); see docs/lora.md"
        )
    h, q, kv = config.hidden_size, config.q_size, config.num_kv_heads * config.head_dim
    dims = []
    for layer in range(config.num_layers):
        layer_dims = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
        if not config.is_moe_layer(layer):
            i = config.intermediate_size
            layer_dims |= {"gate": (h, i), "up": (h, i), "down": (i, h)}
        dims.append(layer_dims)
    return LoraShapes(max_loras, max_rank, tuple(dims))


def zeros(shapes: LoraShapes, dtype: jnp.dtype) -> LoraWeights:
    """Every slot empty (zeros): what the runner allocates at start-up."""
    layers = []
    for i in range(len(shapes.dims)):
        arrays = {k: jnp.zeros(s, dtype) for k, s in shapes.layer_arrays(i).items()}
        fields = {f.name: arrays.get(f.name) for f in dataclasses.fields(LoraLayer)}
        layers.append(LoraLayer(**fields))  # type: ignore[arg-type]
    return LoraWeights(layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraInputs:
    """What the decoder needs of LoRA in one step: the stacks and each token's slot."""

    weights: LoraWeights
    token_slots: jax.Array  # i32[T]  0: no adapter; s >= 1: slot row s - 1

    def slot_mask(self, dtype: jnp.dtype) -> jax.Array:  # [T, M]
        """Each token's one-hot slot row (all zeros for the base model)."""
        num_slots = self.weights.layers[0].qkv_a.shape[0]
        rows = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
        return (self.token_slots[:, None] == rows[None, :]).astype(dtype)

    def routing(self, dtype: jnp.dtype) -> LoraRouting:
        """The step's tokens -> slots, as every layer's projections read them."""
        return LoraRouting(self.token_slots, self.slot_mask(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraRouting:
    """Each token's slot, and its one-hot row (the dense product's; XLA drops it when the
    kernel runs)."""

    token_slots: jax.Array  # i32[T]  0: no adapter
    mask: jax.Array  # [T, M]


def lora_delta(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, R, X]
    b: jax.Array,  # [M, R, O]
    mask: jax.Array,  # [T, M]  ``LoraInputs.slot_mask``
) -> jax.Array:  # [T, O]
    """The LoRA term of one projection (its scaling is in b): the dense product's GEMM form
    (``pallas_kernels.lora.reference``), one projection."""
    return reference.form_deltas(x, a, (b,), mask, "gemm")[0]


def lora_delta_ragged(
    x: jax.Array,  # [T, X]
    a: jax.Array,  # [M, R, X]
    b: jax.Array,  # [M, R, O]
    token_slots: jax.Array,  # i32[T]  0: none
) -> jax.Array:  # [T, O]
    """``lora_delta`` as a grouped matmul: tokens sorted by slot, ``jax.lax.ragged_dot`` over
    the groups, then put back in order. The base model's tokens (slot 0) form a group of
    their own multiplied by zeros."""
    num_slots = a.shape[0]
    order = jnp.argsort(token_slots, stable=True)
    sizes = jnp.bincount(token_slots, length=num_slots + 1).astype(jnp.int32)  # i32[M + 1]
    zero_a = jnp.zeros((1, *a.shape[1:]), a.dtype)
    zero_b = jnp.zeros((1, *b.shape[1:]), b.dtype)
    a_kn = jnp.swapaxes(jnp.concatenate([zero_a, a]), 1, 2)  # [M + 1, X, R]: ragged_dot's rhs
    xa = jax.lax.ragged_dot(x[order], a_kn, sizes)  # [T, R]
    y = jax.lax.ragged_dot(xa.astype(x.dtype), jnp.concatenate([zero_b, b]), sizes)  # [T, O]
    return jnp.zeros_like(y).at[order].set(y)


# -- the decoder's projections ------------------------------------------------------------------


class LayerLora(NamedTuple):
    """A layer's slots and the step's tokens -> slots, as its projections read them."""

    layer: LoraLayer
    route: LoraRouting
    # The projection's input as a norm's unscaled rows and its weight (the input is
    # ``weight * rows``, as ``layers.rms_norm`` returns it): the kernel scales the rows as it
    # reads them, so XLA need not write the normed rows for it beside the base GEMM (which
    # takes the norm into its prologue). Only q/k/v and gate/up read it (``with_normed``).
    normed: tuple[jax.Array, jax.Array] | None = None


def with_normed(lora: LayerLora | None, rows: jax.Array, weight: jax.Array) -> LayerLora | None:
    """``lora`` with its input as ``weight * rows`` (see ``LayerLora.normed``)."""
    return None if lora is None else lora._replace(normed=(rows, weight))


def _deltas(x: jax.Array, a: jax.Array, bs: tuple[jax.Array, ...], lora: LayerLora, normed: bool):
    """The terms of ``x @ a @ b`` for each b; ``normed``: x is ``lora.normed``'s product."""
    x_scale = None
    if normed and lora.normed is not None:
        x, x_scale = lora.normed
    return dispatch.lora_deltas(x, a, bs, lora.route.token_slots, lora.route.mask, x_scale)


def qkv_deltas(
    x: jax.Array,  # [T, H]  the attention's normed input
    lora: LayerLora,
    q_shape: tuple[int, ...],  # (N, D)
    kv_shape: tuple[int, ...],  # (K, D)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [T, N, D], [T, K, D], [T, K, D]
    """The q, k and v terms: one shrink for the three (their A matrices joined)."""
    layer = lora.layer
    q, k, v = _deltas(x, layer.qkv_a, (layer.q_b, layer.k_b, layer.v_b), lora, normed=True)
    t = x.shape[0]
    return q.reshape(t, *q_shape), k.reshape(t, *kv_shape), v.reshape(t, *kv_shape)


def o_delta(out: jax.Array, lora: LayerLora) -> jax.Array:  # [T, N, D] -> [T, H]
    layer = lora.layer
    rows = out.reshape(out.shape[0], -1)
    return _deltas(rows, layer.o_a, (layer.o_b,), lora, normed=False)[0]


def gate_up_deltas(x: jax.Array, lora: LayerLora) -> tuple[jax.Array, jax.Array]:  # [T, I] x2
    """The gate and up terms: one shrink for both."""
    layer = lora.layer
    assert layer.gate_up_a is not None and layer.gate_b is not None and layer.up_b is not None
    gate, up = _deltas(x, layer.gate_up_a, (layer.gate_b, layer.up_b), lora, normed=True)
    return gate, up


def down_delta(h: jax.Array, lora: LayerLora) -> jax.Array:  # [T, I] -> [T, H]
    layer = lora.layer
    assert layer.down_a is not None and layer.down_b is not None
    return _deltas(h, layer.down_a, (layer.down_b,), lora, normed=False)[0]
