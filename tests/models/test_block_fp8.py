"""Block-FP8 checkpoints (``quant_method: fp8`` with ``weight_block_size``: DeepSeek-V3,
Kimi K2, GLM-4.5-FP8; issue 57), loaded in fp8 and dequantized inside the step.

A tiny random DeepSeek-V3 is quantized here, independently of the engine
(`quantize_blocks`: per block of ``BLOCK`` the largest magnitude mapped to e4m3's 448)
and written as the published checkpoints are: each projection's e4m3 ``weight`` and
float32 ``weight_scale_inv [ceil(out / 16), ceil(in / 24)]``, the experts one tensor
each. ``BLOCK`` is 16 rows by 24 columns (not square, so swapped axes would show): the
tiny widths hold several blocks, with partial ones at the row edge (``q_a_proj``'s 24
rows, ``kv_a_proj_with_mqa``'s 40) and at the column edge (the hidden size 64, the
experts' 32 inputs of ``down_proj``). The engine runs at tensor-parallel size 4,
where the split inputs do not fall on block edges (``o_proj``'s 48 are 12 a device,
the experts' ``down_proj`` 8), as DeepSeek-V3's 128-wide blocks over 576 dense
``down_proj`` inputs a device at TP 32: the model loads in groups of 4 columns
(`loader.quantized.tensor_parallel_group`, each block's scale repeated). Layer 0's
dense MLP is listed in ``ignored_layers`` and stays float.
The same checkpoint dequantized by the test (float32) is the reference, run by
transformers: greedy tokens exact and top-5 logprobs within `family_engine`'s 1e-4
(the engine multiplies the same e4m3 values by the same float32 scales, so its
weights equal the reference's; what remains is float32 rounding, as for any float
checkpoint against transformers).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import DENSE_FLOAT_ENV, FUSE_ENV, dense_float, load_model
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.quantized import regrouped_tensors
from jaxengine.models.layers.quant import (
    QuantScheme,
    dequantize,
    layer_unquantized,
    quantize,
    regroup_scale,
    split_group,
    transposed,
)
from tests.models.deepseek_v3_tiny import deepseek_v3_tiny
from tests.models.family_engine import check_engine, default_prompts, reference, save_tiny
from tests.models.glm4_moe_tiny import randomize_saved_correction_bias
from tests.models.tiny_configs import TINY_SIZES

VOCAB = 256
BLOCK = [16, 24]
"""``weight_block_size``: rows (outputs) by columns (inputs) per scale."""
IGNORED = ["model.layers.0.mlp"]
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": BLOCK,
    "ignored_layers": IGNORED,
}
E4M3_MAX = 448.0


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 values and float32 ``scale_inv [ceil(out / 16), ceil(in / 24)]`` of a float
    ``w [out, in]``: each block's largest magnitude becomes 448."""
    (rows, cols), (out, inp) = BLOCK, w.shape
    padded = np.zeros((-(-out // rows) * rows, -(-inp // cols) * cols), np.float32)
    padded[:out, :inp] = w
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    per_value = np.repeat(np.repeat(scale_inv, rows, 0), cols, 1)[:out, :inp]
    q = np.clip(w / per_value, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    rows, cols = BLOCK
    per_value = np.repeat(np.repeat(scale_inv, rows, 0), cols, 1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * per_value


def save(tensors: dict, file: Path) -> None:
    """numpy (e4m3 too, which safetensors' numpy writer lacks) or torch tensors."""

    def torch_tensor(a):
        if isinstance(a, torch.Tensor):
            return a
        if a.dtype == ml_dtypes.float8_e4m3fn:
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.ascontiguousarray(a))

    save_file({k: torch_tensor(v) for k, v in tensors.items()}, file, metadata={"format": "pt"})


def _quantized(name: str) -> bool:
    projection = name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))
    return projection and not any(name.startswith(m + ".") for m in IGNORED)


def write_pair(src: str, fp8_dir: Path, float_dir: Path) -> None:
    """From the float checkpoint ``src``: ``fp8_dir`` with every projection (the experts
    one tensor each, as the published checkpoints) block-quantized, and ``float_dir``
    with those weights dequantized, in ``src``'s own layout (transformers' fused
    experts ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``)."""
    for folder in (fp8_dir, float_dir):
        shutil.copytree(src, folder)
    quantized, floats = {}, {}

    def add(name: str, w: np.ndarray) -> np.ndarray:
        q, scale_inv = quantize_blocks(w)
        quantized[name], quantized[name + "_scale_inv"] = q, scale_inv
        return dequantize_blocks(q, scale_inv)

    for name, array in load_file(Path(src) / "model.safetensors").items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            prefix, kind = name.rsplit(".", 1)
            back = []
            for e, expert in enumerate(array):
                if kind == "down_proj":
                    back.append(add(f"{prefix}.{e}.down_proj.weight", expert))
                    continue
                gate, up = np.split(expert, 2)
                gate = add(f"{prefix}.{e}.gate_proj.weight", gate)
                back.append(np.concatenate([gate, add(f"{prefix}.{e}.up_proj.weight", up)]))
            floats[name] = np.stack(back)
        elif _quantized(name):
            floats[name] = add(name, array)
        else:
            quantized[name] = floats[name] = array
    save(quantized, fp8_dir / "model.safetensors")
    save(floats, float_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(block-fp8 folder, its dequantized float twin) of a tiny DeepSeek-V3: MLA with
    the q low-rank path, 2 dense then 2 MoE layers of 8 experts and a shared one."""
    root = tmp_path_factory.mktemp("block_fp8")
    tiny = dict(TINY_SIZES, vocab_size=VOCAB, num_hidden_layers=2)
    src = save_tiny(transformers.DeepseekV3Config(**deepseek_v3_tiny(tiny)), root / "src")
    randomize_saved_correction_bias(src)
    write_pair(src, root / "fp8", root / "float")
    return root / "fp8", root / "float"


def _load(path: Path):
    return load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig())


def _leaves(tree: dict, path: tuple = ()):
    """``(path, leaf)`` of every leaf of a parameter tree."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def test_fp8_weights_are_the_dequantized_checkpoint(checkpoints, monkeypatch):
    """Every projection stays e4m3 with its block scales (``[out, ceil(in / 24)]``),
    but for the ignored dense MLP and ``kv_b_proj`` (dequantized at load, `layers.mla`);
    dequantized, each weight is the float twin's exactly."""
    fp8_dir, float_dir = checkpoints
    loaded = _load(fp8_dir)
    assert str(loaded.config.quantization) == "fp8, group 24"
    layers = loaded.params["model"]
    attn = layers["layers_1"]["self_attn"]
    groups = {"q_a_proj": (24, 3), "q_b_proj": (96, 1), "kv_a_proj_with_mqa": (40, 3),
              "o_proj": (64, 2)}  # fmt: skip
    for name, scale_shape in groups.items():  # [out, ceil(in / 24)]
        assert attn[name]["weight"].dtype == jnp.float8_e4m3fn, name
        assert attn[name]["weight_scale"].shape == scale_shape, name
    assert attn["kv_b_proj"]["weight"].dtype == jnp.float32
    assert layers["layers_0"]["mlp"]["gate_proj"]["weight"].dtype == jnp.float32  # ignored
    assert layers["layers_1"]["mlp"]["gate_proj"]["weight"].dtype == jnp.float8_e4m3fn
    moe = layers["layers_2"]["mlp"]
    assert moe["experts_down_proj"].dtype == jnp.float8_e4m3fn
    assert moe["experts_down_proj_scale"].shape == (8, 2, 64)  # [E, ceil(32 / 24), out]
    assert moe["shared_experts"]["down_proj"]["weight"].dtype == jnp.float8_e4m3fn

    with monkeypatch.context() as env:  # the twin unfused, as the fp8 model (ignored_layers)
        env.setenv(FUSE_ENV, "0")
        twin = dict(_leaves(_load(float_dir).params))
    scheme, ours = loaded.config.quantization, dict(_leaves(loaded.params))
    assert {p for p in ours if not p[-1].endswith("_scale")} == set(twin)
    for path, stored in ours.items():
        if stored.dtype == jnp.float8_e4m3fn:  # [out, in], or the experts' [E, in, out]
            scale = (*path[:-1], "weight_scale" if path[-1] == "weight" else path[-1] + "_scale")
            leaves = jax.tree.map(np.asarray, {"": stored, "_scale": ours[scale]})
            stored = dequantize(leaves, scheme, np, transpose=stored.ndim == 3)
        if not path[-1].endswith("_scale"):
            np.testing.assert_array_equal(np.asarray(stored), np.asarray(twin[path]), str(path))


@pytest.fixture(scope="module")
def twin_reference(checkpoints):
    """transformers' float32 greedy run of the dequantized twin (`family_engine`)."""
    prompts = default_prompts(VOCAB)
    return prompts, reference(checkpoints[1], prompts, 8)


@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 4}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}],
    ids=["tp4", "ep2"],
)
def test_engine_matches_transformers_on_the_dequantized_twin(checkpoints, twin_reference, layout):
    """The fp8 checkpoint through `jaxengine.LLM` (chunked prefill, preemption,
    prefix-cache hits, no compilation after warm-up) on 4 virtual devices (blocks cut
    by the split: regrouped at load), and on 2 with the experts split by expert: greedy
    tokens and top-5 logprobs are transformers' on the dequantized twin."""
    prompts, ref = twin_reference
    check_engine(checkpoints[0], ref, prompts, **layout)


def test_dense_projections_in_float_the_experts_in_fp8(checkpoints, twin_reference, monkeypatch):
    """`loader.dense_float` (TPU's default for a block-scaled MoE checkpoint, forced
    here): every projection but the routed experts is the twin's float weight exactly,
    the experts stay e4m3 with their block scales; through the engine at TP 4 the
    tokens and logprobs are still transformers' on the twin. Off on CPU and GPU, for a
    dense model, and for per-row scales."""
    fp8_dir, float_dir = checkpoints
    monkeypatch.setenv(DENSE_FLOAT_ENV, "1")
    loaded = _load(fp8_dir)
    assert str(loaded.config.quantization) == "fp8, group 24, experts only"
    with monkeypatch.context() as env:
        env.setenv(FUSE_ENV, "0")
        twin = dict(_leaves(_load(float_dir).params))
    ours = dict(_leaves(loaded.params))
    experts = {p for p, leaf in ours.items() if leaf.dtype == jnp.float8_e4m3fn}
    assert experts and all(p[-1].startswith("experts_") for p in experts)
    for path in set(twin) - experts:
        np.testing.assert_array_equal(np.asarray(ours[path]), np.asarray(twin[path]), str(path))
    prompts, ref = twin_reference
    check_engine(fp8_dir, ref, prompts, tensor_parallel_size=4)
    monkeypatch.delenv(DENSE_FLOAT_ENV)
    scheme, config = loaded.config.quantization, transformers.AutoConfig.from_pretrained(fp8_dir)
    block = dataclasses.replace(scheme, dense_float=False)
    assert dense_float(block, config, "tpu").dense_float
    assert not dense_float(block, config, "gpu").dense_float
    assert not dense_float(block, transformers.LlamaConfig(), "tpu").dense_float
    assert not dense_float(QuantScheme("fp8"), config, "tpu").dense_float


def test_partial_groups_and_layer_names():
    """int8/fp8 groups may end in a partial one (40 inputs in groups of 32), quantized
    and dequantized alike on host and device, in either layout; a checkpoint's
    unquantized list as each decoder layer sees it."""
    w = np.random.default_rng(0).standard_normal((3, 5, 40)).astype(np.float32)
    scheme = QuantScheme("fp8", 32)
    leaves = quantize(w, scheme, np)
    assert leaves[""].shape == (3, 5, 40) and leaves["_scale"].shape == (3, 5, 2)
    back = dequantize(leaves, scheme, np)
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) / 16, 2.0**-9) * (1 + 1e-6))
    device = dequantize(jax.tree.map(jnp.asarray, leaves), scheme)
    np.testing.assert_array_equal(np.asarray(device), back)
    swapped = dequantize(transposed(leaves), scheme, np, transpose=True)
    np.testing.assert_array_equal(swapped, back.swapaxes(-1, -2))

    entries = ("model.layers.1.mlp", "model.layers.*.mlp.gate", "lm_head", "model.layers.2")
    assert layer_unquantized(entries, 1) == ("mlp", "mlp.gate", "lm_head")
    assert layer_unquantized(entries, 2) == ("mlp.gate", "lm_head", "")
    layer1 = QuantScheme("fp8", 32, unquantized=layer_unquantized(entries, 1))
    assert not layer1.quantizes("mlp.experts") and layer1.quantizes("self_attn.o_proj")
    layer0 = QuantScheme("fp8", 32, unquantized=layer_unquantized(entries, 0))
    assert layer0.quantizes("mlp.gate_proj") and not layer0.quantizes("mlp.gate")
    layer2 = QuantScheme("fp8", 32, unquantized=layer_unquantized(entries, 2))
    assert not layer2.quantizes("self_attn.q_a_proj")


def test_regrouping_for_a_tensor_parallel_split():
    """Groups cut by a device boundary become the largest that divides the group and
    each device's share (DeepSeek-V3 at TP 32: 576 and 64 columns a device -> 64),
    each scale repeated: the dequantized weight is the same, in either layout, partial
    last group too. An uneven split, or a size that does not divide the group, is
    refused naming the sizes; in a checkpoint's tensors a scale waits for its weight
    and a per-row one is left alone."""
    assert split_group(128, 18432, 32) == split_group(128, 2048, 32) == 64
    assert split_group(128, 16384, 32) == 128 and split_group(24, 40, 1) == 24
    with pytest.raises(ValueError, match="50 input columns do not split evenly over 4"):
        split_group(24, 50, 4)
    w = np.random.default_rng(1).standard_normal((3, 5, 40)).astype(np.float32)
    leaves = quantize(w, QuantScheme("fp8", 16), np)  # groups 16, 16 and 8
    assert leaves["_scale"].shape == (3, 5, 3)
    scale = regroup_scale(leaves["_scale"], 40, 16, 8)
    assert scale.shape == (3, 5, 5)
    np.testing.assert_array_equal(scale, leaves["_scale"][..., [0, 0, 1, 1, 2]])
    before = dequantize(leaves, QuantScheme("fp8", 16), np)
    after = dequantize({**leaves, "_scale": scale}, QuantScheme("fp8", 8), np)
    np.testing.assert_array_equal(after, before)
    swapped = transposed(leaves)  # the experts' [E, in, out]
    regrouped = regroup_scale(swapped["_scale"], 40, 16, 8, axis=-2)
    back = dequantize({**swapped, "_scale": regrouped}, QuantScheme("fp8", 8), np, True)
    np.testing.assert_array_equal(back, before.swapaxes(-1, -2))
    with pytest.raises(ValueError, match="groups of 16 do not split into groups of 6"):
        regroup_scale(leaves["_scale"], 40, 16, 6)
    with pytest.raises(ValueError, match="3 scales do not cover 64 inputs in groups of 16"):
        regroup_scale(leaves["_scale"], 64, 16, 8)

    q, row = leaves[""][0], np.ones(5, np.float32)
    tensors = [("a.weight_scale", leaves["_scale"][0]), ("a.weight", q),
               ("b.weight", q), ("b.weight_scale", row)]  # fmt: skip
    out = dict(regrouped_tensors(tensors, 16, 8))
    np.testing.assert_array_equal(out["a.weight_scale"], scale[0])
    assert out["b.weight_scale"] is row and out["a.weight"] is q


def _bad_copy(fp8_dir: Path, tmp_path: Path, change=None, config=None) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    if change is not None:
        tensors = load_torch(bad / "model.safetensors")
        change(tensors)
        save(tensors, bad / "model.safetensors")
    if config is not None:
        hf = json.loads((bad / "config.json").read_text())
        hf["quantization_config"] = {**FP8_CONFIG, **config}
        (bad / "config.json").write_text(json.dumps(hf))
    return bad


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


def test_a_corrupt_or_missing_scale_is_named(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints

    def cut(tensors):  # [4, 2] -> [4, 1]: o_proj's 48 inputs need two blocks of 24
        tensors[SCALE] = tensors[SCALE][:, :1].contiguous()

    with pytest.raises(CheckpointError, match=r"o_proj: .*weight_scale_inv has shape \(4, 1\)"):
        _load(_bad_copy(fp8_dir, tmp_path, cut))
    shutil.rmtree(tmp_path / "bad")
    with pytest.raises(CheckpointError, match=f"{SCALE} missing"):
        _load(_bad_copy(fp8_dir, tmp_path, lambda tensors: tensors.pop(SCALE)))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "no quantization_config.weight_block_size"),
    ],
)
def test_unsupported_settings_are_named(checkpoints, tmp_path, config, message):
    fp8_dir, _ = checkpoints
    with pytest.raises(NotImplementedError, match=message):
        _load(_bad_copy(fp8_dir, tmp_path, config=config))


def test_quantization_flag(checkpoints):
    """``--quantization fp8`` names this checkpoint's own method (and, on a float one,
    online fp8); another method is refused."""
    fp8_dir, _ = checkpoints
    flagged = ModelConfig(model=str(fp8_dir), dtype="float32", quantization="fp8")
    assert str(load_model(flagged, LoadConfig()).config.quantization) == "fp8, group 24"
    with pytest.raises(ValueError, match=r"model config \(fp8\) does not match .* \(gptq\)"):
        load_model(ModelConfig(model=str(fp8_dir), quantization="gptq"), LoadConfig())
