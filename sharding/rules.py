"""Logical axis rules: how parameter axes named by the layers map onto mesh axes.

Layers name their axes (``vocab``, ``embed``, ``q_heads``, ``kv_heads``, ``mlp``,
``expert``, ``norm``, ``head_dim``); these rules place them on the mesh axes ``data``,
``pipeline`` and ``tensor``. The model code never sees the mesh.

A mesh axis is used at most once per array: the first logical axis (left to right)
that maps to it takes it, later ones stay replicated. That is how the expert weights
(``[expert, embed, mlp]`` gate and up, ``[expert, mlp, embed]`` down: `layers.mlp`) are
split by expert under expert parallelism and by their ``mlp`` axis under tensor
parallelism, from one table each.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

Rules = tuple[tuple[str, Any], ...]

# Megatron-style tensor parallelism: heads and MLP columns split over `tensor`
# (column-parallel q/k/v/gate/up, row-parallel o/down), vocabulary split for the
# embedding and the LM head; experts keep their MLP columns split; norms replicated.
TENSOR_PARALLEL_RULES: Rules = (
    ("vocab", "tensor"),
    ("embed", None),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", None),
    ("norm", None),
    ("head_dim", None),
    ("lora", None),  # adapter slots
    ("lora_rank", None),  # A's slot columns of a column-parallel projection
)


def make_rules(
    *,
    expert_parallel: bool = False,
    replicate_kv_heads: bool = False,
    fully_sharded_loras: bool = False,
) -> Rules:
    """The rules for one engine: experts over `tensor` with expert parallelism, KV
    projections replicated when there are fewer KV heads than tensor devices, and
    LoRA A's slot columns over `tensor` with ``--fully-sharded-loras``."""
    table = dict(TENSOR_PARALLEL_RULES)
    if fully_sharded_loras:
        table["lora_rank"] = "tensor"
    if expert_parallel:
        table["expert"] = "tensor"
    if replicate_kv_heads:
        table["kv_heads"] = None
    order = ["expert"] + [k for k in table if k != "expert"] if expert_parallel else list(table)
    return tuple((k, table[k]) for k in order)


def _axis_for(name: Any, rules: Rules) -> Any:
    if name is None:
        return None
    for logical, mesh_axis in rules:
        if logical == name:
            return mesh_axis
    raise KeyError(f"no sharding rule for logical axis {name!r}")


def logical_to_mesh(spec: PartitionSpec, rules: Rules = TENSOR_PARALLEL_RULES) -> PartitionSpec:
    """One logical PartitionSpec as mesh axes; each mesh axis used once (see module doc).

    With expert parallelism the ``expert`` rule comes first, so in
    ``[expert, embed, mlp]`` the experts take `tensor` and ``mlp`` stays whole.
    """
    chosen: list[Any] = [_axis_for(name, rules) for name in spec]
    priority = [logical for logical, _ in rules]
    order = sorted(
        range(len(spec)), key=lambda i: priority.index(spec[i]) if spec[i] in priority else 99
    )
    used: set[str] = set()
    for i in order:
        if chosen[i] is None:
            continue
        if chosen[i] in used:
            chosen[i] = None
        else:
            used.add(chosen[i])
    return PartitionSpec(*chosen)


def mesh_specs(logical: Any, rules: Rules = TENSOR_PARALLEL_RULES) -> Any:
    """Maps a tree of logical PartitionSpecs to mesh-axis PartitionSpecs."""
    return jax.tree_util.tree_map(
        lambda spec: logical_to_mesh(spec, rules),
        logical,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
