"""Tensor parallelism: the device mesh and every PartitionSpec of the model, spelled only here.

The runner calls ``prepare_tp(config, tensor_parallel_size)`` once at start-up and gets a
``TensorParallel``: a weight ``Placement`` for ``load_weights`` / ``dummy_weights``, the KV-cache
sharding (and a maker that allocates the cache straight into its shards), the jit in/out
shardings of the model step, and the attention op wrapped in ``shard_map`` so the kernel runs on
each device's local heads. Model code names no mesh axis: XLA inserts the collectives from the
shardings of the step's inputs (one all-reduce after each row-parallel projection, a gather of
the vocab-parallel logits).

The layout (Megatron-style, one mesh axis ``"tp"`` of N devices):
  column parallel  wq [H, N, D], bq on the query-head axis; w_gate, w_up [H, I] on I
                   wk, wv [H, K, D], bk, bv on the KV-head axis
  row parallel     wo [N, D, H] on the query-head axis; w_down [I, H] on I
  vocab parallel   embed [V, H] on V; lm_head [H, V] on V (replicated when N does not divide V)
  replicated       the RMSNorm scales (attn_norm, mlp_norm, final_norm, q_norm, k_norm)
  quantized        a QArray's values [out, in] split on the same letters as the weight; its
                   scales and zero points [out] / [out, G] on the output axis (``quantized_specs``);
                   quantized experts' values [E, in, out] as the bf16 experts, their scales
                   [E, out] on E and the output letter as those are (``expert_quantized_specs``)
  KV cache         [P, page, K, D] on the KV-head axis
  LoRA slots       as their base projections (``lora_specs``): the B matrices of q, gate, up
                   [M, R, out] on out, of k, v on the KV view; the A matrices of o and down
                   [M, in, R] on in (their partial products summed by an all-reduce, as the
                   base's); the other A and B matrices replicated
  experts          [E, H, M], [E, M, H] on M (a slice of each expert, one all-reduce), or with
                   --enable-expert-parallel on E (whole experts, tokens sent by all-to-all:
                   expert_parallel.py); the router replicated
  EAGLE-3 head     its layer as any layer (q/k/v read 2H: only their heads split), embed as the
                   target's, lm_head [H, W] on W; fc, the norms and d2t replicated
                   (``eagle3_specs``)
  MTP layers       DeepSeek-V3's next-token layers (``mtp_specs``): the decoder layer as the
                   target's layer of its kind (unquantized), embed and lm_head as the target's;
                   enorm, hnorm, eh_proj and the shared head's norm replicated; their latent
                   pages as the target's (one KV head: whole on every device)

KV heads and the query heads they serve must sit on the same device. With N <= K each device
holds K / N KV heads. With N > K (more devices than KV heads) each KV head is replicated on
N / K devices: the KV side lives on a *view* of the same devices in the same order, shaped
``(kv=K, kv_replica=N / K)``; device d holds query heads [d * Nq / N, (d + 1) * Nq / N) and KV
head d // (N / K), which is exactly the KV head those query heads read under GQA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models import moe
from jaxserve.models.batch import KVCache, kv_page_shapes
from jaxserve.models.decoder import AttentionFn
from jaxserve.models.eagle3 import Eagle3Config, Eagle3Weights
from jaxserve.models.families.fields import WeightField, dim_sizes
from jaxserve.models.families.registry import layer_fields, model_fields
from jaxserve.models.layers import LayerWeights, Weights
from jaxserve.models.loading.field_conversion import Placement
from jaxserve.models.lora import LoraLayer, LoraShapes, LoraWeights
from jaxserve.models.mtp import MtpWeights
from jaxserve.models.quant import QUANTIZED_EXPERT_FIELDS, QUANTIZED_FIELDS, QArray
from jaxserve.models.quant_scheme import QuantScheme, qarray_layout
from jaxserve.runner.parallel.expert_parallel import sharded_experts
from jaxserve.runner.parallel.mesh import (
    KV_AXIS,
    KV_REPLICA_AXIS,
    TP_AXIS,
    kv_mesh,
    make_mesh,
    validate_tensor_parallel_size,
)
from pallas_kernels.ragged_paged_attention import dispatch

# Specs on the KV view. Query heads split over both of its axes, which orders the devices
# exactly as "tp" does, so the two meshes agree and XLA moves no data between them.
_Q_HEADS_ON_KV_VIEW = P(None, (KV_AXIS, KV_REPLICA_AXIS), None)  # q, attention out [T, N, D]
_KV_HEADS = P(None, KV_AXIS, None)  # k, v [T, K, D]
_KV_PAGES = P(None, None, KV_AXIS, None)  # k_pages, v_pages [P, page, K, D]
_SINKS = P((KV_AXIS, KV_REPLICA_AXIS))  # attention sinks [N], with the query heads
# The attention op's keyword arrays split on the query heads, by name.
_PER_HEAD = {"sinks": _SINKS, "q_pe": _Q_HEADS_ON_KV_VIEW}

# NOTE: the weights' specs come from the weight table (jaxserve/models/families/), which
# writes every shape in einsum letters: a dimension named here is split over that mesh axis,
# the others are replicated. Query heads (N) and the MLP's intermediate dim (I) go on "tp",
# KV heads (K) on the KV view; that gives the column / row / vocab parallel layout above.
_SPLIT_DIMS = {"N": TP_AXIS, "I": TP_AXIS, "K": KV_AXIS, "M": TP_AXIS, "S": TP_AXIS}
# Expert parallelism: whole experts (E) on "tp" instead of slices of each (M).
_EXPERT_PARALLEL_DIMS = {"N": TP_AXIS, "I": TP_AXIS, "K": KV_AXIS, "E": TP_AXIS, "S": TP_AXIS}


def _spec(shape: str, split: dict[str, str]) -> P:
    """The spec of a weight whose shape is written in einsum letters (``"HND"``)."""
    return P(*(split.get(dim) for dim in shape))


def quantized_specs(
    field: WeightField,
    config: ModelConfig,
    quant: QuantScheme,
    tensor_parallel_size: int,
    split_dims: dict[str, str],  # einsum letter -> mesh axis, as sharding.py splits weights
) -> QArray:
    """A ``QArray`` of specs: values [out, in] split as the weight's output and input letters
    are, scales and zero points [out] / [out, G] following the output axis (and the input
    axis where the groups split evenly), g_idx replicated."""
    axis_sizes = {
        TP_AXIS: tensor_parallel_size,
        KV_AXIS: min(tensor_parallel_size, config.num_kv_heads),
    }

    def axis(letters: str, size: int) -> str | None:
        name = next((split_dims[d] for d in letters if d in split_dims), None)
        # NOTE: jax shards only evenly: an axis that does not divide stays replicated.
        return name if name is not None and size % axis_sizes[name] == 0 else None

    out_letters, in_letters = field.hf_shape
    parts: dict[str, Any] = {}
    for name, (shape, _) in qarray_layout(field, config, quant).items():
        if name == "g_idx":
            parts[name] = P(None)
        else:
            letters = (out_letters, in_letters)[: len(shape)]
            parts[name] = P(*(axis(ls, n) for ls, n in zip(letters, shape, strict=True)))
    sizes = dim_sizes(config)
    return QArray(
        **parts,
        in_shape=tuple(sizes[d] for d in in_letters),
        out_shape=tuple(sizes[d] for d in out_letters),
        act_quant=quant.act_quant,
    )


def expert_quantized_specs(
    field: WeightField, config: ModelConfig, split_dims: dict[str, str]
) -> QArray:
    """A ``QArray`` of specs for quantized experts (``quant.quantize_experts``): the values
    [E, in, out] split as the bf16 experts are, the scales [E, out] on E and on the output
    letter as the values are."""
    expert, num_in, num_out = tuple(field.shape)  # "EHM" (gate, up) or "EMH" (down)
    sizes = dim_sizes(config)
    specs: dict[str, Any] = {  # specs in the arrays' places
        "q": _spec(field.shape, split_dims),
        "scale": _spec(expert + num_out, split_dims),
    }
    return QArray(**specs, in_shape=(sizes[num_in],), out_shape=(sizes[num_out],))


def _layer_spec(
    field: WeightField,
    config: ModelConfig,
    split: dict[str, str],
    quant: QuantScheme | None,
    tensor_parallel_size: int,
) -> Any:
    """One layer field's spec: a ``P``, or a ``QArray`` of specs for a quantized one."""
    if quant is not None and field.name in QUANTIZED_FIELDS:
        return quantized_specs(field, config, quant, tensor_parallel_size, _SPLIT_DIMS)
    if quant is not None and field.name in QUANTIZED_EXPERT_FIELDS:
        return expert_quantized_specs(field, config, split)
    return _spec(field.shape, split)


def layer_specs(
    config: ModelConfig,
    layer: int | None = None,
    expert_parallel: bool = False,
    quant: QuantScheme | None = None,
    tensor_parallel_size: int = 1,
) -> LayerWeights:
    """PartitionSpecs of layer ``layer`` (None: of any), field for field (None where the model
    has no such tensor); quantized Linear weights as ``QArray``s of specs."""
    split = _EXPERT_PARALLEL_DIMS if expert_parallel else _SPLIT_DIMS
    # A pytree of specs in the weights' own dataclass (its leaves are specs, not arrays).
    specs: dict[str, Any] = {
        f.name: _layer_spec(f, config, split, quant, tensor_parallel_size)
        for f in layer_fields(config, layer)
    }
    return LayerWeights(**specs)


def weight_specs(
    config: ModelConfig,
    tensor_parallel_size: int,
    quant: QuantScheme | None = None,
    expert_parallel: bool = False,
) -> Weights:
    """A ``Weights`` pytree of PartitionSpecs, parallel to the model's weights."""
    split = _vocab_split(config, tensor_parallel_size)
    specs: dict[str, Any] = {f.name: _spec(f.shape, split) for f in model_fields(config)}
    layers = [
        layer_specs(config, i, expert_parallel, quant, tensor_parallel_size)
        for i in range(config.num_layers)
    ]
    return Weights(layers=layers, **specs)


def _vocab_split(config: ModelConfig, tensor_parallel_size: int) -> dict[str, str]:
    """The split of the tensors outside the layers: the layers' split, and the vocabulary (V)
    on "tp" where N divides it."""
    # NOTE: jax shards only evenly; a vocabulary N does not divide stays replicated.
    if config.vocab_size % tensor_parallel_size == 0:
        return _SPLIT_DIMS | {"V": TP_AXIS}
    return _SPLIT_DIMS


def mtp_specs(
    config: ModelConfig, index: int, tensor_parallel_size: int, expert_parallel: bool = False
) -> MtpWeights:
    """An ``MtpWeights`` of PartitionSpecs for MTP layer ``index`` of the target ``config``:
    its decoder layer (layer L + index of the weight table) split as the target's layers of its
    kind are (MLA's heads on "tp", the experts as ``expert_parallel`` says; unquantized: the
    layers load in the model's dtype), embed [V, H] and lm_head [H, V] as the target's (a
    shared one keeps its sharding)."""
    n = tensor_parallel_size
    vocab = _vocab_split(config, n)
    specs: dict[str, Any] = {
        "embed": _spec("VH", vocab),
        # NOTE: the norms and eh_proj [2H, H] are replicated: eh_proj reads the embedding and
        # the target's states (replicated) and writes the residual stream (replicated), once a
        # step; split, its output would need one more all-gather for a GEMM this size.
        "enorm": P(),
        "hnorm": P(),
        "eh_proj": P(),
        "layer": layer_specs(config, config.num_layers + index, expert_parallel, None, n),
        "head_norm": P(),
        "lm_head": _spec("HV", vocab),
    }
    return MtpWeights(**specs)


def eagle3_specs(config: Eagle3Config, tensor_parallel_size: int) -> Eagle3Weights:
    """An ``Eagle3Weights`` of PartitionSpecs: the head's one layer split as a target layer is
    (wq, wk, wv [2H, *, D] on their heads, wo on its input heads, w_gate, w_up, w_down on I),
    the embedding as the target's (the same vocabulary: a shared one keeps its sharding),
    lm_head [H, W] on the draft vocabulary (replicated when N does not divide W)."""
    n = tensor_parallel_size
    model = weight_specs(config.layer, n)
    specs: dict[str, Any] = {
        "embed": model.embed,
        "layer": model.layers[0],
        "lm_head": P(None, TP_AXIS) if config.draft_vocab_size % n == 0 else P(),
        # NOTE: fc [3 H_t, H] is replicated, as the norms and d2t are: it reads the target's
        # states (replicated) and writes the residual stream (replicated), once a call; split,
        # its output would need one more all-gather for a GEMM this size.
        "fc": P(),
        "hidden_norm": P(),
        "final_norm": P(),
        "draft_to_target": P(),
    }
    return Eagle3Weights(**specs)


# The adapter stacks' specs (models/lora.py's LoraLayer fields), following the base projections:
# column parallel (q, k, v, gate, up) split B on its output, row parallel (o, down) A on its input.
_LORA_SPECS = {
    "qkv_a": P(),
    "q_b": P(None, None, TP_AXIS),
    "k_b": P(None, None, KV_AXIS),
    "v_b": P(None, None, KV_AXIS),
    "o_a": P(None, None, TP_AXIS),
    "o_b": P(),
    "gate_up_a": P(),
    "gate_b": P(None, None, TP_AXIS),
    "up_b": P(None, None, TP_AXIS),
    "down_a": P(None, None, TP_AXIS),
    "down_b": P(),
}


def lora_specs(shapes: LoraShapes) -> LoraWeights:
    """A ``LoraWeights`` of PartitionSpecs, layer for layer (None where a layer has no MLP
    stacks: its experts)."""
    layers = []
    for i in range(len(shapes.dims)):
        present = shapes.layer_arrays(i)
        fields = {
            f.name: _LORA_SPECS[f.name] if f.name in present else None
            for f in dataclasses.fields(LoraLayer)
        }
        layers.append(LoraLayer(**fields))  # type: ignore[arg-type]  # specs, not arrays
    return LoraWeights(layers)


def _is_kv_spec(spec: P) -> bool:
    """Whether a spec names the KV view's axes (and so belongs on that mesh)."""
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if KV_AXIS in names:
            return True
    return False


def placement_from(shardings: Weights) -> Placement:
    """A ``Placement`` that looks each weight's path up in a ``Weights`` of shardings."""

    def place(path: tuple[Any, ...], shape: tuple[int, ...]) -> NamedSharding:
        node: Any = shardings
        for key in path:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        if not isinstance(node, NamedSharding):
            raise KeyError(f"no sharding for weight path {path!r} (shape {list(shape)})")
        return node

    return place


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Everything the runner needs to run the model step on a ``"tp"`` mesh."""

    mesh: Mesh
    kv_mesh: Mesh
    config: ModelConfig
    weight_shardings: Weights  # a NamedSharding per weight, parallel to the weights
    kv_sharding: NamedSharding  # each layer's k_pages and v_pages [P, page, K, D]
    replicated: NamedSharding  # the batch, sampling inputs, hidden states
    attention_fn: AttentionFn  # the attention op under shard_map, for decoder.forward
    experts_fn: moe.ExpertsFn | None = None  # the experts under shard_map (None: dense model)
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.mesh.axis_names != (TP_AXIS,):
            raise ValueError(f"mesh.axis_names={self.mesh.axis_names} must be ({TP_AXIS!r},)")

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.devices.size

    @property
    def placement(self) -> Placement:
        """``(path, shape) -> sharding`` for ``load_weights`` / ``dummy_weights``."""
        return placement_from(self.weight_shardings)

    def lora_shardings(self, shapes: LoraShapes) -> LoraWeights:
        """The adapter stacks' NamedShardings (``lora_specs``): KV-side specs on the KV view."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.kv_mesh if _is_kv_spec(spec) else self.mesh, spec),
            lora_specs(shapes),
            is_leaf=lambda x: isinstance(x, P),
        )

    def kv_cache_shardings(self, num_layers: int) -> list[tuple[NamedSharding, NamedSharding]]:
        return [(self.kv_sharding, self.kv_sharding)] * num_layers

    def make_kv_cache(
        self, num_pages: int, page_size: int, dtype: jnp.dtype, num_layers: int | None = None
    ) -> KVCache:
        """A zeroed cache allocated directly in its shards (no device ever holds all of it), of
        ``num_layers`` layers in the model's page shapes (None: the model's layers)."""
        shapes = kv_page_shapes(self.config, num_pages, page_size)  # [P, page, K, D] each
        zeros = [
            jax.jit(lambda shape=shape: jnp.zeros(shape, dtype), out_shardings=self.kv_sharding)
            for shape in shapes
        ]
        count = self.config.num_layers if num_layers is None else num_layers
        return [(zeros[0](), zeros[1]()) for _ in range(count)]

    def step_shardings(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(in_shardings, out_shardings) for ``jit(step(weights, kv_cache, packed inputs,
        previous sampled ids))``."""
        kv = self.kv_cache_shardings(self.config.num_layers)
        return (self.weight_shardings, kv, self.replicated, self.replicated), (kv, self.replicated)

    def put_replicated(self, tree: Any) -> Any:
        """Host arrays (the batch, sampling inputs) -> device arrays replicated on the mesh."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)),
            tree,
        )


def weight_shardings(
    mesh: Mesh,
    config: ModelConfig,
    quant: QuantScheme | None = None,
    expert_parallel: bool = False,
) -> Weights:
    """A ``Weights`` pytree of NamedShardings: KV-side specs on the KV view, the rest on "tp"."""
    view = kv_mesh(mesh, config.num_kv_heads)
    return jax.tree.map(
        lambda spec: NamedSharding(view if _is_kv_spec(spec) else mesh, spec),
        weight_specs(config, mesh.devices.size, quant, expert_parallel),
        is_leaf=lambda x: isinstance(x, P),
    )


def eagle3_shardings(tp: TensorParallel, config: Eagle3Config) -> Eagle3Weights:
    """The head's NamedShardings (``eagle3_specs``) on ``tp``, the head's own ``TensorParallel``
    (its KV view follows the head's KV heads): KV-side specs on the KV view, the rest on "tp"."""
    return jax.tree.map(
        lambda spec: NamedSharding(tp.kv_mesh if _is_kv_spec(spec) else tp.mesh, spec),
        eagle3_specs(config, tp.tensor_parallel_size),
        is_leaf=lambda x: isinstance(x, P),
    )


def mtp_shardings(tp: TensorParallel, index: int) -> MtpWeights:
    """MTP layer ``index``'s NamedShardings (``mtp_specs``) on the target's ``tp``, the experts
    split as the target's are: KV-side specs on the KV view, the rest on "tp"."""
    return jax.tree.map(
        lambda spec: NamedSharding(tp.kv_mesh if _is_kv_spec(spec) else tp.mesh, spec),
        mtp_specs(tp.config, index, tp.tensor_parallel_size, tp.expert_parallel),
        is_leaf=lambda x: isinstance(x, P),
    )


def weight_placement(
    mesh: Mesh,
    config: ModelConfig,
    quant: QuantScheme | None = None,
    expert_parallel: bool = False,
) -> Placement:
    """The ``Placement`` to pass to ``load_weights`` / ``dummy_weights``."""
    validate_tensor_parallel_size(config, mesh.devices.size, expert_parallel)
    return placement_from(weight_shardings(mesh, config, quant, expert_parallel))


def kv_cache_sharding(mesh: Mesh, config: ModelConfig) -> NamedSharding:
    """[P, page, K, D] split on K; replicated per KV head when the mesh has more devices."""
    return NamedSharding(kv_mesh(mesh, config.num_kv_heads), _KV_PAGES)


def sharded_attention(attention_fn: AttentionFn, mesh: Mesh, config: ModelConfig) -> AttentionFn:
    """``attention_fn`` run per device on its local query and KV heads (metadata replicated);
    a latent attention call (``q_pe`` given: DeepSeek-V3) on its query heads and the whole
    latent cache, so the MLA kernel runs per device (``mla.dispatch`` sees the shard_map)."""
    view = kv_mesh(mesh, config.num_kv_heads)
    meta = P()

    def attention(
        q: jax.Array,  # [T, N, D]
        k_pages: jax.Array,  # [P, page, K, D]
        v_pages: jax.Array,  # [P, page, K, D]
        kv_lens: jax.Array,  # i32[S]
        page_indices: jax.Array,  # i32[S, pages_per_seq]
        cu_q_lens: jax.Array,  # i32[S + 1]
        num_seqs: jax.Array,  # i32[1]
        **kwargs: Any,  # sm_scale, sliding_window, soft_cap: static; k_scale, v_scale: f32[];
        # sinks [N], q_pe [T, N, R]: split on the heads
    ) -> jax.Array:  # [T, N, D]
        # An fp8 cache's scales are arrays: they enter the shard_map replicated, by argument;
        # attention sinks (GPT-OSS, [N]) and latent attention's rotary query (DeepSeek-V3,
        # q_pe [T, N, R]) split as the query heads are.
        scale_names = tuple(n for n in ("k_scale", "v_scale") if kwargs.get(n) is not None)
        scales = tuple(jnp.asarray(kwargs[n], jnp.float32) for n in scale_names)
        head_names = tuple(n for n in _PER_HEAD if kwargs.get(n) is not None)
        per_head = tuple(kwargs[n] for n in head_names)
        kwargs = {n: v for n, v in kwargs.items() if n not in ("k_scale", "v_scale", *_PER_HEAD)}

        def local(*args: jax.Array) -> jax.Array:
            arrays, rest = args[:7], args[7:]
            options = dict(zip(scale_names + head_names, rest, strict=True))
            return attention_fn(*arrays, **kwargs, **options)

        # NOTE: check_vma=False: a Pallas kernel is opaque to shard_map's replication checker;
        # the specs below are the whole contract (heads split, metadata identical everywhere).
        # Latent attention's pages have one KV head: the KV view is (kv=1, kv_replica=N), so
        # each device holds the whole latent cache and its N-th of the query heads.
        return jax.shard_map(
            local,
            mesh=view,
            in_specs=(_Q_HEADS_ON_KV_VIEW, _KV_PAGES, _KV_PAGES, meta, meta, meta, meta)
            + (meta,) * len(scales)
            + tuple(_PER_HEAD[n] for n in head_names),
            out_specs=_Q_HEADS_ON_KV_VIEW,
            check_vma=False,
        )(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *scales, *per_head)

    return attention


def sharded_write_kv(
    write_fn: Callable[..., tuple[jax.Array, jax.Array]], mesh: Mesh, config: ModelConfig
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``write_fn(k_pages, v_pages, k, v, slot_mapping)`` run per device on its KV heads.

    A plain scatter (the reference ``write_kv``) is partitioned locally by XLA already; a
    kernel that writes the cache (a custom call XLA cannot partition) needs this wrapper.
    """
    view = kv_mesh(mesh, config.num_kv_heads)
    return jax.shard_map(
        write_fn,
        mesh=view,
        in_specs=(_KV_PAGES, _KV_PAGES, _KV_HEADS, _KV_HEADS, P()),
        out_specs=(_KV_PAGES, _KV_PAGES),
        check_vma=False,
    )


def prepare_tp(
    config: ModelConfig,
    tensor_parallel_size: int | None = None,
    *,
    mesh: Mesh | None = None,
    devices: Sequence[jax.Device] | None = None,
    attention_fn: AttentionFn | None = None,
    quant: QuantScheme | None = None,
    expert_parallel: bool = False,
) -> TensorParallel:
    """The mesh (made here unless given), shardings and sharded attention for one model;
    ``expert_parallel`` splits a mixture of experts by whole experts."""
    if mesh is None:
        if tensor_parallel_size is None:
            raise ValueError("prepare_tp needs tensor_parallel_size or a mesh")
        mesh = make_mesh(tensor_parallel_size, devices=devices)
    validate_tensor_parallel_size(config, mesh.devices.size, expert_parallel)
    return TensorParallel(
        mesh=mesh,
        kv_mesh=kv_mesh(mesh, config.num_kv_heads),
        config=config,
        weight_shardings=weight_shardings(mesh, config, quant, expert_parallel),
        kv_sharding=kv_cache_sharding(mesh, config),
        replicated=NamedSharding(mesh, P()),
        attention_fn=sharded_attention(
            attention_fn or dispatch.ragged_paged_attention, mesh, config
        ),
        experts_fn=(
            sharded_experts(mesh, TP_AXIS, expert_parallel) if config.moe is not None else None
        ),
        # NOTE: as in vLLM, the flag changes only the layers with experts.
        expert_parallel=expert_parallel and config.moe is not None,
    )
