"""The device mesh of tensor parallelism: one axis ``"tp"``, its KV view ``(kv, kv_replica)``,
and the check that a model's shapes split over it (``sharding.py`` lays the model out on it)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxserve.config import ModelConfig

TP_AXIS = "tp"
KV_AXIS = "kv"  # KV-head groups, on the KV view of the mesh
KV_REPLICA_AXIS = "kv_replica"  # copies of one KV head group, on the KV view


def validate_tensor_parallel_size(
    config: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False
) -> None:
    """Raise ValueError (naming the values) for a degree the model's shapes cannot split into."""
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size={n!r} must be a positive integer")
    if config.moe is not None:  # whole experts (expert parallel) or slices of each; shared
        spec = config.moe
        split = {"num_experts": spec.num_experts} if expert_parallel else {}
        split |= {"moe_intermediate_size": spec.intermediate_size} if not expert_parallel else {}
        split |= {"shared_expert_intermediate_size": spec.shared_intermediate_size}
        for name, size in split.items():
            if size % n:
                hint = "" if expert_parallel else " (or pass --enable-expert-parallel)"
                raise ValueError(f"tensor_parallel_size={n} must divide {name}={size}{hint}")
    if config.num_q_heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_q_heads={config.num_q_heads} "
            "(each device computes whole query heads)"
        )
    k = config.num_kv_heads
    if n <= k and k % n:
        raise ValueError(f"tensor_parallel_size={n} must divide num_kv_heads={k}")
    if n > k and n % k:
        raise ValueError(
            f"tensor_parallel_size={n} exceeds num_kv_heads={k} and must then be a multiple "
            f"of it (each KV head is replicated on tensor_parallel_size / num_kv_heads devices)"
        )
    if config.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide intermediate_size={config.intermediate_size}"
        )


def replica_devices(
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
    data_parallel_rank: int = 0,
    devices: Sequence[jax.Device] | None = None,
) -> list[jax.Device]:
    """The devices of data-parallel replica ``data_parallel_rank``: the
    ``tensor_parallel_size`` devices after the ranks before it. A ``ValueError`` names both
    sizes when the replicas together need more devices than are visible."""
    devices = list(jax.devices() if devices is None else devices)
    needed = data_parallel_size * tensor_parallel_size
    if needed > len(devices):
        platform = devices[0].platform if devices else "none"
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
            f"{tensor_parallel_size} needs {needed} devices; {len(devices)} {platform} "
            "devices are visible"
        )
    start = data_parallel_rank * tensor_parallel_size
    return devices[start : start + tensor_parallel_size]


def replica_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The ``"tp"`` mesh of one data-parallel replica over its devices, in the given order
    (``replica_devices``: a slice of the host's devices, which jax's topology-aware
    ``make_mesh`` would not take)."""
    return Mesh(np.asarray(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))


def make_mesh(
    tensor_parallel_size: int,
    config: ModelConfig | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A one-axis ``"tp"`` mesh over the first ``tensor_parallel_size`` devices.

    ``devices`` defaults to ``jax.devices()`` (every process's devices under multi-host).
    With a ``config`` the degree is also checked against the model's head counts.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size={n!r} must be a positive integer")
    if n > len(devices):
        platform = devices[0].platform if devices else "none"
        raise ValueError(
            f"tensor_parallel_size={n} exceeds the {len(devices)} available {platform} devices"
        )
    if config is not None:
        validate_tensor_parallel_size(config, n)
    if n == len(devices):
        # All devices: jax orders them along the interconnect (rings on a TPU slice).
        return jax.make_mesh((n,), (TP_AXIS,), (AxisType.Auto,), devices=devices)
    # NOTE: a subset keeps the given order; jax's topology-aware ordering wants a whole slice.
    return Mesh(np.asarray(devices[:n]), (TP_AXIS,), axis_types=(AxisType.Auto,))


def kv_mesh(mesh: Mesh, num_kv_heads: int) -> Mesh:
    """The KV view of ``mesh``: the same devices in the same order, shaped (kv, kv_replica)."""
    n = mesh.devices.size
    groups = min(n, num_kv_heads)
    return Mesh(
        mesh.devices.reshape(groups, n // groups),
        (KV_AXIS, KV_REPLICA_AXIS),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )
