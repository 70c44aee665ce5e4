"""gpt-oss's attention sinks and MoE weights on 4 of the 8 virtual CPU devices.

A tiny checkpoint (`tests.models.gpt_oss_tiny`: 4 query heads, 8 experts with biases)
loads through `load_model` with a `Placement`. The sinks split with the query heads
(one per device). With expert parallelism each tensor device holds 2 whole experts,
their biases and their router rows; with tensor parallelism alone every device holds
every expert split by its ``I`` columns, the gate and up biases split alike and the
down bias whole. Numerics of both layouts against transformers:
`tests/models/test_new_families_engine.py`.
"""

from __future__ import annotations

import jax
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec as P

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.loader import load_model
from sharding.placement import Placement
from tests.models.gpt_oss_tiny import gpt_oss_tiny

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**gpt_oss_tiny(SMALL))
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return str(path)


def shard_shapes(leaf) -> set[tuple[int, ...]]:
    return {s.data.shape for s in leaf.addressable_shards}


EP = {
    "experts_gate_proj": (P("tensor", None, None), (2, 32, 64)),
    "experts_down_proj": (P("tensor", None, None), (2, 64, 32)),
    "experts_gate_proj_bias": (P("tensor", None), (2, 32)),
    "experts_up_proj_bias": (P("tensor", None), (2, 32)),
    "experts_down_proj_bias": (P("tensor", None), (2, 64)),
}
TP = {
    "experts_gate_proj": (P(None, "tensor", None), (8, 8, 64)),
    "experts_down_proj": (P(None, None, "tensor"), (8, 64, 8)),
    "experts_gate_proj_bias": (P(None, "tensor"), (8, 8)),
    "experts_up_proj_bias": (P(None, "tensor"), (8, 8)),
    "experts_down_proj_bias": (P(None, None), (8, 64)),
}


@pytest.mark.parametrize(
    "expert_parallel, leaves, router", [(True, EP, P("tensor")), (False, TP, P(None))],
    ids=["ep4", "tp4"],
)  # fmt: skip
def test_gpt_oss_placement(gpt_oss_dir, expert_parallel, leaves, router):
    parallel = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=expert_parallel)
    placement = Placement(parallel, jax.devices()[:4])
    model_config = ModelConfig(model=gpt_oss_dir, dtype="float32")
    params = load_model(model_config, LoadConfig(), placement).params["model"]
    for layer in ("layers_0", "layers_1"):  # a sliding and a full layer
        sinks = params[layer]["self_attn"]["sinks"]  # [Hq = 4]
        assert sinks.sharding.spec == P("tensor") and shard_shapes(sinks) == {(1,)}
        moe = params[layer]["mlp"]
        for name, (spec, shard) in leaves.items():
            assert moe[name].sharding.spec == spec, name
            assert shard_shapes(moe[name]) == {shard}, name
        assert moe["gate"]["bias"].sharding.spec == router
