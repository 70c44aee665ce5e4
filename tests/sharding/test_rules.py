"""Parameters carry logical axis names, and the rules map them onto the mesh."""

from __future__ import annotations

import jax.numpy as jnp
import transformers
from jax.sharding import PartitionSpec as P

from jaxengine.loader.params import abstract_params, logical_axes
from jaxengine.models import get_model
from sharding.rules import mesh_specs


def test_llama_parameters_map_to_tensor_parallel_specs():
    hf = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    module, config = get_model(hf, jnp.float32)
    logical = logical_axes(abstract_params(module, config))
    layer = logical["model"]["layers_0"]
    assert layer["self_attn"]["q_proj"]["weight"] == P("q_heads", "embed")
    assert layer["mlp"]["down_proj"]["weight"] == P("embed", "mlp")
    mesh = mesh_specs(logical)
    layer = mesh["model"]["layers_0"]
    assert mesh["model"]["embed_tokens"]["weight"] == P("tensor", None)
    assert layer["self_attn"]["q_proj"]["weight"] == P("tensor", None)
    assert layer["self_attn"]["o_proj"]["weight"] == P(None, "tensor")
    assert layer["mlp"]["gate_proj"]["weight"] == P("tensor", None)
    assert layer["input_layernorm"]["weight"] == P(None)
