"""The decoder's layers of one kind share one traced body (`layers.decoder.run_layers`).

A model's forward lowers each kind of layer once, as a ``decoder_layer`` function
called once per layer: a Llama's layers are one kind; Gemma 3's sliding-window and
full-attention layers are two. That the shared body computes what each layer computed
alone is every family's golden test (`test_golden_tiny.py`, `test_golden_real.py`).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import transformers

from jaxengine.loader.params import abstract_params, init_inputs
from jaxengine.models import get_model
from jaxengine.models.layers.decoder import layer_kind
from pallas_kernels.kv_cache_update import reference as kv_update
from pallas_kernels.ragged_paged_attention import reference

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
GEMMA3 = dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16)
KINDS = {
    "llama": (transformers.LlamaConfig(**SMALL, num_hidden_layers=5), 1),
    "gemma3": (
        transformers.Gemma3TextConfig(
            **SMALL,
            **GEMMA3,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        2,
    ),
}


def _lowered_forward(hf_config) -> tuple[str, int]:
    module, config = get_model(hf_config, jnp.float32)
    params = nn.unbox(abstract_params(module, config))
    text = jax.jit(module.apply).lower({"params": params}, *init_inputs(config)).as_text()
    return text, len(config.layers)


@pytest.mark.parametrize("family", sorted(KINDS))
def test_each_kind_of_layer_lowers_once(family):
    hf_config, kinds = KINDS[family]
    text, num_layers = _lowered_forward(hf_config)
    assert len(re.findall(r"func\.func private @decoder_layer\w*\(", text)) == kinds
    assert len(re.findall(r"call @decoder_layer\w*\(", text)) == num_layers


def test_layer_kind_tells_apart_what_changes_the_body():
    module, config = get_model(KINDS["gemma3"][0], jnp.float32)
    bound = module.bind({"params": nn.unbox(abstract_params(module, config))})
    layers = bound.model.layers
    kinds = [layer_kind(layer) for layer in layers]
    assert kinds[0] == kinds[2] and kinds[1] == kinds[3]
    assert kinds[0] != kinds[1]


@pytest.mark.parametrize("family", sorted(KINDS))
def test_the_shape_pass_traces_no_attention_and_finds_the_same_parameters(family):
    """`abstract_params` traces stand-ins for the attention and cache write (they hold
    no parameters); the tree is the one the model's own attention gives."""
    calls = []

    def attention(*args, **kwargs):
        calls.append(1)
        return reference.ragged_paged_attention(*args, **kwargs)

    kwargs = {"attention_fn": attention, "update_fn": kv_update.update_kv_cache}
    module, config = get_model(KINDS[family][0], jnp.float32, attention_kwargs=kwargs)
    own = jax.eval_shape(
        lambda: module.init(jax.random.key(0), *init_inputs(config), method="forward_and_logits")
    )["params"]
    assert calls  # the model's own attention, traced
    calls.clear()
    shapes = abstract_params(module, config)
    assert calls == []
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
        lambda x: (x.shape, x.dtype), own
    )
