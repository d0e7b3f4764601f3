"""A Ray Serve application of jaxserve replicas: ``serve run jaxserve.integrations.ray:build_app
model=/models/m tensor_parallel_size=2``.

``build_app`` (Ray's args-builder convention: ``key=value`` pairs from ``serve run``, as
strings) makes one deployment, ``JaxserveReplica``. Each of its replicas is a Ray actor that
builds an engine from the same flags as ``jaxserve serve`` (every key that is not one of
``RAY_KEYS`` is a serve flag in snake case: ``max_model_len=8192`` is ``--max-model-len
8192``, ``enable_prefix_caching=false`` is ``--no-enable-prefix-caching``) and serves the
OpenAI routes of ``jaxserve.server.app`` as the deployment's ASGI ingress, so Ray's HTTP proxy
routes ``/v1/...`` to a replica. Ray Serve places, restarts and counts the replicas:

- **devices**: ``num_gpus`` = the tensor-parallel size on GPUs (``accelerator=gpu``, the
  default), ``resources={"TPU": ...}`` on a TPU host (``accelerator=tpu``), or CPUs only
  (``accelerator=cpu``, the tests);
- **multi-host tensor parallel** (``num_processes=N``): the replica reserves a placement group
  of N bundles, one per host (``placement_group_strategy``, ``STRICT_SPREAD`` by default); the
  replica actor is process 0 in the first bundle and starts processes 1..N-1 as Ray tasks in
  the others, joined through ``jax.distributed`` at its address (``docs/scaling.md``);
- **autoscaling** from the engine's queue: Ray's ``autoscaling_config`` with
  ``target_ongoing_requests`` (the requests a replica holds: running plus waiting in its
  engine); each replica also reports ``num_requests_waiting`` and ``num_requests_running``
  through ``record_autoscaling_stats`` for a custom policy;
- **routing**: Ray's power-of-two-choices router, or with ``request_router=prefix``
  ``PrefixRequestRouter`` (``ray_router.py``), which sends a prompt to the replica that took its
  prefix; it sees the prompt of ``generate`` calls through a handle (``PromptRequest``), not the
  body of HTTP requests through Ray's proxy;
- **health**: ``check_health`` fails once the engine loop has died, so Ray replaces the
  replica; an engine that is still loading is not yet a replica (its constructor runs the
  warm-up), so no request reaches it before it can serve.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import Application

from jaxserve.engine_config import EngineConfig
from jaxserve.integrations.ray_router import PromptRequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app as build_asgi_app
from jaxserve.server.settings import ServerSettings

_LOG = logging.getLogger(__name__)

# Keys of build_app's arguments that configure Ray rather than the engine, and their defaults.
RAY_KEYS: dict[str, str] = {
    "name": "jaxserve",  # the deployment's name
    "accelerator": "gpu",  # gpu | tpu | cpu: what each replica reserves
    "num_replicas": "1",  # a number, or "auto" (autoscaling between min and max)
    "min_replicas": "1",
    "max_replicas": "4",
    "target_ongoing_requests": "8",  # per replica, for autoscaling
    "max_ongoing_requests": "256",  # Ray's cap of requests in flight per replica
    "num_cpus": "1",  # CPUs each replica reserves
    "placement_group_strategy": "STRICT_SPREAD",  # multi-host replicas: one bundle per host
    "request_router": "power-of-two",  # power-of-two (Ray's default) | prefix
}
ACCELERATORS = ("gpu", "tpu", "cpu")
REQUEST_ROUTERS = ("power-of-two", "prefix")


def launch_argv(flags: dict[str, str]) -> list[str]:
    """``jaxserve serve`` argv of ``key=value`` arguments: ``max_model_len=1k`` ->
    ``--max-model-len 1k``; ``true`` / ``false`` turn a switch on or off (``--no-...``)."""
    argv: list[str] = ["serve"]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value.lower() in ("true", "false"):
            argv.append(flag if value.lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, value]
    return argv


def parse_launch(argv: list[str]) -> tuple[Any, EngineConfig, ServerSettings]:
    """The parsed flags, the engine's config and the server's settings, as ``jaxserve
    serve`` makes them (a ``SystemExit`` from argparse names an unknown key)."""
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import engine_config_from_args, settings_from_args

    args = build_parser(argv).parse_args(argv)
    config = engine_config_from_args(args)
    return args, config, settings_from_args(args, config.model_name)


def deployment_options(ray_args: dict[str, str], config: EngineConfig, hosts: int) -> dict:
    """The deployment's Ray options: devices per replica (a placement group of one bundle per
    host when ``hosts`` > 1), replicas or autoscaling, and the requests each replica takes."""
    accelerator = ray_args["accelerator"]
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} must be one of {', '.join(ACCELERATORS)}")
    if ray_args["request_router"] not in REQUEST_ROUTERS:
        raise ValueError(
            f"request_router={ray_args['request_router']!r} must be one of "
            + ", ".join(REQUEST_ROUTERS)
        )
    devices_per_host = config.tensor_parallel_size * config.data_parallel_size // hosts
    bundle: dict[str, float] = {"CPU": float(ray_args["num_cpus"])}
    if accelerator == "gpu":
        bundle["GPU"] = devices_per_host
    elif accelerator == "tpu":
        bundle["TPU"] = devices_per_host
    options: dict[str, Any] = {
        "name": ray_args["name"],
        "max_ongoing_requests": int(ray_args["max_ongoing_requests"]),
        "health_check_period_s": 5,
        # NOTE: a replica's constructor loads the weights and compiles: minutes on a GPU.
        "graceful_shutdown_timeout_s": 30,
    }
    if ray_args["request_router"] == "prefix":
        options["request_router_config"] = {
            "request_router_class": "jaxserve.integrations.ray_router.PrefixRequestRouter",
            "request_router_kwargs": {"block_size": config.block_size},
        }
    if hosts > 1:
        options["placement_group_bundles"] = [bundle] * hosts
        options["placement_group_strategy"] = ray_args["placement_group_strategy"]
    else:
        options["ray_actor_options"] = {
            "num_cpus": bundle["CPU"],
            "num_gpus": bundle.get("GPU", 0),
            **({"resources": {"TPU": bundle["TPU"]}} if "TPU" in bundle else {}),
        }
    if ray_args["num_replicas"] == "auto":
        options["autoscaling_config"] = {
            "min_replicas": int(ray_args["min_replicas"]),
            "max_replicas": int(ray_args["max_replicas"]),
            "target_ongoing_requests": float(ray_args["target_ongoing_requests"]),
            # NOTE: a new replica takes minutes (weights, compile): scale down slowly.
            "downscale_delay_s": 600,
            "upscale_delay_s": 30,
        }
    else:
        options["num_replicas"] = int(ray_args["num_replicas"])
    return options


@serve.deployment
@serve.ingress()
class JaxserveReplica:
    """One engine (a replica) and the OpenAI routes in front of it, inside a Ray actor."""

    def __init__(self, argv: list[str], hosts: int = 1) -> None:
        args, config, self.settings = parse_launch(argv)
        if hosts > 1:
            _join_hosts(argv, hosts)
        from jaxserve.engine.async_engine import AsyncEngine
        from jaxserve.engine.data_parallel import DataParallelEngine

        queued = args.max_queued_requests
        self.engine: AsyncEngine | DataParallelEngine = (
            DataParallelEngine.from_config(config, queued)
            if config.data_parallel_size > 1
            else AsyncEngine.from_config(config, max_queued_requests=queued)
        )
        self.engine.start()

    def __serve_build_asgi_app__(self) -> Any:
        return build_asgi_app(self.engine, self.settings)

    async def generate(self, request: PromptRequest) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's new token ids (``handle.options(stream=True).generate``):
        each item holds ``token_ids``, ``num_cached_tokens`` (its prompt tokens found in the
        prefix cache) and ``replica`` (this replica's id)."""
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            ignore_eos=request.ignore_eos,
        )
        replica = serve.get_replica_context().replica_id.unique_id
        async for out in self.engine.generate(
            request.prompt_token_ids, params, uuid.uuid4().hex, cache_salt=request.cache_salt
        ):
            yield {
                "token_ids": [t for o in out.outputs for t in o.token_ids],
                "num_cached_tokens": out.num_cached_tokens,
                "replica": replica,
            }

    async def check_health(self) -> None:
        """Raise once the engine loop has died: Ray replaces the replica."""
        if not self.engine.is_alive:
            raise RuntimeError(f"engine loop is not running: {self.engine.dead_error!r}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's queue, for a custom autoscaling policy."""
        stats = self.engine.stats()
        return {
            "num_requests_waiting": float(stats.num_waiting),
            "num_requests_running": float(stats.num_running),
        }

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _join_hosts(argv: list[str], hosts: int) -> None:
    """Multi-host tensor parallel: start processes 1..hosts-1 in this replica's placement
    group (one bundle each), then join them as process 0 of ``jax.distributed``."""
    import socket

    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from jaxserve.runner.parallel.distributed import initialize_distributed

    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError("a multi-host replica needs its placement group (num_processes > 1)")
    with socket.socket() as probe:  # a free port on this host for the coordinator
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    coordinator = f"{ray.util.get_node_ip_address()}:{port}"
    bundle = group.bundle_specs[1]
    for process_id in range(1, hosts):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=process_id)
        ray.remote(_follow).options(
            scheduling_strategy=strategy,
            num_cpus=bundle.get("CPU", 1),
            num_gpus=bundle.get("GPU", 0),
            resources={"TPU": bundle["TPU"]} if "TPU" in bundle else {},
        ).remote(argv, coordinator, hosts, process_id)
    initialize_distributed(coordinator, hosts, 0)


def _follow(argv: list[str], coordinator: str, hosts: int, process_id: int) -> None:
    """Process ``process_id`` of a multi-host replica: join, then follow process 0's steps
    until it shuts down (``engine/follower.py``)."""
    from jaxserve.engine.follower import run_follower
    from jaxserve.runner.parallel.distributed import initialize_distributed

    _, config, _ = parse_launch(argv)
    initialize_distributed(coordinator, hosts, process_id)
    run_follower(config)


def build_app(args: dict[str, str]) -> Application:
    """The Ray Serve application of ``serve run jaxserve.integrations.ray:build_app k=v ...``
    (or ``serve.run(build_app({...}))``): ``RAY_KEYS`` configure the deployment, the other
    keys are ``jaxserve serve`` flags; ``num_processes=N`` spreads each replica over N hosts."""
    args = {key: str(value) for key, value in args.items()}
    ray_args = {key: args.pop(key, default) for key, default in RAY_KEYS.items()}
    hosts = int(args.get("num_processes", "1"))
    argv = launch_argv({k: v for k, v in args.items() if k != "num_processes"})
    _, config, _ = parse_launch(argv)  # the flags are checked here, before any replica starts
    options = deployment_options(ray_args, config, hosts)
    _LOG.info("Ray Serve deployment %s: %s", options["name"], options)
    deployment: Any = JaxserveReplica  # a serve.Deployment (the decorators' types say less)
    return deployment.options(**options).bind(argv, hosts)
