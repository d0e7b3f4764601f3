"""``jaxserve serve`` (alias ``launch``): parsed flags (``flags.py``) -> EngineConfig +
ServerSettings -> an engine -> uvicorn. The one server module that builds the engine, and so
the one that loads JAX (inside ``run_launch``, once the pre-flight checks have passed).

Start-up: check that the port can be bound and that the device has the memory
``--gpu-memory-utilization`` asks for (``preflight.py``: a start that cannot succeed ends in
seconds), build the engine (load weights, compile every shape bucket), log the KV capacity
lines, start the engine loop, then bind the port, so nothing is accepted before it can be
served. A failed start logs one line and exits 1 (a Ctrl-C during it: 130, ``cli.main``).

While serving, SIGTERM or SIGINT (Ctrl-C): stop admitting (503 with Retry-After, ``/health``
503), let in-flight requests finish for ``--shutdown-timeout`` seconds, abort the rest, exit 0.
A second signal aborts the requests in flight at once (each ends with ``"abort"``, no 500) and
exits 128 + the signal's number (130 for Ctrl-C); a third exits without waiting for anything.
If the engine loop dies, the watchdog stops the server and the exit code is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from jaxserve.engine_config import EngineConfig
from jaxserve.hf_cache import ModelNotFoundError
from jaxserve.runner.device_memory import (
    MemoryQuery,
    is_out_of_memory,
    nvml_device_memory,
    out_of_memory_message,
)
from jaxserve.server.launch.flags import engine_config_from_args, flag_terms, settings_from_args
from jaxserve.server.launch.preflight import PreflightError, preflight, warn_if_open
from jaxserve.server.launch.vllm_flags import inapplicable_flag_warnings
from jaxserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.data_parallel import DataParallelEngine

_LOG = logging.getLogger("jaxserve.launch")


class StartFailed(Exception):
    """A start that cannot go on, already logged where it was found; ``status`` is the exit
    code (2: the flags, 1: the model, the address or the device)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def run_launch(args: argparse.Namespace, memory_query: MemoryQuery = nvml_device_memory) -> int:
    """Serve until SIGTERM (exit 0) or until the engine loop dies (exit 1); exit 1 at once
    when the port or the device cannot serve. ``memory_query`` reads the devices' free
    memory (tests pass a fake device)."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
    )
    from jaxserve.runner.devices import quiet_backend_probe

    quiet_backend_probe()  # before JAX's backend starts

    for line in inapplicable_flag_warnings(args):
        _LOG.warning("%s", line)
    try:
        config, settings, model_dir = _check_before_loading(args, memory_query)
        if not _join_replica(args, config):
            return 0  # a follower, done when process 0 shuts down
        engine = build_engine(args, config, model_dir)
        _load_lora_modules(engine, settings)
    except StartFailed as exc:
        return exc.status
    return _serve(args, engine, settings)


def _check_before_loading(
    args: argparse.Namespace, memory_query: MemoryQuery
) -> tuple[EngineConfig, ServerSettings, Path]:
    """The flags, the model's directory, the address and the device's free memory, checked
    before anything loads; then the device memory the engine may take is reserved."""
    from jaxserve.runner.capacity import reserve_device_memory
    from jaxserve.runner.parallel.distributed import DistributedConfig

    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        _LOG.error("--ssl-keyfile and --ssl-certfile must be given together")
        raise StartFailed(2)
    try:
        config = engine_config_from_args(args)
        settings = settings_from_args(args, config.model_name)
        if args.max_queued_requests is not None and args.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests={args.max_queued_requests} must be >= 1")
        distributed = DistributedConfig.resolve(
            args.coordinator_address, args.num_processes, args.process_id
        )
        model_dir, _ = config.model_dir, config.tokenizer_dir  # both there, before any loading
    except ModelNotFoundError as exc:
        _LOG.error("%s", exc)
        raise StartFailed(1) from exc
    except ValueError as exc:
        _LOG.error("%s", flag_terms(exc))
        raise StartFailed(2) from exc
    try:  # before anything loads, and before JAX's backend starts and takes its memory
        preflight(
            args.host,
            args.port,
            config,
            memory_query,
            serves_http=not distributed.is_multi_process or distributed.process_id == 0,
        )
    except PreflightError as exc:
        _LOG.error("%s", exc)
        raise StartFailed(1) from exc
    reserve_device_memory(config.gpu_memory_utilization)
    return config, settings, model_dir


def _join_replica(args: argparse.Namespace, config: EngineConfig) -> bool:
    """Join the multi-host replica (if any) before anything touches a device; a process other
    than 0 follows process 0's steps until it shuts down. True: this process serves HTTP."""
    from jaxserve.runner.parallel.distributed import initialize_distributed, is_coordinator

    try:
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as exc:
        _LOG.error("%s", flag_terms(exc))
        raise StartFailed(2) from exc
    if is_coordinator():
        return True
    from jaxserve.engine.follower import run_follower

    run_follower(config)  # returns when process 0 shuts down
    return False


def build_engine(
    args: argparse.Namespace, config: EngineConfig, model_dir: Path
) -> AsyncEngine | DataParallelEngine:
    """Load the weights and compile (the engine core logs the capacity lines and the compiled
    shapes); a failure is one line naming the model, the device or the flag. With
    ``--data-parallel-size N`` above 1, N engines, each on its own devices, behind one client."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.data_parallel import DataParallelEngine
    from jaxserve.runner.capacity import CapacityError
    from jaxserve.runner.devices import DeviceSupportError, start_backend

    if str(model_dir) == config.model:
        _LOG.info("Loading %s", model_dir)
    else:
        _LOG.info("Loading %s from %s", config.model or "the demo model", model_dir)
    try:
        start_backend()  # logged on its own: on a GPU it takes seconds of the start
        _check_replicas_fit(config)
        if config.data_parallel_size > 1:
            return DataParallelEngine.from_config(config, args.max_queued_requests)
        return AsyncEngine.from_config(config, max_queued_requests=args.max_queued_requests)
    except DeviceSupportError as exc:  # fp8 on a GPU without it: the device and the dtype
        _LOG.error("%s", flag_terms(exc))
        raise StartFailed(1) from exc
    except CapacityError as exc:  # before a weight is made
        _LOG.error("Cannot serve %s: %s", config.model_dir, exc)
        raise StartFailed(1) from exc
    except (OSError, ValueError) as exc:  # a missing or unusable model directory
        _LOG.error("Could not load %s: %s", model_dir, flag_terms(exc))
        raise StartFailed(1) from exc
    except RuntimeError as exc:  # one message, not XLA's traceback
        if not is_out_of_memory(exc):
            raise
        _LOG.error("%s", out_of_memory_message(exc, config.gpu_memory_utilization))
        raise StartFailed(1) from exc


def _check_replicas_fit(config: EngineConfig) -> None:
    """Every data-parallel replica's devices are visible, before any weight loads (exit 2,
    naming both flags, otherwise)."""
    from jaxserve.runner.parallel.mesh import replica_devices

    try:
        replica_devices(config.tensor_parallel_size, config.data_parallel_size)
    except ValueError as exc:
        _LOG.error("%s", flag_terms(exc))
        raise StartFailed(2) from exc


def _load_lora_modules(engine: AsyncEngine | DataParallelEngine, settings: ServerSettings) -> None:
    """Read and check each ``--lora-modules`` adapter on every replica; one that does not fit
    ends the start."""
    replicas = getattr(engine, "replicas", [engine])  # data parallel: each replica's engine
    for lora in settings.lora_modules:
        try:
            for replica in replicas:
                replica.core.add_lora(lora)
        except (OSError, ValueError) as exc:
            _LOG.error("--lora-modules %s=%s: %s", lora.lora_name, lora.lora_path, exc)
            for replica in replicas:
                replica.core.shutdown()
            raise StartFailed(1) from exc
        _LOG.info("Serving LoRA adapter %s from %s", lora.lora_name, lora.lora_path)


def _serve(
    args: argparse.Namespace, engine: AsyncEngine | DataParallelEngine, settings: ServerSettings
) -> int:
    """Bind the port and serve until a signal or the engine's death; the exit code."""
    from jaxserve.server.app import build_app

    holder: dict[str, DrainingServer] = {}
    app = build_app(
        engine, settings, on_engine_dead=lambda: holder["server"].stop_on_engine_death()
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http="h11",
        h11_max_incomplete_event_size=settings.max_header_bytes,
        lifespan="on",
        log_config=None,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=settings.enable_log_requests and not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(uvicorn_config, app.state.ctx.state, settings.shutdown_timeout_s)
    holder["server"] = server
    warn_if_open(args.host, args.port, settings)  # now that it will serve
    try:
        engine.start()
        server.run()
    finally:
        engine.shutdown()
    if server.engine_died or engine.dead_error is not None:
        _LOG.error("Exiting with status 1: the engine loop died")
        return 1
    if server.forced_by is not None:
        status = 128 + server.forced_by
        _LOG.warning("Exiting with status %d: stopped before the requests finished", status)
        return status
    _LOG.info("Shut down cleanly")
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with SIGTERM/SIGINT draining instead of closing the port at once."""

    def __init__(self, config: Any, state: Any, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self.engine_died = False
        self.is_draining = False
        self.forced_by: int | None = None  # the signal that cut the drain short
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._abort_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: uvicorn's own handler closes the listening socket at once (new clients would get
        # "connection refused", not a 503) and re-raises the signal after shutdown (exit -15).
        # Its forced exit (a second Ctrl-C) still waits for open responses, up to
        # timeout_graceful_shutdown, then cancels their tasks: a traceback each and a 500 for
        # a client waiting for a whole completion. Here the second signal aborts them instead.
        name = signal.Signals(sig).name
        if self.forced_by is not None or self._loop is None:
            _LOG.warning("Received %s: exiting now", name)
            logging.shutdown()
            os._exit(128 + sig)
        if self.is_draining:
            _LOG.warning("Second %s: aborting %d requests in flight", name, len(self.state.active))
            self.forced_by = sig
            self._loop.call_soon_threadsafe(self._start_abort)
            return
        _LOG.info("Received %s: draining (again to abort the requests in flight)", name)
        self.is_draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        await self.state.drain(self.shutdown_timeout_s)
        self.should_exit = True

    def _start_abort(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._abort_task = asyncio.create_task(self._abort())

    async def _abort(self) -> None:
        await self.state.abort_all()
        self.should_exit = True

    def stop_on_engine_death(self) -> None:
        self.engine_died = True
        self.should_exit = True
