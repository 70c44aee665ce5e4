"""Rotary frequencies of every scaling variant against transformers' definitions."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxengine.models.layers.config import rope_from_hf
from jaxengine.models.layers.rope import inv_freq_and_scale

BASE = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096)

VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    },
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inv_freq_matches_transformers(name):
    config = transformers.LlamaConfig(**BASE, rope_parameters=dict(VARIANTS[name]))
    want, want_scale = ROPE_INIT_FUNCTIONS[name](config, "cpu")
    got, scale = inv_freq_and_scale(rope_from_hf(config), 64)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale)


def test_dynamic_uses_the_extended_length():
    config = transformers.LlamaConfig(
        **BASE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    spec = rope_from_hf(config)
    assert spec.original_max_position_embeddings == 4096
    got, _ = inv_freq_and_scale(spec, 64)
    base = 10000.0 * (2.0 * 2 - 1) ** (64 / 62)
    np.testing.assert_allclose(got, 1.0 / base ** (np.arange(0, 64, 2) / 64), rtol=1e-6)


def test_unknown_rope_type_is_named():
    config = transformers.LlamaConfig(**BASE)
    spec = rope_from_hf(config)
    import dataclasses

    with pytest.raises(ValueError, match="longrope"):
        inv_freq_and_scale(dataclasses.replace(spec, rope_type="longrope"), 64)
