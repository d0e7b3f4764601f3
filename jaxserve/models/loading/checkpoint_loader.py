"""A Hugging Face safetensors checkpoint -> ``Weights`` (random weights: ``dummy.py``).

Several threads read the checkpoint's tensors at once (``checkpoint_reader.py``: positioned
reads through a few reusable host buffers, so peak host memory is those buffers, not the
checkpoint nor one tensor), each tensor sent to the device as it is stored; there a compiled
program brings it to the model's einsum layout and dtype (``field_conversion.py``), and it is
placed whole or in its shards when a ``placement`` function gives a sharding. Loading logs one
line at the end (bytes, seconds, GB/s), and a line at every tenth of the bytes for a checkpoint
of 1 GiB or more (``load_progress.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import HF_LAYER_PREFIX, WeightField, dim_sizes
from jaxserve.models.families.registry import layer_fields, model_fields
from jaxserve.models.layers import FUSED_FIELDS, FusedProjections, LayerWeights, Weights
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError, read_header
from jaxserve.models.loading.field_conversion import (
    Placement,
    dequantized_fp8,
    field_dtype,
    is_quantized,
    is_quantized_experts,
    layout_of,
    part_rows_of,
    place_on_device,
    place_quantized,
    quantized_experts,
    to_field,
    to_field_into,
    write_part,
)
from jaxserve.models.loading.load_progress import GiB, LoadProgress, raise_if_stopped
from jaxserve.models.loading.quant_checkpoint import check_fp8_scale, read_qarray, tensor_shapes
from jaxserve.models.quant import quantize
from jaxserve.models.quant_scheme import QuantScheme

_LOG = logging.getLogger(__name__)
# Host memory the reading threads stage tensors through, in all (two buffers per thread).
STAGING_BYTES = GiB


def read_as_qarray(field: WeightField, scheme: QuantScheme | None) -> bool:
    """Whether a pre-quantized checkpoint's field is read in its own layout (``read_qarray``):
    its Linear weights; not the routed experts, dequantized and quantized again."""
    return (
        scheme is not None
        and scheme.from_checkpoint
        and is_quantized(field, scheme)
        and not is_quantized_experts(field, scheme)
    )


def expected_shapes(
    config: ModelConfig,
    scheme: QuantScheme | None = None,
    scaled: dict[str, str] | None = None,
) -> dict[str, tuple[int, ...] | None]:
    """HF tensor name -> shape in the checkpoint, for every tensor the model needs (None: a
    quantized checkpoint's scale, whose published shapes vary; checked where it is read).
    ``scaled``: fp8 tensors dequantized on load -> their scale tensors (``scaled_tensors``)."""
    shapes: dict[str, tuple[int, ...] | None] = {
        field.hf_name: field.checkpoint_shape_for(config) for field in model_fields(config)
    }
    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config, layer):
            if read_as_qarray(field, scheme):
                assert scheme is not None
                for name, shape in tensor_shapes(field, config, scheme).items():
                    shapes[prefix + name] = shape
            else:
                for name in field.hf_names(config, prefix):
                    shapes[name] = field.checkpoint_shape_for(config)
    for scale in (scaled or {}).values():
        shapes[scale] = None
    return shapes


def scaled_tensors(
    files: dict[str, Path], config: ModelConfig, scheme: QuantScheme | None
) -> dict[str, str]:
    """The fp8 tensors of a pre-quantized checkpoint that the model does not read as
    ``QArray``s -> their scale tensors: the routed experts (quantized again, per channel) and
    the projections kept in the model's dtype (DeepSeek-V3's latent attention and shared
    experts), each dequantized on load. Empty unless ``scheme`` is an fp8 checkpoint's."""
    if scheme is None or not scheme.from_checkpoint or scheme.weight_format != "fp8":
        return {}
    scaled = {}
    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config, layer):
            if read_as_qarray(field, scheme):
                continue
            for name in field.hf_names(config, prefix):
                scale = f"{name.removesuffix('.weight')}.{scheme.scale_name}"
                if name.endswith(".weight") and scale in files:
                    scaled[name] = scale
    return scaled


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it (index file or a directory scan)."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"{model_dir}: no *.safetensors files (only safetensors checkpoints are loaded; "
            "use --load-format dummy for random weights)"
        )
    return {name: file for file in files for name in read_header(file)}


# A base model's checkpoint (``Qwen3Model``, ``MistralModel``: what embedding models publish)
# names its tensors without the prefix of the ``*ForCausalLM`` tables.
BASE_MODEL_PREFIX = "model."


def base_model_names(files: dict[str, Path]) -> dict[str, str]:
    """Table name -> stored name of a base model's tensors (``model.layers.0...`` ->
    ``layers.0...``); empty for a checkpoint that names them with the prefix."""
    if any(name.startswith(BASE_MODEL_PREFIX) for name in files):
        return {}
    return {BASE_MODEL_PREFIX + name: name for name in files if not name.startswith("lm_head.")}


# Checkpoint tensors read elsewhere or safely left: rotary tables the model computes, the
# fp8 KV cache's scales (kv_scales.py) and fp8 checkpoints' static activation scales (unread,
# docs/quantization.md).
UNREAD_OK = (
    "rotary_emb.inv_freq",
    "k_scale",
    "v_scale",
    "kv_scale",
    "input_scale",
    "output_scale",
)


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to an MTP layer (``model.layers.{i}.`` with i at or
    past the model's ``num_layers``)."""
    prefix = HF_LAYER_PREFIX.split("{", 1)[0]
    if not name.startswith(prefix):
        return False
    index = name[len(prefix) :].split(".", 1)[0]
    return index.isdigit() and int(index) >= num_layers


def _warn_unread(model_dir: Path, config: ModelConfig, unread: list[str]) -> None:
    """Log the checkpoint tensors the model does not read: a bias or norm the family table
    does not know would otherwise be dropped without a word. DeepSeek-V3's MTP layers are
    left without a warning (``mtp_checkpoint.py`` reads them for speculative decoding)."""
    model_type = config.model_type
    mtp = {name for name in unread if is_mtp_tensor(name, config.num_layers)}
    if mtp:
        _LOG.info(
            "%s: %d tensor(s) of MTP layers (model.layers.%d and after) not loaded; "
            "speculative_config method='mtp' reads them",
            model_dir,
            len(mtp),
            config.num_layers,
        )
    unread = [n for n in unread if not n.endswith(UNREAD_OK) and n not in mtp]
    if unread:
        shown = ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else "")
        _LOG.warning(
            "%s: %d checkpoint tensor(s) are not in the %s weight table and are not read: %s; "
            "if the model needs them its outputs will be wrong",
            model_dir,
            len(unread),
            model_type,
            shown,
        )


@dataclasses.dataclass
class FieldJob:
    """Checkpoint tensors read together, and the fields made from them (a fused tensor's
    parts, an expert field's experts); a pre-quantized field reads its own tensors."""

    names: tuple[str, ...]  # the checkpoint tensors it reads
    fields: list[tuple[tuple[Any, ...], WeightField, str]]  # (path in Weights, field, prefix)
    on_host: bool = False  # a pre-quantized field: its tensors converted on the host
    scales: tuple[str, ...] = ()  # fp8 tensors dequantized on load: their scales, name by name


def field_jobs(
    config: ModelConfig, scheme: QuantScheme | None, scaled: dict[str, str] | None = None
) -> list[FieldJob]:
    """Every field's job, in the weight table's order (``scaled``: ``scaled_tensors``)."""
    jobs: dict[Any, FieldJob] = {}
    scaled = scaled or {}

    def add(path: tuple[Any, ...], field: WeightField, prefix: str) -> None:
        if read_as_qarray(field, scheme):
            assert scheme is not None
            names = tuple(prefix + name for name in tensor_shapes(field, config, scheme))
            jobs[path] = FieldJob(names, [(path, field, prefix)], on_host=True)
            return
        names = tuple(field.hf_names(config, prefix))
        if names not in jobs:
            scales = tuple(scaled[name] for name in names if name in scaled)
            if scales and len(scales) != len(names):
                missing = next(name for name in names if name not in scaled)
                raise WeightsError(f"tensor {missing!r} has no {scheme and scheme.scale_name}")
            jobs[names] = FieldJob(names, [], scales=scales)
        jobs[names].fields.append((path, field, prefix))

    for layer in range(config.num_layers):
        prefix = HF_LAYER_PREFIX.format(layer=layer)
        for field in layer_fields(config, layer):
            add(("layers", layer, field.name), field, prefix)
    for field in model_fields(config):
        add((field.name,), field, "")
    return list(jobs.values())


def default_num_threads() -> int:
    return min(8, os.cpu_count() or 1)


def load_weights(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    dtype: jnp.dtype = jnp.bfloat16,
    placement: Placement | None = None,
    progress_above_bytes: int = GiB,
    scheme: QuantScheme | None = None,
    num_threads: int | None = None,
    staging_bytes: int = STAGING_BYTES,
    fuse: bool = False,
    stop: threading.Event | None = None,
) -> Weights:
    """Read a safetensors checkpoint into ``Weights`` (missing or misshapen tensors raise).

    ``num_threads`` threads (default: up to 8) read tensors at once, each through two of the
    reader's staging buffers (``staging_bytes`` of host memory in all), and convert them on
    the device. With a ``scheme`` the Linear weights become ``QArray``s: read as the checkpoint
    stores them, or quantized here on the device (``--quantization fp8 | int8``).
    A checkpoint of ``progress_above_bytes`` or more logs its progress at every tenth.
    ``fuse`` (one device, unquantized): each layer's q/k/v and gate/up are written into their
    joined arrays (``layers.FusedProjections``) as they load, as ``fuse_projections`` joins them.
    Once ``stop`` is set, the next tensor read raises ``LoadCancelled``.
    """
    model_dir = Path(model_dir)
    files = tensor_files(model_dir)
    stored_names = base_model_names(files)
    if stored_names:
        files = {name: files[stored] for name, stored in stored_names.items()}
    progress = LoadProgress(sorted(set(files.values())), progress_above_bytes)
    scaled = scaled_tensors(files, config, scheme)
    shapes = expected_shapes(config, scheme, scaled)
    _check_complete(model_dir, files, shapes)
    _warn_unread(model_dir, config, sorted(set(files) - set(shapes)))
    num_threads = num_threads or default_num_threads()
    num_buffers = 2 * num_threads
    buffer_bytes = max(64, staging_bytes // num_buffers // 64 * 64)
    reader = CheckpointReader(files, progress.add, num_buffers, buffer_bytes, stored_names)
    with reader, ThreadPoolExecutor(num_threads, thread_name_prefix="load") as pool:
        _check_shapes(reader, shapes)  # every error before a byte is read
        # Staged on the devices of the weights' mesh in turn (one device's link carrying all
        # bytes would be the slowest part), then placed in their shards from there.
        embed = placement(("embed",), (1, 1)) if placement is not None else None
        devices: list[Any] = sorted(embed.addressable_devices, key=str) if embed else [None]
        jobs = field_jobs(config, scheme, scaled)
        # On one device every field's memory is taken first, in one run, before any piece is
        # sent (see to_field_into): the weights end as one block, under the free memory.
        parts = _fused_parts(config) if fuse and placement is None and scheme is None else {}
        memory = _take_memory(jobs, parts, config, dtype, scheme) if placement is None else {}
        load = _Load(model_dir, config, dtype, placement, scheme, stop, reader, parts, memory)
        values = _run_jobs(pool, jobs, load, files, devices)
    progress.finish()
    layers = []
    for layer in range(config.num_layers):
        paths = [("layers", layer, f.name) for f in layer_fields(config, layer)]
        fields = {path[2]: values[path] for path in paths if path not in parts}
        lw = LayerWeights(**fields)
        layers.append(_with_fused(lw, layer, memory))
    return Weights(layers=layers, **{f.name: values[(f.name,)] for f in model_fields(config)})


def _check_complete(
    model_dir: Path, files: dict[str, Path], shapes: dict[str, tuple[int, ...] | None]
) -> None:
    """Every tensor the model needs is in the checkpoint (the first missing one is named)."""
    missing = [name for name in shapes if name not in files]
    if missing:
        first = missing[0]
        shape = shapes[first]
        expected = f" (expected shape {list(shape)})" if shape is not None else ""
        raise WeightsError(
            f"{model_dir}: tensor {first!r}{expected} is missing "
            f"from the checkpoint ({len(missing)} missing in all)"
        )


def _check_shapes(reader: CheckpointReader, shapes: dict[str, tuple[int, ...] | None]) -> None:
    """Every needed tensor has a dtype the reader reads and the shape config.json gives."""
    for name, shape in shapes.items():
        info = reader.info(name)
        info.dtype  # noqa: B018 (a dtype the reader cannot read raises here)
        if shape is not None and info.shape != shape:
            raise WeightsError(
                f"{info.file.name}: tensor {name!r} has shape {list(info.shape)}, "
                f"expected {list(shape)} from config.json"
            )


def _run_jobs(
    pool: ThreadPoolExecutor,
    jobs: list[FieldJob],
    load: _Load,
    files: dict[str, Path],
    devices: list[Any],
) -> dict[tuple[Any, ...], Any]:
    """Every job run on the pool, in the order of its bytes in the files, staged on the
    devices in turn; path -> value. The first error in table order is the one raised."""
    start = {  # read in the order of the bytes in the files
        id(job): min((str(files[name]), load.reader.info(name).begin) for name in job.names)
        for job in jobs
    }
    order = sorted(jobs, key=lambda job: start[id(job)])
    futures = {
        id(job): pool.submit(load.run, job, devices[i % len(devices)])
        for i, job in enumerate(order)
    }
    values: dict[tuple[Any, ...], Any] = {}
    try:
        for job in jobs:  # the first error in table order is the one raised
            values.update(futures.pop(id(job)).result())
    except BaseException:
        pool.shutdown(cancel_futures=True)
        raise
    return values


@dataclasses.dataclass
class _Load:
    """What the reading threads of one ``load_weights`` share; ``run`` is one thread's job."""

    model_dir: Path
    config: ModelConfig
    dtype: jnp.dtype
    placement: Placement | None
    scheme: QuantScheme | None
    stop: threading.Event | None
    reader: CheckpointReader
    parts: FusedParts  # the parts written in place into their layer's joined array
    memory: dict[tuple[Any, ...], jax.Array]  # fields' device memory, taken ahead (one device)
    locks: dict[tuple[Any, ...], threading.Lock] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.locks = {joined: threading.Lock() for joined, _, _ in self.parts.values()}

    def run(self, job: FieldJob, device: Any) -> dict[tuple[Any, ...], Any]:
        """The job's tensors read and made into its fields: path -> value (a part written in
        place has none)."""
        if self.stop is not None:
            raise_if_stopped(self.stop)
        if job.on_host:
            return self._read_quantized(job)
        pieces = self.reader.read_to_device(job.names, device)
        shape = (len(job.names), *self.reader.info(job.names[0]).shape)
        if job.scales:  # fp8 tensors, dequantized to the model's dtype
            pieces = self._dequantized(job, pieces, shape, device)
        made = {}
        for path, field, _ in job.fields:
            value = self._to_field(path, field, pieces, shape)
            if value is not None:
                made[path] = value
        jax.block_until_ready(made)  # and the pieces' device memory is free again
        return made

    def _dequantized(
        self, job: FieldJob, pieces: list[jax.Array], shape: tuple, device: Any
    ) -> list[jax.Array]:
        """A job's fp8 tensors times their scales, as one piece in the model's dtype."""
        scheme = self.scheme
        assert scheme is not None
        scale_shape = (len(job.scales), *self.reader.info(job.scales[0]).shape)
        try:
            check_fp8_scale(job.names[0], shape[1:], scale_shape[1:], scheme)
        except ValueError as exc:
            raise WeightsError(f"{self.model_dir}: {exc}") from exc
        scales = self.reader.read_to_device(job.scales, device)
        block = (scheme.out_block, scheme.group_size) if scheme.group_size else None
        dtype = jnp.dtype(self.dtype)
        return [dequantized_fp8(pieces, scales, shape, scale_shape, block, dtype)]

    def _read_quantized(self, job: FieldJob) -> dict[tuple[Any, ...], Any]:
        """A pre-quantized field: its tensors converted on the host, then placed."""
        ((path, field, prefix),) = job.fields
        scheme = self.scheme
        assert scheme is not None
        try:
            w = read_qarray(self.reader.read_to_host, prefix, field, self.config, scheme)
        except ValueError as exc:
            raise WeightsError(f"{self.model_dir}: {exc}") from exc
        return {path: place_quantized(w, path, self.placement, scheme.act_quant)}

    def _to_field(
        self, path: tuple[Any, ...], field: WeightField, pieces: list[jax.Array], shape: tuple
    ) -> Any:
        """One field from its checkpoint pieces on the device; None for a part written in
        place into its joined array."""
        config, scheme = self.config, self.scheme
        if path in self.parts:  # written in place into its layer's fused array (unquantized)
            joined, offset, _ = self.parts[path]
            with self.locks[joined]:
                whole = write_part(
                    self.memory.pop(joined), pieces, layout_of(field), config, shape, offset
                )
                self.memory[joined] = jax.block_until_ready(whole)
            return None
        if path in self.memory:
            return to_field_into(self.memory.pop(path), pieces, layout_of(field), config, shape)
        return field_from_pieces(
            pieces, shape, path, field, config, self.dtype, self.placement, scheme
        )


def field_from_pieces(
    pieces: list[Any],
    shape: tuple,
    path: tuple[Any, ...],
    field: WeightField,
    config: ModelConfig,
    dtype: Any,
    placement: Placement | None,
    scheme: QuantScheme | None,
) -> Any:
    """One field from its checkpoint tensors' pieces (``shape``: [number of tensors, *one
    tensor's shape]), converted on their device, quantized where ``scheme`` says, placed."""
    if is_quantized_experts(field, scheme):  # in the model's layout, then quantized
        assert scheme is not None
        value = to_field(pieces, layout_of(field), config, shape, field_dtype(field, dtype))
        experts = quantized_experts(value, scheme.weight_format)
        del value
        return place_quantized(experts, path, placement, act_quant=False)
    if is_quantized(field, scheme):  # on the device (op by op)
        assert scheme is not None
        sizes = dim_sizes(config)
        w = quantize(
            part_rows_of(pieces, layout_of(field), config, shape),
            scheme.weight_format,
            tuple(sizes[d] for d in field.hf_shape[1]),
            tuple(sizes[d] for d in field.hf_shape[0]),
        )
        return place_quantized(w, path, placement, scheme.act_quant)
    value = to_field(pieces, layout_of(field), config, shape, field_dtype(field, dtype))
    return place_on_device(value, path, placement)


def field_from_tensors(
    tensors: list[Any],
    path: tuple[Any, ...],
    field: WeightField,
    config: ModelConfig,
    dtype: Any,
    placement: Placement | None = None,
    scheme: QuantScheme | None = None,
) -> Any:
    """One field from its whole checkpoint tensors (arrays on a device or the host, as
    ``field.hf_names`` lists them), as the loader makes it from their pieces."""
    shape = (len(tensors), *jnp.shape(tensors[0]))
    return field_from_pieces(list(tensors), shape, path, field, config, dtype, placement, scheme)


# path of a part -> (path of the joined array, the part's offset on axis 1, the joined shape)
FusedParts = dict[tuple[Any, ...], tuple[tuple[Any, ...], int, tuple[int, ...]]]


def _fused_parts(config: ModelConfig) -> FusedParts:
    """Where each layer's q/k/v (and, in a layer that has them, gate/up) go in the arrays
    ``layers.fuse_layer`` joins them into, for the layers it joins."""
    parts: FusedParts = {}
    for layer in range(config.num_layers):
        fields = {f.name: f for f in layer_fields(config, layer) if not f.per_expert}
        _, qkv = FUSED_FIELDS[0]
        if not set(qkv) <= set(fields):
            continue  # no q/k/v to join: the layer stays as it is (and so do gate/up)
        for joined, names in FUSED_FIELDS:
            if not set(names) <= set(fields):
                continue  # a layer with experts: gate/up are theirs
            shapes = [fields[name].shape_for(config) for name in names]
            whole = (shapes[0][0], sum(shape[1] for shape in shapes), *shapes[0][2:])
            offset = 0
            for name, shape in zip(names, shapes, strict=True):
                parts[("layers", layer, name)] = (("layers", layer, joined), offset, whole)
                offset += shape[1]
    return parts


def _take_memory(
    jobs: list[FieldJob],
    parts: FusedParts,
    config: ModelConfig,
    dtype: jnp.dtype,
    scheme: QuantScheme | None,
) -> dict[tuple[Any, ...], jax.Array]:
    """Every field's device memory (a joined array's once for its parts), in table order."""
    memory: dict[tuple[Any, ...], jax.Array] = {}
    for job in jobs:
        for path, field, _ in job.fields:
            if job.on_host or is_quantized(field, scheme):
                continue
            if path in parts:
                joined, _, whole = parts[path]
                if joined not in memory:
                    memory[joined] = jnp.zeros(whole, field_dtype(field, dtype))
            else:
                memory[path] = jnp.zeros(field.shape_for(config), field_dtype(field, dtype))
    return memory


def _with_fused(lw: LayerWeights, layer: int, memory: dict) -> LayerWeights:
    """The layer with its joined arrays, when the load wrote its parts into them."""
    wqkv = memory.pop(("layers", layer, FUSED_FIELDS[0][0]), None)
    if wqkv is None:
        return lw
    gate_up = memory.pop(("layers", layer, FUSED_FIELDS[1][0]), None)
    return dataclasses.replace(lw, fused=FusedProjections(wqkv, gate_up))
