"""A speculative drafter's device memory planned from its config alone, for ``jaxserve
capacity --speculative-config``: what ``PagedDrafter.device_bytes`` measures once the drafter
has loaded, and the engine takes out of the KV cache's budget (``Capacity.with_drafter``).

Per device, as the drafter holds it:
- its own weights, in the serving dtype (the fields kept in float32 at 4 bytes), less the
  target's arrays it reads: an EAGLE-3 head without ``embed_tokens`` reads the target's
  embedding, and an MTP layer the target's embedding and, without a head of its own, the
  target's ``lm_head`` (a target with tied embeddings has none: the layer then holds the
  embedding's transpose, its own);
- its pages: a sequence's ``max_model_len + k`` positions for each of the sequences it drafts
  for (``disable_by_batch_size``, at most ``max_num_seqs``), of its own layers' K and V (a
  draft model's layers, an EAGLE-3 head's one layer, the MTP layers' latent);
- for EAGLE-3 and MTP, the two ``[T, state_dim]`` arrays of target states the runner keeps
  for it (``TargetStatesDrafter.kept_bytes``).

Under tensor parallelism the weights count a 1/N share each, as the target's do in
``plan_capacity``, the pages their KV heads per device, and the kept states whole (they are
replicated). An n-gram drafter holds nothing on the device.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxserve.config import ModelConfig
from jaxserve.engine_config import SpeculativeConfig
from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.families.registry import layer_fields, load_model_config
from jaxserve.models.loading.checkpoint_loader import tensor_files
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.loading.eagle3_checkpoint import (
    check_head_quantization,
    expected_shapes,
    read_eagle3_config,
)
from jaxserve.models.loading.mtp_checkpoint import require_mtp_layers
from jaxserve.models.quant_scheme import resolve_scheme, weight_bytes
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.capacity import cache_bytes_per_token, kv_heads_per_device

INT32_BYTES = FLOAT32_BYTES = 4


def planned_drafter_bytes(
    spec: SpeculativeConfig,
    target: ModelConfig,
    target_dir: Path,
    *,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,  # the engine's (resolved)
    max_num_batched_tokens: int,
    tensor_parallel_size: int = 1,
) -> int:
    """Per device, the bytes ``spec``'s drafter holds beside the target (0: an n-gram
    drafter); a ``ConfigError`` or ``WeightsError`` names a drafter that would not load."""
    if spec.method == "ngram":
        return 0
    tp = tensor_parallel_size
    seqs = min(spec.max_batch_size, max_num_seqs)
    buckets = Buckets.of(  # the drafter's own, as ``PagedDrafter`` makes them
        max_num_batched_tokens=max(max_num_batched_tokens, seqs),
        max_num_seqs=seqs,
        max_model_len=max_model_len + spec.num_speculative_tokens,
        block_size=block_size,
    )
    num_slots = seqs * buckets.pages_per_seq * block_size
    # Its largest call holds at least the target's largest step's rows.
    rows = buckets.token_buckets[-1]
    if spec.method == "draft_model":
        assert spec.model is not None  # SpeculativeConfig checks it
        draft = load_model_config(spec.model)
        scheme = resolve_scheme(spec.quantization, Path(spec.model))  # as load_draft reads it
        weights = weight_bytes(draft, dtype_bytes, scheme) // tp
        return weights + num_slots * cache_bytes_per_token(draft, tp, dtype_bytes)
    if spec.method == "eagle3":
        assert spec.model is not None
        check_head_quantization(spec.quantization, tp)  # as load_head refuses it
        quantized = spec.quantization is not None
        return _eagle3_bytes(
            Path(spec.model), target, dtype_bytes, num_slots, tp, rows, quantized=quantized
        )
    if spec.method == "mtp":
        return _mtp_bytes(target, target_dir, dtype_bytes, num_slots, tp, rows)
    raise AssertionError(f"no plan for the drafting method {spec.method!r}")


def _eagle3_bytes(
    head_dir: Path,
    target: ModelConfig,
    dtype_bytes: int,
    num_slots: int,
    tp: int,
    rows: int,
    quantized: bool = False,  # speculative_config quantization: the Linear weights in 8 bits
) -> int:
    """The head's tensors (``expected_shapes``; quantized, each Linear weight [out, in] one
    byte a value and a float32 scale an output, ``quantized_head``), its embedding where it
    stores one, its map from draft to target ids (int32), its one layer's pages, and the three
    aux layers' states kept for it."""
    config = read_eagle3_config(head_dir)
    weights = config.draft_vocab_size * INT32_BYTES
    for shape in expected_shapes(config).values():
        if quantized and len(shape) == 2:  # a Linear weight
            weights += math.prod(shape) + shape[0] * FLOAT32_BYTES
        else:
            weights += math.prod(shape) * dtype_bytes
    if _stores(head_dir, "embed_tokens.weight"):
        weights += config.vocab_size * config.hidden_size * dtype_bytes
    layer = config.layer
    per_slot = 2 * kv_heads_per_device(layer.num_kv_heads, tp) * layer.head_dim * dtype_bytes
    states = 2 * rows * target.hidden_size * len(config.aux_layers(target.num_layers))
    return weights // tp + num_slots * per_slot + states * dtype_bytes


def _mtp_bytes(
    target: ModelConfig, target_dir: Path, dtype_bytes: int, num_slots: int, tp: int, rows: int
) -> int:
    """Each MTP layer's decoder layer (the target's fields, as served), its two norms,
    ``eh_proj`` [2H, H] and its head's norm; its head where it stores one (or the tied
    embedding's transpose); its latent pages; and the final states kept for it."""
    num_layers = require_mtp_layers(target_dir)
    stored = _stored_names(target_dir)
    h = target.hidden_size
    weights = 0
    for index in range(num_layers):
        layer = target.num_layers + index
        for field in layer_fields(target, layer):
            itemsize = FLOAT32_BYTES if field.is_float32 else dtype_bytes
            weights += math.prod(field.shape_for(target)) * itemsize
        weights += (3 * h + 2 * h * h) * dtype_bytes  # enorm, hnorm, head norm; eh_proj
        head = HF_LAYER_PREFIX.format(layer=layer) + "shared_head.head.weight"
        if stored is None or head in stored or target.tie_word_embeddings:
            weights += target.vocab_size * h * dtype_bytes
    per_slot = cache_bytes_per_token(target, tp, dtype_bytes) // target.num_layers
    states = 2 * rows * h * dtype_bytes
    return weights // tp + num_layers * num_slots * per_slot + states


def _stored_names(model_dir: Path) -> set[str] | None:
    """The tensor names a checkpoint stores (None: it has no safetensors to read)."""
    try:
        return set(tensor_files(model_dir))
    except WeightsError:
        return None


def _stores(model_dir: Path, name: str) -> bool:
    """Whether the checkpoint stores ``name`` (with or without a ``model.`` prefix); one without
    safetensors counts as storing it, the larger plan."""
    stored = _stored_names(model_dir)
    return stored is None or name in stored or "model." + name in stored
