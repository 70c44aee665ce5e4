"""Where a tiny MoE checkpoint's weights land on 4 of the 8 virtual CPU devices: the
shared sizes, loading through `load_model` with a `Placement`, and each leaf's shards.
Used by the per-family placement tests (`test_glm4_moe_placement.py`,
`test_gpt_oss_placement.py`)."""

from __future__ import annotations

import jax

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.loader import load_model
from sharding.placement import Placement
from tests.models.tiny_configs import TINY_SIZES

SMALL = dict(vocab_size=128, **TINY_SIZES)
"""The tiny base a family's config helper (``glm4_moe_tiny``, ``gpt_oss_tiny``) builds on."""


def load_placed(path: str, expert_parallel: bool) -> dict:
    """The float32 checkpoint at ``path`` loaded at tensor parallelism 4 (with or
    without expert parallelism) on the first 4 devices: its ``model`` parameters."""
    parallel = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=expert_parallel)
    placement = Placement(parallel, jax.devices()[:4])
    model_config = ModelConfig(model=path, dtype="float32")
    return load_model(model_config, LoadConfig(), placement).params["model"]


def shard_shapes(leaf: jax.Array) -> set[tuple[int, ...]]:
    """The shapes of ``leaf``'s shards on this host's devices."""
    return {s.data.shape for s in leaf.addressable_shards}
