"""A mixture of experts' experts over the device mesh: ``moe.run_experts`` under ``shard_map``.

``sharding.prepare_tp`` builds one for a model with experts and hands it to the model step as
``experts_fn``; the weights' own specs (experts split on M, or on E under expert parallelism)
are in ``sharding.py``, and the ones below must match them.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.models import moe
from jaxserve.models.quant import QArray


def _specs_for(w: moe.Experts, spec: P, scale_spec: P) -> P | QArray:
    """The in_spec of stacked experts: ``spec``, or for quantized ones a ``QArray`` of specs
    (values as ``spec``, scales [E, out] as ``scale_spec``)."""
    if not isinstance(w, QArray):
        return spec
    specs: dict[str, Any] = {"q": spec, "scale": scale_spec}  # specs in the arrays' places
    return QArray(**specs, in_shape=w.in_shape, out_shape=w.out_shape)


def _expert_specs(axis: str, expert_parallel: bool) -> tuple[P, P, P, P, P]:
    """(w_gate and w_up [E, H, M], w_down [E, M, H], the biases [E, M], and the scales [E, out]
    of quantized experts: gate/up's [E, M], down's [E, H]): on E, or on M (down's H whole)."""
    if expert_parallel:
        gate_up, bias = P(axis, None, None), P(axis, None)
        return gate_up, gate_up, bias, bias, bias
    return P(None, None, axis), P(None, axis, None), P(None, axis), P(None, axis), P(None, None)


def sharded_experts(mesh: Mesh, axis: str, expert_parallel: bool) -> moe.ExpertsFn:
    """``moe.run_experts`` over the mesh: tokens and routing replicated, experts split.

    Tensor parallel: each device runs every row through its slice of M of each expert and the
    partial outputs are summed (one all-reduce). Expert parallel: rows go to the device of
    their expert and back by all-to-all (``moe.run_experts_all_to_all``).
    """
    gate_up, down, bias, gate_up_scale, down_scale = _expert_specs(axis, expert_parallel)

    def experts(
        x: jax.Array,  # [T, H]
        expert_ids: jax.Array,  # i32[T, k]
        expert_weights: jax.Array,  # f32[T, k]
        w_gate: moe.Experts,  # [E, H, M]
        w_up: moe.Experts,  # [E, H, M]
        w_down: moe.Experts,  # [E, M, H]
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

        def local(*args: Any) -> jax.Array:
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
            in_specs=(
                P(),
                P(),
                P(),
                _specs_for(w_gate, gate_up, gate_up_scale),
                _specs_for(w_up, gate_up, gate_up_scale),
                _specs_for(w_down, down, down_scale),
            )
            + (bias,) * len(biases),
            out_specs=P(),
            check_vma=False,
        )(x, expert_ids, expert_weights, w_gate, w_up, w_down, *biases)

    return experts
