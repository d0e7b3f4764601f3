"""``jaxserve convert``'s work: a model loaded as ``serve`` would serve it (``--dtype``,
``--quantization``, ``--tensor-parallel-size`` read as ``serve`` reads them, the weights made by
``model_weights``: cast, q/k/v and gate/up fused on one device, quantized) and written as a
converted checkpoint (``models/loading/orbax_checkpoint.py``: orbax, the model's other files,
the manifest). ``serve OUT``, ``LLM(OUT)`` and a weight update from OUT restore it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np

from jaxserve import __version__
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.kv_scales import load_kv_scales
from jaxserve.models.layers import Weights
from jaxserve.models.loading.load_progress import format_bytes, format_rate
from jaxserve.models.loading.orbax_checkpoint import (
    ConvertedCheckpointError,
    Manifest,
    is_converted_checkpoint,
    leaf_table,
    write_checkpoint,
)
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner.devices import resolve_dtype, resolve_quantization
from jaxserve.runner.model_weights import model_weights
from jaxserve.runner.parallel.sharding import prepare_tp

_LOG = logging.getLogger(__name__)


def convert(config: EngineConfig, out: str | Path, show_progress: bool = True) -> Manifest:
    """Load ``config.model`` as it is served and write it to ``out`` (a new or empty directory)
    as a converted checkpoint; its manifest."""
    out = Path(out)
    model_dir = config.model_dir
    if is_converted_checkpoint(model_dir):
        raise ConvertedCheckpointError(f"{model_dir} is converted already: serve it as it is")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: convert into a new directory")
    model_config = load_model_config(model_dir)
    dtype = resolve_dtype(config)
    quant = resolve_quantization(config)
    if quant is not None and quant.from_checkpoint:
        raise ConvertedCheckpointError(
            f"{model_dir} is a {quant.method} checkpoint (quantization_config in config.json); "
            "only unquantized checkpoints convert (with --quantization fp8 or int8 to quantize)"
        )
    placement = None
    if config.tensor_parallel_size > 1:
        tp = prepare_tp(model_config, config.tensor_parallel_size, quant=quant)
        placement = tp.placement
    weights, load_seconds = model_weights(model_config, config, dtype, placement, quant)
    manifest = manifest_for(weights, model_config.model_type, model_dir, dtype, quant)
    _LOG.info(
        "Converting %s (%s) to %s: %s",
        model_dir,
        manifest.describe(),
        out,
        format_bytes(manifest.num_bytes),
    )
    seconds = write_checkpoint(weights, model_dir, out, manifest, show_progress)
    _LOG.info(
        "Wrote %s to %s with orbax in %.1f s (%s; loading took %.1f s)",
        format_bytes(manifest.num_bytes),
        out,
        seconds,
        format_rate(manifest.num_bytes / max(seconds, 1e-9)),
        load_seconds,
    )
    return manifest


def manifest_for(
    weights: Weights,
    model_type: str,
    model_dir: Path,
    dtype: np.dtype,
    quant: QuantScheme | None,
) -> Manifest:
    """What the converted checkpoint of ``weights`` holds."""
    leaves = jax.tree.leaves(weights)
    num_layers = len(weights.layers)
    kv_scales = None
    scales = load_kv_scales(model_dir, num_layers)  # the fp8 KV cache's, where the model has them
    if scales.num_from_checkpoint:
        kv_scales = [list(pair) for pair in scales.scales]
    return Manifest(
        jaxserve_version=__version__,
        dtype=np.dtype(dtype).name,
        quantization=quant.method if quant is not None else None,
        fused=any(layer.fused is not None for layer in weights.layers),
        model_type=model_type,
        num_layers=num_layers,
        num_bytes=sum(leaf.nbytes for leaf in leaves),
        leaves=leaf_table(weights),
        kv_scales=kv_scales,
        num_kv_scales_from_checkpoint=scales.num_from_checkpoint,
    )
