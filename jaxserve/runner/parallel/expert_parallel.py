"""A mixture of experts' experts over the device mesh: ``moe.run_experts`` under ``shard_map``.

``sharding.prepare_tp`` builds one for a model with experts and hands it to the model step as
``experts_fn``; the weights' own specs (experts split on M, or on E under expert parallelism)
are in ``sharding.py``, and the ones below must match them.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.models import moe


def sharded_experts(mesh: Mesh, axis: str, expert_parallel: bool) -> moe.ExpertsFn:
    """``moe.run_experts`` over the mesh: tokens and routing replicated, experts split.

    Tensor parallel: each device runs every row through its slice of M of each expert and the
    partial outputs are summed (one all-reduce). Expert parallel: rows go to the device of
    their expert and back by all-to-all (``moe.run_experts_all_to_all``).
    """
    if expert_parallel:
        gate_up, down, bias = P(axis, None, None), P(axis, None, None), P(axis, None)
    else:
        gate_up, down, bias = P(None, None, axis), P(None, axis, None), P(None, axis)

    def experts(
        x: jax.Array,  # [T, H]
        expert_ids: jax.Array,  # i32[T, k]
        expert_weights: jax.Array,  # f32[T, k]
        w_gate: jax.Array,  # [E, H, M]
        w_up: jax.Array,  # [E, H, M]
        w_down: jax.Array,  # [E, M, H]
        *,
        act: moe.Activation,
        gate_bias: jax.Array | None = None,  # [E, M]  split as w_gate's E and M are
        up_bias: jax.Array | None = None,  # [E, M]
        glu: moe.Glu | None = None,
    ) -> jax.Array:  # [T, H]
        named = [
            (n, b) for n, b in (("gate_bias", gate_bias), ("up_bias", up_bias)) if b is not None
        ]
        names, biases = tuple(n for n, _ in named), tuple(b for _, b in named)

        def local(*args: jax.Array) -> jax.Array:
            arrays, local_biases = args[:6], args[6:]
            options = dict(zip(names, local_biases, strict=True))
            if expert_parallel:
                return moe.run_experts_all_to_all(
                    *arrays, act=act, axis_name=axis, glu=glu, **options
                )
            return jax.lax.psum(moe.run_experts(*arrays, act=act, glu=glu, **options), axis)

        # NOTE: check_vma=False: the output is the same on every device (an all-gather or an
        # all-reduce), which the specs state and the replication checker cannot see through
        # the all-to-all.
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), gate_up, gate_up, down) + (bias,) * len(biases),
            out_specs=P(),
            check_vma=False,
        )(x, expert_ids, expert_weights, w_gate, w_up, w_down, *biases)

    return experts
