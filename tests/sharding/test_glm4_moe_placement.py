"""GLM-4.5's MoE weights on 4 of the 8 virtual CPU devices: where each one lands.

A tiny checkpoint (8 experts, a shared expert, one dense layer) loads through
`load_model` with a `Placement`. With expert parallelism each tensor device holds 2
whole experts (and their correction biases); with tensor parallelism alone every
device holds every expert, split by its ``I`` columns. The shared expert and the dense
MLP split like any gated MLP in both layouts. Numerics of both layouts against
transformers: `tests/models/test_new_families_engine.py`.
"""

from __future__ import annotations

import pytest
import transformers
from jax.sharding import PartitionSpec as P

from tests.models.family_engine import save_tiny
from tests.models.glm4_moe_tiny import glm4_moe_tiny, randomize_saved_correction_bias
from tests.sharding.placement_checks import SMALL, load_placed, shard_shapes


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    config = transformers.Glm4MoeConfig(**glm4_moe_tiny(SMALL))
    path = save_tiny(config, tmp_path_factory.mktemp("glm4_moe"), init_range=None)
    randomize_saved_correction_bias(path, std=0.05)
    return path


EP_EXPERTS = (P("tensor", None, None),) * 3
TP_EXPERTS = (P(None, None, "tensor"), P(None, None, "tensor"), P(None, "tensor", None))


@pytest.mark.parametrize(
    "expert_parallel, experts, bias",
    [(True, EP_EXPERTS, P("tensor")), (False, TP_EXPERTS, P(None))],
    ids=["ep4", "tp4"],
)
def test_glm4_moe_placement(glm_dir, expert_parallel, experts, bias):
    params = load_placed(glm_dir, expert_parallel)
    moe = params["layers_1"]["mlp"]  # experts [E, H, I], [E, H, I], [E, I, H]
    names = ("experts_gate_proj", "experts_up_proj", "experts_down_proj")
    for name, spec in zip(names, experts, strict=True):
        assert moe[name].sharding.spec == spec, name
    gate_shards = shard_shapes(moe["experts_gate_proj"])  # [E=8, H=64, I=32]
    assert gate_shards == ({(2, 64, 32)} if expert_parallel else {(8, 64, 8)})
    assert moe["e_score_correction_bias"].sharding.spec == bias
    assert shard_shapes(moe["e_score_correction_bias"]) == {(2,) if expert_parallel else (8,)}
    shared = moe["shared_experts"]  # [I, H] rows split, [H, I] columns split
    assert shared["gate_proj"]["weight"].sharding.spec == P("tensor", None)
    assert shared["down_proj"]["weight"].sharding.spec == P(None, "tensor")
    dense = params["layers_0"]["mlp"]["down_proj"]["weight"]
    assert dense.sharding.spec == P(None, "tensor")
