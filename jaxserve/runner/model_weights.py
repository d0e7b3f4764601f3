"""The model's weights on the device(s), as the engine configuration asks: random (``dummy``),
read from the safetensors checkpoint or restored from a converted (orbax) one, quantized or
not, placed for tensor parallelism (on one device, unquantized, with the projections that
share an input fused); and the per-layer scales of an fp8 KV cache."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.models.kv_scales import kv_scales_for
from jaxserve.models.layers import Weights, fuse_projections
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.models.loading.field_conversion import Placement
from jaxserve.models.loading.load_progress import format_bytes, format_rate
from jaxserve.models.loading.orbax_checkpoint import (
    check_served_as,
    is_converted_checkpoint,
    read_manifest,
    restore_weights,
)
from jaxserve.models.quant_scheme import QuantScheme
from jaxserve.runner.parallel.sharding import TensorParallel

_LOG = logging.getLogger(__name__)


def model_weights(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: jnp.dtype,
    placement: Placement | None,
    quant: QuantScheme | None,
    stop: threading.Event | None = None,
) -> tuple[Weights, float]:
    """(the weights, seconds it took to make or load them and place them); once ``stop`` is
    set, ``LoadCancelled`` at the next tensor."""
    start = time.perf_counter()
    if config.load_format == "dummy":
        weights = dummy_weights(
            model_config, dtype, seed=config.seed, placement=placement, scheme=quant, stop=stop
        )
    elif is_converted_checkpoint(config.model_dir):
        weights = restored_weights(model_config, config.model_dir, dtype, placement, quant)
    else:  # q/k/v and gate/up written into their joined arrays as they load
        weights = load_weights(
            config.model_dir,
            model_config,
            dtype,
            placement=placement,
            scheme=quant,
            fuse=placement is None,
            stop=stop,
        )
    weights = as_served(weights, placement is None)
    jax.block_until_ready(weights)
    seconds = time.perf_counter() - start
    if config.load_format == "dummy":
        _LOG.info("Made random weights in %.1f s", seconds)
    return weights, seconds


def restored_weights(
    model_config: ModelConfig,
    model_dir: Path,
    dtype: jnp.dtype,
    placement: Placement | None,
    quant: QuantScheme | None,
) -> Weights:
    """The weights of a checkpoint ``jaxserve convert`` wrote, checked against what is served
    (dtype, quantization, layout, every leaf) before a byte is read, each leaf restored
    straight into its sharding: with a placement, each device reads its shards; on one device,
    into the default device, committed as the runner serves weights
    (``weight_update.committed``): orbax overlaps each array's transfer with the next one's
    read, where a restore into host memory, then put on the device, copied twice in turn (the
    Llama-3-8B shape: 4.55 s on an H100 against safetensors' 1.13 s; both ways are timed by
    ``benchmarks/checkpoint_load.py``)."""
    start = time.perf_counter()
    manifest = read_manifest(model_dir)
    method = quant.method if quant is not None else None
    check_served_as(manifest, model_dir, dtype, method, None if placement is None else False)
    target = _abstract_in_layout(model_config, dtype, quant, manifest.fused, placement)
    weights = jax.block_until_ready(restore_weights(model_dir, target))
    seconds = time.perf_counter() - start
    _LOG.info(
        "Restored weights from the orbax checkpoint %s (%s): %s in %.1f s (%s)",
        model_dir,
        manifest.describe(),
        format_bytes(manifest.num_bytes),
        seconds,
        format_rate(manifest.num_bytes / max(seconds, 1e-9)),
    )
    return weights


def _abstract_in_layout(
    model_config: ModelConfig,
    dtype: jnp.dtype,
    quant: QuantScheme | None,
    fused: bool,
    placement: Placement | None,
) -> Weights:
    """The shapes and dtypes of the weights, fused or not, each with the sharding
    ``placement`` gives its path (the default device without one)."""

    def make() -> Weights:
        weights = dummy_weights(model_config, dtype, scheme=quant)
        return fuse_projections(weights) if fused else weights

    shapes = jax.eval_shape(make)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # the default one

    def with_sharding(path: tuple[Any, ...], shape: jax.ShapeDtypeStruct) -> Any:
        names = tuple(getattr(key, "name", getattr(key, "idx", None)) for key in path)
        sharding = one_device if placement is None else placement(names, shape.shape)
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(with_sharding, shapes)


def as_served(weights: Weights, one_device: bool) -> Weights:
    """``weights`` (as the tables lay them out) as the runner serves them: on one device, the
    projections that share an input joined where they can be (plain arrays and per-channel
    8-bit QArrays, ``layers.fuse_layer``); else as they are."""
    return fuse_projections(weights) if one_device else weights


def start_loading(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: jnp.dtype,
    quant: QuantScheme | None,
    tp: TensorParallel | None,
    stop: threading.Event,
) -> WeightsLoading:
    """The weights as the engine configuration asks, loading on a thread of their own when
    warm-up can compile against their shapes meanwhile, else here; once ``stop`` is set, the
    load raises ``LoadCancelled`` at its next tensor."""
    shardings = tp.weight_shardings if tp is not None else None
    shapes = None
    if config.warmup:
        shapes = abstract_model_weights(model_config, dtype, quant, shardings)
    placement = tp.placement if tp is not None else None
    load = functools.partial(model_weights, model_config, config, dtype, placement, quant)
    return WeightsLoading(load, shapes, stop)


def abstract_model_weights(
    model_config: ModelConfig,
    dtype: jnp.dtype,
    quant: QuantScheme | None,
    shardings: Weights | None = None,
) -> Weights | None:
    """The shapes and dtypes ``model_weights`` will make (with ``shardings``, the tensor-parallel
    placement), found without touching a device: enough to compile the programs against while
    the weights load. None for a pre-quantized checkpoint, whose packed layout only its files
    tell."""
    if quant is not None and quant.from_checkpoint:
        return None

    def make() -> Weights:
        weights = dummy_weights(model_config, dtype, scheme=quant)
        return as_served(weights, shardings is None)

    shapes = jax.eval_shape(make)
    if shardings is None:
        return shapes
    return jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
        shapes,
        shardings,
    )


class WeightsLoading:
    """Weights loading on a thread of their own, so that warm-up compiles against their
    ``shapes`` meanwhile; ``shapes`` None: ``load`` runs here, before anything compiles.

    NOTE: a start-up that fails or is interrupted while they load must ``cancel`` them: the
    interpreter's exit waits for the thread, and made on, the weights of a model that never
    serves held the process (and gigabytes more of memory each second) for minutes."""

    def __init__(
        self,
        load: Callable[[threading.Event], tuple[Weights, float]],
        shapes: Weights | None,
        stop: threading.Event,
    ) -> None:
        self.shapes = shapes
        self._stop = stop
        self._pool = None
        self._future: concurrent.futures.Future[tuple[Weights, float]] | None = None
        self._done: tuple[Weights | None, float] = (None, 0.0)
        if shapes is None:
            self._done = load(self._stop)
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._future = self._pool.submit(load, self._stop)

    def cancel(self) -> None:
        """Stop the load at its next tensor, and let go of what it made: the weights are not
        wanted (a start that failed, or a runner shut down, whose device memory a second
        engine in the process needs). Returns at once: the interpreter's exit waits for the
        tensor being made (a Ctrl-C meanwhile ends the process, ``cli.main``)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        # NOTE: a load that ended holds its weights here (a shut-down engine's 15 GiB of
        # weights stayed on the device, and the next engine in the process ran out of memory).
        self._future = None
        self._done = (None, self._done[1])

    def raise_if_failed(self) -> None:
        """The load's error as soon as it has one (a missing tensor ends the start before every
        program has compiled)."""
        future = self._future
        if self._pool is not None and future is not None and future.done() and future.exception():
            self.wait()

    def forget(self) -> None:
        """Drop every reference this holds to the weights made, once handed over (a sleeping
        model's memory is free only when nothing holds them); once is enough."""
        if self._pool is None and self._done[0] is None:
            return
        _, seconds = self.wait()
        self._done = (None, seconds)

    def wait(self) -> tuple[Weights, float]:
        """(the weights, seconds it took to make or load them)."""
        if self._pool is not None:
            assert self._future is not None
            try:
                self._done = interruptible_result(self._future)
            except BaseException:
                # NOTE: a Ctrl-C while waiting must stop the load before anything joins its
                # thread: joining a load that waits to be told to stop never returned (the
                # start hung after Ctrl-C whenever the compiles had ended first).
                self.cancel()
                raise
            self._pool.shutdown()
            self._pool, self._future = None, None  # the future held the weights too
        weights, seconds = self._done
        if weights is None:
            raise RuntimeError("the weights were let go (forget or cancel)")
        return weights, seconds


INTERRUPT_POLL_S = 0.2


def interruptible_result(future: concurrent.futures.Future) -> Any:
    """``future.result()``, reached by a Ctrl-C within ``INTERRUPT_POLL_S``.

    NOTE: the kernel may hand SIGINT to any thread of the process (XLA's, a compile's), and
    then nothing interrupts the main thread's wait: Python runs the handler only once that
    thread is back in the interpreter. A start waiting for weights that wait to be told to stop
    hung there for good; a wait that wakes every fraction of a second sees the Ctrl-C."""
    while not future.done():
        concurrent.futures.wait([future], timeout=INTERRUPT_POLL_S)
    return future.result()


def kv_cache_scales(model_config: ModelConfig, config: EngineConfig, kv_dtype: jnp.dtype) -> Any:
    """An fp8 cache's (k_scale, v_scale) per layer (the checkpoint's, else 1.0), else None."""
    return kv_scales_for(
        config.model_dir, model_config.num_layers, kv_dtype, config.load_format != "dummy"
    )
