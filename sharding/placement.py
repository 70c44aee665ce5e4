"""`Placement`: the devices of one engine replica, and where each parameter goes.

`load_model` calls it once the model's config and parameter shapes are known (before
any tensor is read). It checks that the model fits the parallel sizes, builds one
`ShardingPlan` per pipeline stage (each stage is a tensor group of devices), and
gives every parameter the sharding of its stage: layer ``i`` lives on the stage that
runs it, the embedding on the first stage, the final norm and LM head on the last.
A tied embedding is needed by both ends; it loads on the first stage and the runner
copies it to the last (`jaxengine.runner.pipeline`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxengine.config.parallel import ParallelConfig
from sharding.mesh import check_model_fits, stage_devices, stage_layers, stage_mesh
from sharding.plan import ShardingPlan

_LAYER = re.compile(r"^layers_(\d+)$")


class Placement:
    """Stage plans and parameter shardings for one replica on ``devices``."""

    def __init__(self, parallel: ParallelConfig, devices: Sequence[Any]) -> None:
        self.parallel = parallel
        self.devices = list(devices)
        self.stage_device_groups = stage_devices(parallel, self.devices)
        self.plans: list[ShardingPlan] = []
        self.layer_ranges: list[range] = []

    @property
    def platform(self) -> str:
        """The platform of the replica's devices ("cpu", "gpu", "tpu"): what the engine
        compiles for, which need not be this machine's (``jaxengine tpu-check``)."""
        return self.devices[0].platform

    @property
    def device_kind(self) -> str:
        """The devices' generation, as JAX names it ("TPU v6 lite", "NVIDIA H200")."""
        return self.devices[0].device_kind

    @property
    def num_stages(self) -> int:
        return self.parallel.pipeline_parallel_size

    def stage_of(self, path: tuple[str, ...]) -> int:
        """The pipeline stage that holds the parameter at ``path``."""
        for key in path:
            match = _LAYER.match(key)
            if match:
                layer = int(match.group(1))
                return next(s for s, r in enumerate(self.layer_ranges) if layer in r)
        if path[:2] == ("model", "embed_tokens"):
            return 0
        return self.num_stages - 1  # final norm, lm_head

    def __call__(self, config: Any, logical: Any, abstract: Any) -> Any:
        check_model_fits(self.parallel, config)
        self.layer_ranges = stage_layers(len(config.layers), self.num_stages)
        self.plans = [
            ShardingPlan.create(
                stage_mesh(group), config, expert_parallel=self.parallel.enable_expert_parallel
            )
            for group in self.stage_device_groups
        ]

        def one(path, spec, leaf):
            keys = tuple(getattr(k, "key", str(k)) for k in path)
            plan = self.plans[self.stage_of(keys)]
            return plan.param_sharding("/".join(keys), spec, tuple(leaf.shape))

        return jax.tree_util.tree_map_with_path(
            one, logical, abstract, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
