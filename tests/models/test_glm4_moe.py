"""GLM-4.5 specifics outside the golden logits (`tests/models/test_golden_tiny.py`):
its router stays float32 in a bfloat16 model, a checkpoint's multi-token-prediction
layer is skipped at load, and fused expert tensors load as the per-expert ones."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import abstract_params, params_from_tensors
from jaxengine.models import get_model
from tests.models.glm4_moe_tiny import glm4_moe_tiny
from tests.models.test_golden_tiny import SMALL


def tiny_config() -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(**glm4_moe_tiny(SMALL))


def test_router_and_bias_stay_float32_in_a_bfloat16_model():
    module, config = get_model(tiny_config(), jnp.bfloat16)
    moe = nn.unbox(abstract_params(module, config))["model"]["layers_1"]["mlp"]
    assert moe["gate"]["weight"].dtype == jnp.float32
    assert moe["e_score_correction_bias"].dtype == jnp.float32
    assert moe["experts_gate_proj"].dtype == jnp.bfloat16
    assert moe["shared_experts"]["down_proj"]["weight"].dtype == jnp.bfloat16


def checkpoint(hf_config, path) -> dict[str, np.ndarray]:
    """The tensors as transformers saves them (one per expert)."""
    transformers.AutoModelForCausalLM.from_config(hf_config).float().save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def test_multi_token_prediction_layer_is_skipped(tmp_path):
    """GLM-4.5 checkpoints append ``num_nextn_predict_layers`` layers after the last
    decoder layer (a decoder layer plus eh_proj, enorm, hnorm, shared_head): the
    loader drops them, and still fills every parameter, the bias included."""
    hf_config = tiny_config()
    tensors = checkpoint(hf_config, tmp_path)
    last = hf_config.num_hidden_layers
    mtp = {
        f"model.layers.{last}.{name}": value
        for name, value in tensors.items()
        if name.startswith("model.layers.1.")
        for name in [name.removeprefix("model.layers.1.")]
    }
    mtp[f"model.layers.{last}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    mtp[f"model.layers.{last}.shared_head.norm.weight"] = np.ones(64, np.float32)
    bias = next(n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias"))
    tensors[bias] = np.arange(8, dtype=np.float32)
    module, config = get_model(hf_config, jnp.float32)
    params = params_from_tensors(module, config, {**tensors, **mtp}.items(), "test")
    layer = bias.split(".")[2]
    got = params["model"][f"layers_{layer}"]["mlp"]["e_score_correction_bias"]
    np.testing.assert_array_equal(np.asarray(got), np.arange(8))
    assert f"layers_{last}" not in params["model"]
    with pytest.raises(CheckpointError, match="has no place"):  # not a layer: refused
        params_from_tensors(module, config, [*tensors.items(), ("model.eh_proj.w", mtp[
            f"model.layers.{last}.eh_proj.weight"])], "test")  # fmt: skip


def test_fused_experts_load_as_the_per_expert_tensors(tmp_path):
    """transformers 5.x holds the experts fused in memory (``experts.gate_up_proj
    [E, 2I, H]``, ``experts.down_proj [E, H, I]``); a checkpoint written that way
    gives the parameters of the per-expert one that ``save_pretrained`` writes."""
    hf_config = tiny_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float()
    fused = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in saved
    module, config = get_model(hf_config, jnp.float32)
    want = params_from_tensors(module, config, saved.items(), "saved")
    got = params_from_tensors(module, config, fused.items(), "fused")
    for name in ("experts_gate_proj", "experts_up_proj", "experts_down_proj"):
        np.testing.assert_array_equal(
            np.asarray(got["model"]["layers_2"]["mlp"][name]),
            np.asarray(want["model"]["layers_2"]["mlp"][name]),
        )
