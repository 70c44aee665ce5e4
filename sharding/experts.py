"""Expert parallelism: each tensor device runs its shard of a MoE layer's experts.

Attention under tensor parallelism leaves every token on every tensor device, so
routing needs no exchange: each device runs `routed_experts` on the routes that reach
its ``E / tp`` experts (one grouped matmul per expert, nothing dropped) and one
all-reduce (`psum`) adds the shards' partial outputs. An all-to-all dispatch pays off
only when tokens are split across devices first (attention data parallelism), which
this engine does not do.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.models.layers.mlp import routed_experts

EXPERTS = P("tensor", None, None)  # [E, in, out] split by expert
SCALES = P("tensor", None)  # [E, out]: quantized experts' per-row scales


def expert_parallel_fn(mesh: Mesh):
    """An ``experts_fn`` for `SparseMoE` running each expert shard on its device."""

    def fn(x, weights, experts, w_gate, w_up, w_down, *, act, scales=None, biases=None, glu=None):
        def local(x, weights, experts, w_gate, w_up, w_down, scales, biases):
            first = jax.lax.axis_index("tensor") * w_gate.shape[0]
            out = routed_experts(
                x, weights, experts, w_gate, w_up, w_down, act=act, first_expert=first,
                scales=scales, biases=biases, glu=glu,
            )  # fmt: skip
            return jax.lax.psum(out, "tensor")

        scale_specs = None if scales is None else (SCALES,) * 3
        bias_specs = None if biases is None else (SCALES,) * 3  # [E, out] by expert too
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), EXPERTS, EXPERTS, EXPERTS, scale_specs, bias_specs),
            out_specs=P(),
            check_vma=False,
        )(x, weights, experts, w_gate, w_up, w_down, scales, biases)

    return fn
