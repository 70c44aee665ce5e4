"""`ShardingPlan`: where one pipeline stage's parameters and KV cache live.

Built from the stage's mesh, the model config and the parallel flags. It answers:

- the `NamedSharding` of every parameter (logical names -> rules -> mesh axes; a
  vocabulary that the tensor size does not divide stays replicated, any other
  indivisible split is an error naming the parameter);
- the KV cache's layout: split by KV heads over `tensor`, or, with fewer KV heads
  than tensor devices, one KV head per device (each head stored on the tensor/Hkv
  devices whose query heads read it). A multi-head latent attention model
  (DeepSeek-V3) has one such head, its latent row: every device keeps its own copy
  of the latent cache while the query heads split;
- the attention and MoE functions to inject into the model, wrapped in `shard_map`
  so kernels see plain per-device arrays (`sharding.attention`, `sharding.experts`).

A one-device plan changes nothing: no wrapping, parameters on that device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import Rules, logical_to_mesh, make_rules


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh: Mesh
    rules: Rules
    num_kv_heads: int  # the model's
    expert_parallel: bool = False

    @classmethod
    def create(cls, mesh: Mesh, config: Any, *, expert_parallel: bool = False) -> ShardingPlan:
        tp = mesh.shape["tensor"]
        lora = getattr(config, "lora", None)
        rules = make_rules(
            expert_parallel=expert_parallel,
            replicate_kv_heads=config.num_kv_heads < tp,
            fully_sharded_loras=lora is not None and lora.fully_sharded,
        )
        return cls(mesh, rules, config.num_kv_heads, expert_parallel)

    @property
    def tensor_size(self) -> int:
        return self.mesh.shape["tensor"]

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.reshape(-1))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    # ------------------------------------------------------------------ parameters

    def param_sharding(self, name: str, logical: PartitionSpec, shape: tuple) -> NamedSharding:
        spec = list(logical_to_mesh(logical, self.rules))
        for dim, axis in enumerate(spec):
            if axis is None or shape[dim] % self.mesh.shape[axis] == 0:
                continue
            if logical[dim] == "vocab":
                spec[dim] = None  # odd vocabularies stay whole on every device
                continue
            raise ValueError(
                f"parameter {name} ({logical[dim]} axis of size {shape[dim]}) cannot be "
                f"split over {self.mesh.shape[axis]} devices of the {axis!r} axis"
            )
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    # ------------------------------------------------------------------ KV cache

    @property
    def replicate_kv(self) -> bool:
        return self.num_kv_heads < self.tensor_size

    @property
    def kv_cache_heads(self) -> int:
        """KV heads along the cache's head axis: the model's, or one per tensor device."""
        return self.tensor_size if self.replicate_kv else self.num_kv_heads

    @property
    def kv_heads_per_device(self) -> int:
        return self.kv_cache_heads // self.tensor_size

    @property
    def kv_cache_sharding(self) -> NamedSharding:
        """``[pages, page_size, 2 * heads, head_dim]`` split on the (K, V) head axis."""
        return NamedSharding(self.mesh, PartitionSpec(None, None, "tensor", None))

    # ------------------------------------------------------------------ kernels

    def attention_kwargs(self, attention_kwargs: dict) -> dict:
        """The model's ``attention_kwargs`` with the functions run per shard, the
        attention told a padded cache's real heads (`sharding.attention.with_real_heads`)."""
        from sharding.attention import shard_attention_fns, with_real_heads

        attention_kwargs = with_real_heads(attention_kwargs, self.kv_heads_per_device)
        if self.tensor_size == 1:
            return attention_kwargs
        return shard_attention_fns(attention_kwargs, self.mesh, self.num_kv_heads)

    def moe_kwargs(self) -> dict:
        """The model's ``moe_kwargs``: experts per shard under expert parallelism;
        under tensor parallelism alone, XLA splits the experts, and their grouped
        matmul keeps to what it can split (`layers.mlp.routed_experts`' ``kernels``)."""
        if self.tensor_size == 1:
            return {}
        if not self.expert_parallel:
            from jaxengine.models.layers.mlp import routed_experts

            return {"experts_fn": functools.partial(routed_experts, kernels=False)}
        from sharding.experts import expert_parallel_fn

        return {"experts_fn": expert_parallel_fn(self.mesh)}
