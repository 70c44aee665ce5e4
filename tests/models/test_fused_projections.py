"""Fused q/k/v and gate/up projections give the unfused model's outputs.

For each family on a tiny random config (float32): random parameters of the unfused
model, with nonzero biases and norm scales, are written out under their Hugging Face
names and loaded into the fused model through `params_from_tensors` (the path both
safetensors and GGUF take); a ragged prefill then greedy decode through the paged
cache must give the same tokens and logits within 1e-5 relative error. Also: when
`load_model` fuses, and the dummy load format on a fused model.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.loader import FUSE_ENV, fuse_projections, load_model
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import abstract_params, dummy_params, params_from_tensors
from jaxengine.models import get_model
from jaxengine.runner.greedy_loop import GreedyLoop
from tests.models.test_golden_tiny import FAMILIES, SMALL

# bias, qk-norm, MoE; GLM-4.5: its MoE layers' shared expert fuses gate/up too
CASES = ["llama3_rope", "qwen2", "qwen3", "gemma3", "qwen3_moe", "glm4_moe"]
PROMPT_LENS = (5, 9, 2)
DECODE_STEPS = 3


def random_params(module, config, seed: int = 0) -> dict:
    """Every leaf random (biases and norm scales too, so their fusion is checked)."""
    rng = np.random.default_rng(seed)
    shapes = jax.tree.map(lambda x: x, abstract_params(module, config))
    return jax.tree.map(
        lambda leaf: jnp.asarray(0.1 * rng.standard_normal(leaf.value.shape), jnp.float32),
        shapes,
        is_leaf=lambda x: hasattr(x, "value"),
    )


def hf_tensors(params: dict):
    """``(hf_name, array)`` pairs of an unfused parameter tree (the checkpoint)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [k.key.replace("layers_", "layers.") for k in path]
        name = ".".join(keys)
        if keys[-1].startswith("experts_"):  # stacked [E, in, out] -> per expert [out, in]
            prefix, proj = ".".join(keys[:-1]), keys[-1].removeprefix("experts_")
            for e, expert in enumerate(np.asarray(leaf)):
                yield f"{prefix}.experts.{e}.{proj}.weight", expert.T
        else:
            yield name, np.asarray(leaf)


def build(family: str, fused: bool):
    module, config = get_model(FAMILIES[family](), jnp.float32)
    if fused:
        config = dataclasses.replace(config, fused_projections=True)
        module = module.clone(config=config)
    return module, config


def generate(module, config, params):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in PROMPT_LENS]
    loop = GreedyLoop(module, config, params, page_size=4)
    return loop.generate(prompts, DECODE_STEPS, return_logits=True)


@pytest.mark.parametrize("family", CASES)
def test_fused_matches_unfused(family):
    module, config = build(family, fused=False)
    params = random_params(module, config)
    fused_module, fused_config = build(family, fused=True)
    fused = params_from_tensors(fused_module, fused_config, hf_tensors(params), "test")

    attn = fused["model"]["layers_0"]["self_attn"]
    assert set(attn) >= {"qkv_proj", "o_proj"} and "q_proj" not in attn
    if "gate_up_proj" not in fused["model"]["layers_0"]["mlp"]:
        assert family == "qwen3_moe"  # its experts stay as they are
    if family == "glm4_moe":
        assert set(fused["model"]["layers_1"]["mlp"]["shared_experts"]) == {
            "gate_up_proj",
            "down_proj",
        }
    want_tokens, want_logits = generate(module, config, params)
    got_tokens, got_logits = generate(fused_module, fused_config, fused)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits, strict=True):
        for w, g in zip(want, got, strict=True):
            assert np.abs(g - w).max() / np.abs(w).max() < 1e-5


def test_fused_weights_are_the_concatenated_tensors():
    module, config = build("qwen2", fused=False)
    params = random_params(module, config)
    fused_module, fused_config = build("qwen2", fused=True)
    fused = params_from_tensors(fused_module, fused_config, hf_tensors(params), "test")
    attn, mlp = params["model"]["layers_1"]["self_attn"], params["model"]["layers_1"]["mlp"]
    layer = fused["model"]["layers_1"]
    for leaf in ("weight", "bias"):
        parts = [attn[p][leaf] for p in ("q_proj", "k_proj", "v_proj")]
        np.testing.assert_array_equal(layer["self_attn"]["qkv_proj"][leaf], np.concatenate(parts))
    gate_up = np.concatenate([mlp["gate_proj"]["weight"], mlp["up_proj"]["weight"]])
    np.testing.assert_array_equal(layer["mlp"]["gate_up_proj"]["weight"], gate_up)


def test_a_misshapen_part_is_named():
    module, config = build("llama3_rope", fused=False)
    tensors = dict(hf_tensors(random_params(module, config)))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1]
    with pytest.raises(CheckpointError, match="k_proj.weight"):
        params_from_tensors(*build("llama3_rope", fused=True), tensors.items(), "test")
    tensors.pop(name)
    with pytest.raises(CheckpointError, match="qkv_proj"):
        params_from_tensors(*build("llama3_rope", fused=True), tensors.items(), "test")


def test_dummy_parameters_of_a_fused_model_run():
    module, config = build("qwen3", fused=True)
    params = dummy_params(module, config)
    qkv = params["model"]["layers_0"]["self_attn"]["qkv_proj"]["weight"]
    assert qkv.shape == ((4 + 2 + 2) * 32, SMALL["hidden_size"])
    tokens, _ = generate(module, config, params)
    assert all(len(t) == DECODE_STEPS for t in tokens)


def placement_of(**parallel):
    return types.SimpleNamespace(parallel=ParallelConfig(**parallel))


def test_only_unsplit_placements_fuse(monkeypatch):
    monkeypatch.delenv(FUSE_ENV, raising=False)
    assert fuse_projections(None)
    assert fuse_projections(placement_of(pipeline_parallel_size=2))
    assert not fuse_projections(placement_of(tensor_parallel_size=2))
    assert not fuse_projections(lambda config, axes, abstract: None)  # unknown kind
    monkeypatch.setenv(FUSE_ENV, "0")
    assert not fuse_projections(None)


def test_load_model_fuses_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(FUSE_ENV, raising=False)
    hf_model = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen2"]())
    hf_model.save_pretrained(tmp_path)
    model_config = ModelConfig(model=str(tmp_path), dtype="float32")
    for load_format in ("auto", "dummy"):
        loaded = load_model(model_config, LoadConfig(load_format=load_format))
        assert loaded.config.fused_projections
        assert "qkv_proj" in loaded.params["model"]["layers_0"]["self_attn"]
        assert "qkv_proj" in loaded.logical_axes["model"]["layers_0"]["self_attn"]
    monkeypatch.setenv(FUSE_ENV, "0")
    loaded = load_model(model_config, LoadConfig())
    assert "q_proj" in loaded.params["model"]["layers_0"]["self_attn"]
