"""DeepSeek-V3's weights and latent KV cache on 4 of the 8 virtual CPU devices.

Multi-head latent attention splits by query heads: ``q_b_proj`` and ``kv_b_proj``
(rows head-major) by rows, ``o_proj`` by columns, while the low-rank down projections
(``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms are whole on every device,
since every head reads the one latent. The cache holds one latent row per token and
device: ``[pages, page_size, tp, L + R]`` split on axis 2, each device its own copy.
Experts split as GLM-4.5's (`test_glm4_moe_placement.py`). Numerics of these layouts
against transformers: `tests/models/test_new_families_engine.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import transformers
from jax.sharding import PartitionSpec as P

from jaxengine.models import family_config
from jaxengine.models.layers.attention import kv_cache_shape
from sharding.mesh import stage_mesh
from sharding.plan import ShardingPlan
from tests.models.deepseek_v3_tiny import MLA_SIZES, deepseek_v3_tiny
from tests.models.family_engine import save_tiny
from tests.models.glm4_moe_tiny import randomize_saved_correction_bias
from tests.sharding.placement_checks import SMALL, load_placed, shard_shapes

ROW = MLA_SIZES["kv_lora_rank"] + MLA_SIZES["qk_rope_head_dim"]  # 40 values a token
KV_B_ROWS = SMALL["num_attention_heads"] * (MLA_SIZES["qk_nope_head_dim"] + MLA_SIZES["v_head_dim"])


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory) -> str:
    config = transformers.DeepseekV3Config(**deepseek_v3_tiny(SMALL))
    path = save_tiny(config, tmp_path_factory.mktemp("deepseek_v3"), init_range=None)
    randomize_saved_correction_bias(path, std=0.05)
    return str(path)


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep4", "tp4"])
def test_mla_weights_split_by_heads(ds_dir, expert_parallel):
    params = load_placed(ds_dir, expert_parallel)
    attn = params["layers_2"]["self_attn"]
    assert attn["q_b_proj"]["weight"].sharding.spec == P("tensor", None)
    assert attn["kv_b_proj"]["weight"].sharding.spec == P("tensor", None)
    assert shard_shapes(attn["kv_b_proj"]["weight"]) == {(KV_B_ROWS // 4, 32)}  # one head
    assert attn["o_proj"]["weight"].sharding.spec == P(None, "tensor")
    for whole in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm"):
        leaf = attn[whole]["weight"]
        assert shard_shapes(leaf) == {leaf.shape}, whole
    moe = params["layers_2"]["mlp"]
    gate_shards = shard_shapes(moe["experts_gate_proj"])  # [E=8, H=64, I=32]
    assert gate_shards == ({(2, 64, 32)} if expert_parallel else {(8, 64, 8)})
    assert "experts_gate_proj" not in params["layers_1"]["mlp"]  # first_k_dense_replace 2


def test_latent_cache_is_one_row_per_device(ds_dir):
    """The plan's cache for tp 4: four rows a token (one per device), each device's
    shard ``[pages, page_size, 1, L + R]``."""
    config = family_config(transformers.AutoConfig.from_pretrained(ds_dir), "float32")
    plan = ShardingPlan.create(stage_mesh(jax.devices()[:4]), config)
    assert (plan.kv_cache_heads, plan.kv_heads_per_device) == (4, 1)
    shape = kv_cache_shape(config, 3, 8, plan.kv_cache_heads)
    assert shape == (3, 8, 4, ROW)
    cache = jax.device_put(jnp.zeros(shape), plan.kv_cache_sharding)
    assert shard_shapes(cache) == {(3, 8, 1, ROW)}
