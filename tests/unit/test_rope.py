"""Rotary frequencies of every scaling variant against transformers' definitions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxengine.models.layers.config import (
    LayerSpec,
    RopeSpec,
    TransformerConfig,
    rope_from_hf,
    with_context_length,
)
from jaxengine.models.layers.rope import apply_rope, inv_freq_and_scale

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
    with pytest.raises(ValueError, match="mystery"):
        inv_freq_and_scale(dataclasses.replace(spec, rope_type="mystery"), 64)


def phi3_longrope(max_len: int, original: int, **rope) -> transformers.Phi3Config:
    """A Phi3Config with LongRoPE over half of each 64-wide head (16 frequencies)."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [3.0 + 2.0 * i for i in range(16)],
        **rope,
    }
    return transformers.Phi3Config(
        **{**BASE, "max_position_embeddings": max_len},
        original_max_position_embeddings=original,
        rope_parameters=rope,
    )


@pytest.mark.parametrize(
    ("max_len", "original", "extra", "long"),
    [
        (4096, 4096, {}, False),  # factor 1: no scaling of cos/sin
        (4096, 4096, {"factor": 4.0}, False),  # an explicit factor sets the scale
        (131072, 4096, {}, True),  # Phi-3-128k: factor 32 from the two lengths
        (131072, 4096, {"attention_factor": 1.25}, True),
    ],
)
def test_longrope_matches_transformers(max_len, original, extra, long):
    """An engine of the checkpoint's whole context takes transformers' long frequencies
    (those of a sequence past the original length) when that context exceeds the
    original length, else its short ones; the cos/sin scale is transformers'."""
    config = phi3_longrope(max_len, original, **extra)
    seq_len = original + 1 if long else None
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    spec = rope_from_hf(config)
    assert spec.longrope_long is long
    got, scale = inv_freq_and_scale(spec, 64)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale)


def test_longrope_factors_follow_the_engine_context():
    """`with_context_length`: long factors exactly when --max-model-len exceeds the
    original length (vLLM's rule), whatever the checkpoint's own maximum."""
    config = transformers.Phi3Config(**BASE)
    base = TransformerConfig(
        vocab_size=8, hidden_size=256, intermediate_size=8, num_heads=4, num_kv_heads=4,
        head_dim=64, layers=(LayerSpec(rope=rope_from_hf(phi3_longrope(131072, 4096))),),
    )  # fmt: skip
    for max_model_len, long in [(None, True), (4096, False), (4097, True)]:
        fitted = with_context_length(base, max_model_len)
        assert fitted.layers[0].rope.longrope_long is long
    plain = dataclasses.replace(base, layers=(LayerSpec(rope=rope_from_hf(config)),))
    assert with_context_length(plain, 8) == plain  # other rope types are untouched


def test_interleaved_rope_is_the_complex_rotation():
    """``RopeSpec(interleaved=True)`` (Llama 4): features ``(2j, 2j + 1)`` as one complex
    number times ``exp(i * pos * inv_freq[j])``, as transformers' ``apply_rotary_emb``
    (``torch.view_as_complex``); the rotate-half form differs on the same input."""
    spec = RopeSpec(theta=500.0, interleaved=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)  # [T, H, D]
    pos = np.array([0, 1, 7, 30, 123], np.int32)
    inv_freq, _ = inv_freq_and_scale(spec, 8)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    rotated = z * np.exp(1j * pos[:, None, None] * inv_freq[None, None, :].astype(np.float64))
    want = np.stack([rotated.real, rotated.imag], axis=-1).reshape(x.shape)
    got = np.asarray(apply_rope(x, pos, spec))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    half = np.asarray(apply_rope(x, pos, dataclasses.replace(spec, interleaved=False)))
    assert np.abs(half - want).max() > 0.1


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_truncate_matches_transformers(truncate):
    """gpt-oss's yarn (``truncate: false``: the ramp's ends stay fractional) and the
    default (floor / ceil), as transformers computes them for a GptOssConfig."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": truncate,
        "original_max_position_embeddings": 4096,
    }
    config = transformers.GptOssConfig(head_dim=64, rope_parameters=rope)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    spec = rope_from_hf(config)
    assert spec.truncate is truncate
    got, scale = inv_freq_and_scale(spec, 64)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale)
    other, _ = inv_freq_and_scale(dataclasses.replace(spec, truncate=not truncate), 64)
    assert np.abs(other - got).max() > 1e-6 * np.abs(got).max()  # the flag matters here
