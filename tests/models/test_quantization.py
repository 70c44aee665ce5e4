"""Weight-only int8 and fp8 (``--quantization int8|fp8``) on tiny random configs.

A float checkpoint (random, under its Hugging Face names) is loaded into the quantized
model through `params_from_tensors`, which quantizes each projection per output row.
The reference is the float model whose weights are those same quantized values
dequantized with numpy: a ragged prefill and greedy decode through the paged cache
must give its tokens, and its logits within 1e-5 relative error (the scale applied
after the dot instead of before). The placed projections take a quarter of their
float32 bytes plus one float32 scale per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loader.params import dummy_params, params_from_tensors
from jaxengine.models import get_model
from jaxengine.models.layers.quant import METHODS, quantize
from tests.models.test_fused_projections import generate, hf_tensors, random_params
from tests.models.test_golden_tiny import FAMILIES, SMALL

CASES = ["llama3_rope", "qwen3", "qwen3_moe"]


def build(family: str, method: str | None, fused: bool = False):
    module, config = get_model(FAMILIES[family](), jnp.float32)
    config = dataclasses.replace(config, quantization=method, fused_projections=fused)
    return module.clone(config=config), config


def dequantized(tree: dict) -> dict:
    """The float tree: each quantized leaf times its ``<name>_scale`` row scales (numpy)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = dequantized(value)
        elif key.endswith("_scale"):
            continue
        elif f"{key}_scale" in tree:
            q, scale = np.asarray(value).astype(np.float32), np.asarray(tree[f"{key}_scale"])
            out[key] = jnp.asarray(q * scale[..., None])
        else:
            out[key] = value
    return out


def quantized_pairs(tree: dict):
    """(weight, scale) of every quantized leaf."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from quantized_pairs(value)
        elif f"{key}_scale" in tree:
            yield value, tree[f"{key}_scale"]


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", CASES)
def test_logits_match_the_dequantized_reference(family, method):
    float_module, float_config = build(family, None)
    params = random_params(float_module, float_config)
    module, config = build(family, method)
    qparams = params_from_tensors(module, config, hf_tensors(params), "test")
    pairs = list(quantized_pairs(qparams))
    per_layer = 4 + 3  # q, k, v, o + gate, up, down (dense or experts)
    assert len(pairs) == per_layer * float_config.num_layers
    assert {str(w.dtype) for w, _ in pairs} == {str(METHODS[method][0])}
    quant_bytes = sum(w.nbytes + s.nbytes for w, s in pairs)
    float_bytes = sum(4 * w.size for w, _ in pairs)
    extra = max(4 * s.size / (4 * w.size) for w, s in pairs)  # one scale per row
    assert 0.25 < quant_bytes / float_bytes <= 0.25 + extra

    want_tokens, want_logits = generate(float_module, float_config, dequantized(qparams))
    got_tokens, got_logits = generate(module, config, qparams)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits, strict=True):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("method", sorted(METHODS))
def test_quantized_rows_are_close_to_the_weights(method):
    rng = np.random.default_rng(0)
    w = (
        rng.standard_normal((3, 16, 64)).astype(np.float32)
        * np.array([1e-3, 1.0, 50.0])[:, None, None]
    )
    w[0, 0] = 0.0  # an all-zero row keeps a finite scale
    q, scale = quantize(w, method, np)
    assert q.dtype == METHODS[method][0] and scale.shape == (3, 16)
    back = q.astype(np.float32) * scale[..., None]
    if method == "int8":  # half a step of the row's scale
        assert np.all(np.abs(back - w) <= 0.5 * scale[..., None] * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits, so within 1/16 of each value (or of the row's step)
        bound = np.maximum(np.abs(w) / 16, scale[..., None] * 2.0**-9)
        assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    np.testing.assert_array_equal(back[0, 0], 0.0)
    device_q, device_scale = quantize(jnp.asarray(w), method, jnp)  # the same on device
    np.testing.assert_array_equal(np.asarray(device_q).astype(np.float32), q.astype(np.float32))
    np.testing.assert_allclose(np.asarray(device_scale), scale, rtol=1e-6)


def test_fused_and_dummy_quantized_models_run():
    float_module, float_config = build("qwen3", None)
    params = random_params(float_module, float_config)
    module, config = build("qwen3", "int8", fused=True)
    fused = params_from_tensors(module, config, hf_tensors(params), "test")
    qkv = fused["model"]["layers_0"]["self_attn"]["qkv_proj"]
    assert qkv["weight"].dtype == jnp.int8 and qkv["weight_scale"].shape == (8 * 32,)
    unfused_module, unfused_config = build("qwen3", "int8")
    unfused = params_from_tensors(unfused_module, unfused_config, hf_tensors(params), "test")
    assert (
        generate(module, config, fused)[0] == generate(unfused_module, unfused_config, unfused)[0]
    )
    dummy = dummy_params(*build("qwen3_moe", "fp8"))
    experts = dummy["model"]["layers_0"]["mlp"]["experts_gate_proj"]
    assert experts.dtype == jnp.float8_e4m3fn and jnp.abs(experts.astype(jnp.float32)).max() > 0
    tokens, _ = generate(*build("qwen3_moe", "fp8"), dummy)
    assert all(len(t) == 3 for t in tokens)
    assert SMALL["vocab_size"] > max(max(t) for t in tokens)
    jax.block_until_ready(dummy)
