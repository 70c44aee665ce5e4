"""Logical axis rules: how parameter axes named by the layers map onto mesh axes.

Layers name their axes (``vocab``, ``embed``, ``q_heads``, ``kv_heads``, ``mlp``,
``expert``, ``norm``, ``head_dim``); these rules place them on the mesh axes ``data``,
``pipeline``, ``tensor`` and ``expert``. The model code never sees the mesh.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

# Megatron-style tensor parallelism: heads and MLP columns split over `tensor`
# (column-parallel q/k/v/gate/up, row-parallel o/down), vocabulary split for the
# embedding and the LM head, experts over `expert`; norms replicated.
TENSOR_PARALLEL_RULES: tuple[tuple[str, Any], ...] = (
    ("vocab", "tensor"),
    ("embed", None),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("norm", None),
    ("head_dim", None),
)


def mesh_specs(logical: Any, rules=TENSOR_PARALLEL_RULES) -> Any:
    """Maps a tree of logical PartitionSpecs to mesh-axis PartitionSpecs."""
    return jax.tree_util.tree_map(
        lambda spec: nn.logical_to_mesh_axes(spec, rules),
        logical,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
