"""Llama 4's MoE weights on the 8 virtual CPU devices: where each one lands.

Its experts are stacked ``[E, in, out]`` (``gate_proj``/``up_proj [E, H, I]``, cut
from the checkpoint's fused ``gate_up_proj`` at load, and ``down_proj [E, I, H]``).
With expert parallelism each tensor device must hold whole experts; with tensor
parallelism alone every device holds every expert, split by its ``I`` columns; the
shared expert and the dense layers split like any gated MLP. Each layout's greedy
tokens must equal the one-device engine's (numerics against transformers:
`tests/models/test_new_families_engine.py`).
"""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from tests.models.family_engine import save_tiny
from tests.models.test_new_families_engine import llama4
from tests.sharding.engine_checks import build, bytes_per_device, greedy, runner_of


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A tiny Llama 4 (4 experts) and its one-device greedy tokens."""
    path = save_tiny(llama4(), tmp_path_factory.mktemp("llama4"))
    llm = build(path)
    try:
        return path, greedy(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "expert_parallel, gate_up, down",
    [
        (True, P("tensor", None, None), P("tensor", None, None)),
        (False, P(None, None, "tensor"), P(None, "tensor", None)),
    ],
    ids=["ep4", "tp4-experts-split-by-columns"],
)
def test_llama4_moe_placement(llama4_dir, expert_parallel, gate_up, down):
    path, want = llama4_dir
    llm = build(path, tensor_parallel_size=4, enable_expert_parallel=expert_parallel)
    try:
        assert greedy(llm) == want
        params = runner_of(llm).params["model"]
        moe = params["layers_1"]["feed_forward"]
        experts = moe["experts"]
        assert experts["gate_proj"].sharding.spec == experts["up_proj"].sharding.spec == gate_up
        assert experts["down_proj"].sharding.spec == down
        for leaf in (experts["gate_proj"], experts["up_proj"], experts["down_proj"]):
            assert set(bytes_per_device(leaf).values()) == {leaf.nbytes // 4}
        if expert_parallel:  # one of the 4 experts, whole, per device
            shards = experts["up_proj"].addressable_shards
            assert {s.data.shape for s in shards} == {(1, 64, 96)}
        shared = moe["shared_expert"]["gate_proj"]["weight"]  # [I, H]: rows split
        assert shared.sharding.spec == P("tensor", None)
        dense = params["layers_0"]["feed_forward"]["down_proj"]["weight"]  # [H, I]
        assert dense.sharding.spec == P(None, "tensor")
    finally:
        llm.shutdown()
