"""Multi-host start-up: ``jax.distributed`` from arguments or ``JAXSERVE_*`` variables, and the
broadcast of each step's inputs from the process that runs the scheduler.

One model replica may span several hosts (a TPU pod slice, or GPU nodes joined by NCCL). Every
process runs the same jitted step over the global ``"tp"`` mesh, but only process 0 runs the
HTTP server, the scheduler and the KV block manager. Each step it broadcasts a small header
(``broadcast_ints``: the shape bucket and the sampler flags, or a stop code) and then the padded
step inputs (``broadcast_step_inputs``); the other processes build placeholders of the same
shapes from the header, receive process 0's values and join the step. Outputs are replicated,
so every process holds the sampled tokens; only process 0 acts on them.

Called once, before anything touches a device: ``jax.distributed.initialize`` must run before
the backend starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

_LOG = logging.getLogger(__name__)

ENV_COORDINATOR_ADDRESS = "JAXSERVE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXSERVE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSERVE_PROCESS_ID"
AUTO = "auto"  # let jax detect the cluster (Cloud TPU, Slurm, Open MPI)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = None  # "host:port" of process 0, "auto", or None (single)
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})"
            )
        address = self.coordinator_address
        if address is not None and address != AUTO:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"coordinator_address={address!r} must be 'host:port' (or {AUTO!r})"
                )
        if self.num_processes > 1 and address is None:
            raise ValueError(
                f"num_processes={self.num_processes} needs a coordinator_address "
                f"(or ${ENV_COORDINATOR_ADDRESS})"
            )

    @property
    def is_multi_process(self) -> bool:
        return self.coordinator_address is not None

    @classmethod
    def resolve(
        cls,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DistributedConfig:
        """Arguments first, then ``JAXSERVE_*`` variables; nothing set means one process."""
        env = os.environ if env is None else env
        address = coordinator_address or env.get(ENV_COORDINATOR_ADDRESS) or None
        if address == AUTO:
            return cls(coordinator_address=AUTO)
        return cls(
            coordinator_address=address,
            num_processes=_int_setting(num_processes, env, ENV_NUM_PROCESSES, 1),
            process_id=_int_setting(process_id, env, ENV_PROCESS_ID, 0),
        )


def _int_setting(value: int | None, env: Mapping[str, str], name: str, default: int) -> int:
    if value is not None:
        return value
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} must be an integer") from None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> DistributedConfig:
    """Join the process group described by the arguments or ``JAXSERVE_*``; a no-op for one
    process.

    ``coordinator_address="auto"`` leaves every argument to jax's cluster detection (Cloud TPU
    pod slices, Slurm, Open MPI).
    """
    config = DistributedConfig.resolve(coordinator_address, num_processes, process_id, env)
    if not config.is_multi_process:
        return config
    if config.coordinator_address == AUTO:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
    _LOG.info(
        "Process %d of %d joined (coordinator %s): %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        config.coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
    )
    return config


def is_coordinator() -> bool:
    """Whether this process runs the server and the scheduler (process 0)."""
    return jax.process_index() == 0


def broadcast_ints(values: Sequence[int] | None, size: int) -> tuple[int, ...]:
    """Process 0's ``size`` ints (a step header) on every process; others may pass None."""
    header = np.zeros(size, np.int64)  # i64[size]
    if is_coordinator():
        if values is None or len(values) != size:
            raise ValueError(f"process 0 must send {size} ints, got {values!r}")
        header[:] = values
    out = multihost_utils.broadcast_one_to_all(header, is_source=is_coordinator())
    return tuple(int(v) for v in out)


def broadcast_step_inputs[T](tree: T) -> T:
    """Process 0's values of ``tree`` (numpy leaves) on every process.

    Every process passes a tree of the same structure, shapes and dtypes (the others pass
    placeholders built from the header); the result holds process 0's host arrays. With one
    process the tree comes back unchanged.
    """
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    host: list[np.ndarray] = [np.asarray(leaf) for leaf in leaves]
    # The broadcast is a psum: send bools as uint8 and restore every dtype after.
    sent: list[Any] = [x.astype(np.uint8) if x.dtype == np.bool_ else x for x in host]
    out = multihost_utils.broadcast_one_to_all(sent, is_source=is_coordinator())
    return jax.tree.unflatten(
        treedef, [np.asarray(y).astype(x.dtype) for x, y in zip(host, out, strict=True)]
    )
