"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) written here from numpy in
each format's documented packing, then loaded through `load_model`.

Every projection gets random integer values, zero points and power-of-two scales,
so the float weight each format describes is exact in float32. The loaded model
must hold exactly those weights (dequantized with numpy), keep them packed (int4:
one byte per two values), and generate the float reference model's tokens with
logits within 1e-5 relative error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import FUSE_ENV, load_model
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.safetensors_io import iter_safetensors
from tests.models.test_fused_projections import generate, hf_tensors, random_params
from tests.models.test_golden_tiny import FAMILIES
from tests.models.test_quantization import build, dequantized, quantized_groups

GROUP = 16


def _words(values: np.ndarray, axis: int, order=range(8)) -> np.ndarray:
    """Packs values 0..15 eight to an int32 word along ``axis``: the ``n``-th value of
    each run of eight in nibble ``order[n]`` (bits ``4 * order[n]``)."""
    v = np.moveaxis(np.asarray(values, np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = np.zeros(v.shape[:-1], np.uint32)
    for n, nibble in enumerate(order):
        word |= v[..., n] << np.uint32(4 * nibble)
    return np.moveaxis(word.view(np.int32), -1, axis)


def _pow2(rng, shape) -> np.ndarray:
    return (2.0 ** rng.integers(-7, -3, shape)).astype(np.float16)


def _gptq(rng, out, inp, act_order=False):
    q = rng.integers(0, 16, (out, inp))
    zeros = rng.integers(1, 16, (inp // GROUP, out))  # stored minus one (format "gptq")
    scales = _pow2(rng, (inp // GROUP, out))
    g_idx = np.arange(inp) // GROUP
    if act_order:
        g_idx = rng.permutation(g_idx)
    parts = {
        "qweight": _words(q.T, axis=0),
        "qzeros": _words(zeros - 1, axis=1),
        "scales": scales,
        "g_idx": g_idx.astype(np.int32),
    }
    return parts, (q - zeros[g_idx].T) * scales[g_idx].T.astype(np.float32)


def _awq(rng, out, inp):
    q = rng.integers(0, 16, (inp, out))
    zeros = rng.integers(0, 16, (inp // GROUP, out))
    scales = _pow2(rng, (inp // GROUP, out))
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: nibble n holds column order[n]
    inverse = [order.index(j) for j in range(8)]
    parts = {
        "qweight": _words(q, axis=1, order=inverse),
        "qzeros": _words(zeros, axis=1, order=inverse),
        "scales": scales,
    }
    g = np.arange(inp) // GROUP
    return parts, ((q - zeros[g]) * scales[g].astype(np.float32)).T


def _ct_int4(rng, out, inp, symmetric=True):
    signed = rng.integers(-8, 8, (out, inp))
    scales = _pow2(rng, (out, inp // GROUP))
    zero = (
        np.zeros((out, inp // GROUP), np.int64) if symmetric else rng.integers(-8, 8, scales.shape)
    )
    parts = {
        "weight_packed": _words(signed + 8, axis=1),
        "weight_scale": scales,
        "weight_shape": np.array([out, inp], np.int64),
    }
    if not symmetric:
        parts["weight_zero_point"] = _words(zero + 8, axis=0)
    g = np.arange(inp) // GROUP
    return parts, (signed - zero[:, g]) * scales[:, g].astype(np.float32)


def _ct_int8(rng, out, inp):
    q = rng.integers(-127, 128, (out, inp)).astype(np.int8)
    scales = _pow2(rng, (out, 1))
    parts = {"weight": q, "weight_scale": scales}
    return parts, q * scales.astype(np.float32)


def _ct_fp8(rng, out, inp):
    q = rng.standard_normal((out, inp)).astype(ml_dtypes.float8_e4m3fn)
    scale = _pow2(rng, (1,)).astype(np.float32)  # strategy "tensor"
    parts = {"weight": q, "weight_scale": scale, "input_scale": np.ones(1, np.float32)}
    return parts, q.astype(np.float32) * scale


def _ct_config(num_bits, kind, strategy, symmetric=True, actorder=None):
    weights = dict(num_bits=num_bits, type=kind, strategy=strategy, symmetric=symmetric)
    weights |= {"group_size": GROUP, "actorder": actorder} if strategy == "group" else {}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    formats = {4: "pack-quantized", 8: "int-quantized" if kind == "int" else "float-quantized"}
    return {
        "quant_method": "compressed-tensors",
        "format": formats[num_bits],
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


FORMATS = {
    "gptq": (_gptq, dict(quant_method="gptq", bits=4, group_size=GROUP, desc_act=False)),
    "gptq-act-order": (
        lambda rng, o, i: _gptq(rng, o, i, act_order=True),
        dict(quant_method="gptq", bits=4, group_size=GROUP, desc_act=True),
    ),
    "awq": (
        _awq,
        dict(quant_method="awq", bits=4, group_size=GROUP, zero_point=True, version="gemm"),
    ),
    "ct-w4a16": (_ct_int4, _ct_config(4, "int", "group")),
    "ct-w4a16-asym": (
        lambda rng, o, i: _ct_int4(rng, o, i, symmetric=False),
        _ct_config(4, "int", "group", symmetric=False),
    ),
    "ct-w8a16": (_ct_int8, _ct_config(8, "int", "channel")),
    "ct-w8a8-fp8": (_ct_fp8, _ct_config(8, "float", "tensor")),
}
CASES = [("llama3_rope", f) for f in FORMATS] + [
    ("qwen3", "awq"),
    ("qwen3_moe", "gptq-act-order"),
    ("qwen3_moe", "ct-w4a16"),
]


def write_checkpoint(folder: Path, hf_config: dict, fmt: str | None, tensors: dict) -> dict:
    """A checkpoint of float ``tensors`` (by name) and ``hf_config`` in ``folder``, each
    projection replaced by random values in format ``fmt`` (None: kept float).
    Returns the float tensors the checkpoint describes."""
    folder.mkdir(exist_ok=True)
    writer, quant_config = FORMATS[fmt] if fmt else (None, None)
    rng = np.random.default_rng(0)
    stored, floats = {}, {}
    for name, array in tensors.items():
        if writer is None or not name.endswith("_proj.weight"):
            stored[name] = floats[name] = array
            continue
        parts, weight = writer(rng, *array.shape)
        prefix = name.removesuffix(".weight")
        stored |= {f"{prefix}.{suffix}": part for suffix, part in parts.items()}
        floats[name] = weight.astype(np.float32)
    save_file({k: _torch(v) for k, v in stored.items()}, folder / "model.safetensors")
    if quant_config:
        hf_config = hf_config | {"quantization_config": quant_config}
    (folder / "config.json").write_text(json.dumps(hf_config))
    return floats


def quantized_copy(source: str, folder: Path, fmt: str) -> str:
    """A copy of checkpoint folder ``source`` (tokenizer included) whose projections
    hold random weights in format ``fmt``."""
    shutil.copytree(source, folder)
    hf_config = json.loads((folder / "config.json").read_text())
    write_checkpoint(folder, hf_config, fmt, dict(iter_safetensors(source)))
    return str(folder)


def _torch(array) -> torch.Tensor:
    array = np.array(array, order="C")  # a writable, contiguous copy
    if np.dtype(array.dtype) == np.dtype(ml_dtypes.float8_e4m3fn):
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(array)


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_checkpoint_loads_to_the_written_weights(tmp_path, monkeypatch, family, fmt):
    monkeypatch.setenv(FUSE_ENV, "0")  # the same tree layout for both models
    module, config = build(family, None)
    tensors = dict(hf_tensors(random_params(module, config)))
    hf_config = FAMILIES[family]().to_dict()
    floats = write_checkpoint(tmp_path / "quantized", hf_config, fmt, tensors)
    write_checkpoint(tmp_path / "float", hf_config, None, floats)
    loaded = load_model(ModelConfig(model=str(tmp_path / "quantized")), LoadConfig())
    reference = load_model(ModelConfig(model=str(tmp_path / "float")), LoadConfig())
    scheme = loaded.config.quantization
    assert scheme is not None and scheme.act_order == fmt.endswith("act-order")

    params = jax.tree.map(np.asarray, loaded.params)
    groups = [leaves for _, leaves in quantized_groups(params)]
    assert len(groups) == 7 * config.num_layers
    if scheme.method == "int4":  # kept packed: a byte per two values
        assert all(g[""].dtype == np.uint8 for g in groups)
    flat_want = jax.tree_util.tree_flatten_with_path(reference.params)[0]
    flat_got = jax.tree_util.tree_leaves(dequantized(params, scheme))
    for (path, want), got in zip(flat_want, flat_got, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))

    want = generate(reference.module, reference.config, reference.params)
    got = generate(loaded.module, loaded.config, loaded.params)
    assert got[0] == want[0]
    for w, g in zip(want[1], got[1], strict=True):
        assert np.abs(g - w).max() / np.abs(w).max() < 1e-5


def test_bad_quantized_checkpoints_are_named(tmp_path):
    module, config = build("llama3_rope", None)
    tensors = dict(hf_tensors(random_params(module, config)))
    folder = tmp_path / "quantized"
    write_checkpoint(folder, FAMILIES["llama3_rope"]().to_dict(), "gptq", tensors)
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* \(awq\)"):
        load_model(ModelConfig(model=str(folder), quantization="awq"), LoadConfig())
    with pytest.raises(ValueError, match="already quantized .* drop --quantization int8"):
        load_model(ModelConfig(model=str(folder), quantization="int8"), LoadConfig())
    hf = FAMILIES["llama3_rope"]().to_dict()
    (folder / "config.json").write_text(
        json.dumps(hf | {"quantization_config": {"quant_method": "hqq"}})
    )
    with pytest.raises(NotImplementedError, match="--quantization hqq is not supported yet"):
        load_model(ModelConfig(model=str(folder)), LoadConfig())
    gptq8 = dict(FORMATS["gptq"][1], bits=8)
    (folder / "config.json").write_text(json.dumps(hf | {"quantization_config": gptq8}))
    with pytest.raises(NotImplementedError, match="GPTQ checkpoints with 8-bit weights"):
        load_model(ModelConfig(model=str(folder)), LoadConfig())
    (folder / "config.json").write_text(json.dumps(hf))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_checkpoint(tmp_path / "missing", hf, "awq", missing)
    (tmp_path / "missing" / "config.json").write_text(
        json.dumps(hf | {"quantization_config": FORMATS["awq"][1]})
    )
    with pytest.raises(CheckpointError, match="up_proj"):
        load_model(ModelConfig(model=str(tmp_path / "missing")), LoadConfig())
    with pytest.raises(CheckpointError, match="--quantization gptq needs a gptq checkpoint"):
        write_checkpoint(tmp_path / "float", hf, None, tensors)
        load_model(ModelConfig(model=str(tmp_path / "float"), quantization="gptq"), LoadConfig())


def test_kv_cache_scales_load_from_the_checkpoint_or_default_to_one(tmp_path):
    """compressed-tensors' KV scales (``self_attn.k_scale``, or the older
    ``k_proj.output_scale``) load for an fp8 cache, 1 where absent, ignored otherwise."""
    module, config = build("llama3_rope", None)
    tensors = dict(hf_tensors(random_params(module, config)))
    tensors["model.layers.0.self_attn.k_scale"] = np.array([0.5], np.float32)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = np.array(3.0, np.float32)
    write_checkpoint(tmp_path / "ct", FAMILIES["llama3_rope"]().to_dict(), "ct-w8a8-fp8", tensors)
    scaled = load_model(ModelConfig(model=str(tmp_path / "ct")), LoadConfig(), kv_cache_scales=True)
    layers = scaled.params["model"]
    assert float(layers["layers_0"]["self_attn"]["k_scale"]) == 0.5
    assert float(layers["layers_1"]["self_attn"]["v_scale"]) == 3.0
    assert float(layers["layers_1"]["self_attn"]["k_scale"]) == 1.0
    plain = load_model(ModelConfig(model=str(tmp_path / "ct")), LoadConfig())
    assert "k_scale" not in plain.params["model"]["layers_0"]["self_attn"]
