"""Quantized weights (`layers.quant`: int8, fp8, int4; per row or grouped) on tiny
random configs.

A float checkpoint (random, under its Hugging Face names) is loaded into the quantized
model through `params_from_tensors`, which quantizes each projection with the model's
scheme. The reference is the float model whose weights are those same quantized
values dequantized with numpy: a ragged prefill and greedy decode through the paged
cache must give its tokens, and its logits within 1e-5 relative error (per-row scales
are applied after the dot instead of before). The placed projections take the
scheme's bytes: a quarter of float32 for int8 and fp8, an eighth for int4, plus the
scales (and int4's offsets).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.loader.params import dummy_params, params_from_tensors
from jaxengine.models import get_model
from jaxengine.models.layers.mlp import checkpoint_transposed
from jaxengine.models.layers.quant import (
    METHODS,
    SUFFIXES,
    QuantScheme,
    dequantize,
    quantize,
    transposed,
)
from jaxengine.models.layers.quant import pack_int4 as _pack
from jaxengine.models.layers.quant import unpack_int4 as _unpack
from tests.models.test_fused_projections import generate, hf_tensors, random_params
from tests.models.test_golden_tiny import FAMILIES, SMALL

CASES = ["llama3_rope", "qwen3", "qwen3_moe", "glm4_moe"]  # GLM: quantized shared experts
SCHEMES = {
    "int8": QuantScheme("int8"),
    "fp8": QuantScheme("fp8"),
    "int8-g32": QuantScheme("int8", 32),
    "int4-g32": QuantScheme("int4", 32),
    "int4-g16-act-order": QuantScheme("int4", 16, act_order=True),
}


def _pack_np(values):
    return _pack(values, np)


def _unpack_np(packed):
    return _unpack(packed, np)


def build(family: str, scheme: QuantScheme | str | None, fused: bool = False):
    scheme = QuantScheme(scheme) if isinstance(scheme, str) else scheme
    module, config = get_model(FAMILIES[family](), jnp.float32)
    config = dataclasses.replace(config, quantization=scheme, fused_projections=fused)
    return module.clone(config=config), config


def quantized_groups(tree: dict):
    """``(name, {suffix: leaf})`` of every quantized weight of a parameter tree, as
    ``[..., out, in]`` (the MoE experts' ``[E, in, out]`` leaves swapped back)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from quantized_groups(value)
        elif f"{key}_scale" in tree:
            leaves = {"": value} | {s: tree[key + s] for s in SUFFIXES if key + s in tree}
            yield key, transposed(leaves) if checkpoint_transposed(key, value.ndim) else leaves


def dequantized(tree: dict, scheme: QuantScheme) -> dict:
    """The float tree: each quantized weight dequantized with numpy, in its layout."""
    out = {k: dequantized(v, scheme) for k, v in tree.items() if isinstance(v, dict)}
    for name, leaves in quantized_groups({k: v for k, v in tree.items() if k not in out}):
        w = dequantize(jax.tree.map(np.asarray, leaves), scheme, np)
        out[name] = jnp.asarray(w.swapaxes(-1, -2) if checkpoint_transposed(name, w.ndim) else w)
    sides = {name + s for name in out for s in SUFFIXES}
    return out | {k: v for k, v in tree.items() if k not in out and k not in sides}


def expected_fraction(scheme: QuantScheme, leaves: dict) -> float:
    """Bytes of the stored leaves over the float32 weight's: the weight's bits, one
    float32 scale (and int4's offset) per group or row, one int32 group per column."""
    out, inp = dequantize(leaves, scheme).shape[-2:]
    sides = (2 if scheme.has_offset else 1) / (scheme.group_size or inp)
    weight = (4 if scheme.method == "int4" else 8) / 32
    return weight + sides + (1 / out if scheme.act_order else 0)


@pytest.mark.parametrize(
    ("family", "name"),
    [(f, n) for f in CASES for n in sorted(SCHEMES) if f == CASES[0] or not SCHEMES[n].act_order],
)
def test_logits_match_the_dequantized_reference(family, name):
    scheme = SCHEMES[name]
    float_module, float_config = build(family, None)
    params = random_params(float_module, float_config)
    module, config = build(family, scheme)
    qparams = params_from_tensors(module, config, hf_tensors(params), "test")
    groups = [leaves for _, leaves in quantized_groups(qparams)]
    per_layer = 4 + 3  # q, k, v, o + gate, up, down (dense or experts)
    moe_layers = sum(spec.moe for spec in float_config.layers)
    shared = 3 * moe_layers if float_config.shared_expert_intermediate_size else 0
    assert len(groups) == per_layer * float_config.num_layers + shared
    assert {str(g[""].dtype) for g in groups} == {str(METHODS[scheme.method][0])}
    for leaves in groups:
        stored = sum(leaf.nbytes for leaf in leaves.values())
        float_bytes = 4 * dequantize(leaves, scheme).size
        assert stored / float_bytes == pytest.approx(expected_fraction(scheme, leaves))

    want_tokens, want_logits = generate(float_module, float_config, dequantized(qparams, scheme))
    got_tokens, got_logits = generate(module, config, qparams)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits, strict=True):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_rows_are_close_to_the_weights(method):
    rng = np.random.default_rng(0)
    w = (
        rng.standard_normal((3, 16, 64)).astype(np.float32)
        * np.array([1e-3, 1.0, 50.0])[:, None, None]
    )
    w[0, 0] = 0.0  # an all-zero row keeps a finite scale
    leaves = quantize(w, method, np)
    q, scale = leaves[""], leaves["_scale"]
    assert q.dtype == METHODS[method][0] and scale.shape == (3, 16)
    back = dequantize(leaves, QuantScheme(method), np)
    if method == "int8":  # half a step of the row's scale
        assert np.all(np.abs(back - w) <= 0.5 * scale[..., None] * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits, so within 1/16 of each value (or of the row's step)
        bound = np.maximum(np.abs(w) / 16, scale[..., None] * 2.0**-9)
        assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    np.testing.assert_array_equal(back[0, 0], 0.0)
    device = quantize(jnp.asarray(w), method, jnp)  # the same on device
    np.testing.assert_array_equal(np.asarray(device[""]).astype(np.float32), q.astype(np.float32))
    np.testing.assert_allclose(np.asarray(device["_scale"]), scale, rtol=1e-6)


def test_int4_groups_round_to_half_a_step_and_pack_two_per_byte():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 8, 64)).astype(np.float32)
    w[0, 0, :16] = 0.5  # a constant group keeps a finite scale
    scheme = QuantScheme("int4", 16)
    leaves = quantize(w, scheme, np)
    assert leaves[""].shape == (2, 8, 32) and leaves[""].dtype == np.uint8
    assert leaves["_scale"].shape == leaves["_offset"].shape == (2, 8, 4)
    back = dequantize(leaves, scheme, np)
    step = np.repeat(leaves["_scale"], 16, axis=-1)
    assert np.all(np.abs(back - w) <= 0.5 * step * (1 + 1e-5))
    np.testing.assert_array_equal(back[0, 0, :16], 0.5)
    values = np.arange(16, dtype=np.uint8)
    assert _pack_np(values).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    # act-order: the same values, columns in any group order, give the same weight
    order = rng.permutation(64)
    shuffled = {
        "": _pack_np(_unpack_np(leaves[""])[..., order]),
        "_scale": leaves["_scale"],
        "_offset": leaves["_offset"],
        "_g_idx": (np.arange(64) // 16)[order].astype(np.int32),
    }
    act = dequantize(shuffled, QuantScheme("int4", 16, act_order=True), np)
    np.testing.assert_array_equal(act, back[..., order])


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


def test_kv_cache_scales_leave_the_attention_unchanged():
    """With ``kv_cache_scales`` the cache stores ``k / k_scale`` and ``v / v_scale``
    and attention undoes both: power-of-two scales give the unscaled model's logits
    exactly (on a float cache; an fp8 cache then holds the scaled values)."""
    module, config = build("llama3_rope", None)
    params = random_params(module, config)
    scaled_config = dataclasses.replace(config, kv_cache_scales=True)
    scaled_module = module.clone(config=scaled_config)
    scaled = jax.tree.map(lambda x: x, params)
    for i in range(config.num_layers):
        attention = scaled["model"][f"layers_{i}"]["self_attn"]
        attention["k_scale"], attention["v_scale"] = jnp.float32(0.25), jnp.float32(4.0 * (i + 1))
    want_tokens, want_logits = generate(module, config, params)
    got_tokens, got_logits = generate(scaled_module, scaled_config, scaled)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    dummy = dummy_params(scaled_module, scaled_config)
    assert float(dummy["model"]["layers_0"]["self_attn"]["v_scale"]) == 1.0
