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

import pytest
import transformers
from jax.sharding import PartitionSpec as P

from tests.models.family_engine import save_tiny
from tests.models.gpt_oss_tiny import gpt_oss_tiny
from tests.sharding.placement_checks import SMALL, load_placed, shard_shapes


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    config = transformers.GptOssConfig(**gpt_oss_tiny(SMALL))
    return save_tiny(config, tmp_path_factory.mktemp("gpt_oss"), init_range=None)


EP = {  # experts [E, in, out]: gate [8, 64, 32], down [8, 32, 64]
    "experts_gate_proj": (P("tensor", None, None), (2, 64, 32)),
    "experts_down_proj": (P("tensor", None, None), (2, 32, 64)),
    "experts_gate_proj_bias": (P("tensor", None), (2, 32)),
    "experts_up_proj_bias": (P("tensor", None), (2, 32)),
    "experts_down_proj_bias": (P("tensor", None), (2, 64)),
}
TP = {
    "experts_gate_proj": (P(None, None, "tensor"), (8, 64, 8)),
    "experts_down_proj": (P(None, "tensor", None), (8, 8, 64)),
    "experts_gate_proj_bias": (P(None, "tensor"), (8, 8)),
    "experts_up_proj_bias": (P(None, "tensor"), (8, 8)),
    "experts_down_proj_bias": (P(None, None), (8, 64)),
}


@pytest.mark.parametrize(
    "expert_parallel, leaves, router", [(True, EP, P("tensor")), (False, TP, P(None))],
    ids=["ep4", "tp4"],
)  # fmt: skip
def test_gpt_oss_placement(gpt_oss_dir, expert_parallel, leaves, router):
    params = load_placed(gpt_oss_dir, expert_parallel)
    for layer in ("layers_0", "layers_1"):  # a sliding and a full layer
        sinks = params[layer]["self_attn"]["sinks"]  # [Hq = 4]
        assert sinks.sharding.spec == P("tensor") and shard_shapes(sinks) == {(1,)}
        moe = params[layer]["mlp"]
        for name, (spec, shard) in leaves.items():
            assert moe[name].sharding.spec == spec, name
            assert shard_shapes(moe[name]) == {shard}, name
        assert moe["gate"]["bias"].sharding.spec == router
