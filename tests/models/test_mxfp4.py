"""MXFP4 gpt-oss checkpoints (issue 56): loaded 4-bit, dequantized inside the step.

transformers writes MXFP4 only through triton's kernels (none on CPU), so the test
writes the format by hand from transformers' ``integrations/mxfp4.py``: per expert
weight ``<w>_blocks`` uint8 ``[E, out, in / 32, 16]`` (two e2m1 codes per byte, the
even column in the low nibble) and ``<w>_scales`` uint8 ``[E, out, in / 32]`` (e8m0),
``gate_up_proj`` with gate at even rows. `reference_dequantize` reads it independently
of the engine (each code's value from its sign, exponent and mantissa bits, float64
powers of two). The same model with its experts dequantized that way, saved as a float
checkpoint, is what the MXFP4 one must reproduce: greedy tokens and logits through the
engine's step on one device, and through `jaxengine.LLM` with expert parallelism
against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.loader import load_model
from jaxengine.loader.errors import CheckpointError
from jaxengine.models.layers.quant import dequantize_mxfp4, quantize_mxfp4
from jaxengine.runner.greedy_loop import GreedyLoop
from sharding.placement import Placement
from tests.models.family_engine import check_engine, default_prompts, reference, save_tiny
from tests.models.gpt_oss_tiny import gpt_oss_tiny, randomize_saved

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
EXPERTS = ("gate_up_proj", "down_proj")
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}  # fmt: skip


def e2m1_value(code: np.ndarray) -> np.ndarray:
    """float64 value of 4-bit e2m1 codes: sign bit 3, exponent bits 1-2 (bias 1),
    mantissa bit 0; exponent 0 is subnormal (``m * 0.5``)."""
    sign = np.where(code & 8, -1.0, 1.0)
    exp, man = (code >> 1) & 3, code & 1
    magnitude = np.where(exp == 0, man * 0.5, 2.0 ** (exp.astype(np.float64) - 1) * (1 + man / 2))
    return sign * magnitude


def reference_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 ``[..., out, G * 32]`` of blocks ``[..., out, G, 16]`` and scales
    ``[..., out, G]``: byte ``k`` of a block holds columns ``2k`` (low nibble) and
    ``2k + 1`` (high nibble), every value times ``2^(scale - 127)``."""
    values = np.empty((*blocks.shape[:-1], 32), np.float64)
    values[..., 0::2] = e2m1_value(blocks & 15)
    values[..., 1::2] = e2m1_value(blocks >> 4)
    values *= 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def test_dequantize_matches_the_reference_on_every_code_and_extreme_scales():
    rng = np.random.default_rng(0)
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)  # each code, both nibbles
    blocks = np.concatenate([every_byte, rng.integers(0, 256, (32, 16), dtype=np.uint8)])
    scales = np.array([0, 1, 2, 100, 126, 127, 128, 200, 253, 254], np.uint8)
    scales = np.concatenate([scales, rng.integers(0, 255, 48 - len(scales))]).astype(np.uint8)
    blocks, scales = blocks.reshape(2, 24, 1, 16), scales.reshape(2, 24, 1)  # [E, out, G, 16]
    exact = reference_dequantize(blocks, scales)  # float64
    # float32 subnormals (exponent bytes 0 and 1, small codes) may be flushed to zero:
    # XLA does, and so does numpy under tests/conftest.py's flush-denormal mode
    subnormal = (exact != 0) & (np.abs(exact) < np.finfo(np.float32).tiny)
    with np.errstate(over="ignore"):
        want = exact.astype(np.float32)  # 6 * 2^127 and 6 * 2^126: inf, as ldexp gives
    assert subnormal.any() and np.isinf(want).any()
    packed = blocks.reshape(2, 24, 16)  # the engine's leaf: [E, out, in / 2]
    with np.errstate(over="ignore"):
        host = dequantize_mxfp4(packed, scales, np)
    device = np.asarray(jax.jit(dequantize_mxfp4)(jnp.asarray(packed), jnp.asarray(scales)))
    for got in (host, device):
        np.testing.assert_array_equal(got[~subnormal], want[~subnormal])
        flushed = got[subnormal]
        assert np.all((flushed == 0) | (flushed.astype(np.float64) == exact[subnormal]))
        assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 codes too


def test_quantize_rounds_to_the_nearest_mxfp4_value():
    """`quantize_mxfp4` (float experts loaded into an MXFP4 model, weight updates):
    MXFP4 values come back exactly; other values within half of the widest e2m1 gap
    (2, between 4 and 6) times their block's scale, the same in numpy and jax."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (4, 6, 3, 16), dtype=np.uint8)
    exact = reference_dequantize(blocks, rng.integers(110, 140, (4, 6, 3), dtype=np.uint8))
    again = quantize_mxfp4(exact, np)
    np.testing.assert_array_equal(dequantize_mxfp4(again[""], again["_scale"], np), exact)
    weight = rng.standard_normal((4, 6, 96)).astype(np.float32)
    leaves = quantize_mxfp4(weight, np)
    on_device = quantize_mxfp4(jnp.asarray(weight), jnp)
    for suffix in ("", "_scale"):
        np.testing.assert_array_equal(np.asarray(on_device[suffix]), leaves[suffix])
    error = np.abs(dequantize_mxfp4(leaves[""], leaves["_scale"], np) - weight)
    step = 2.0 ** (leaves["_scale"].astype(np.float64) - 127)  # [4, 6, 3]
    assert np.all(error.reshape(4, 6, 3, 32) <= step[..., None])


def _mxfp4_expert(rng, experts: int, rows: int, cols: int):
    """Random MXFP4 ``blocks [E, rows, cols / 32, 16]`` and ``scales`` (2^-6 .. 2^-3)."""
    blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 6, 127 - 2, (experts, rows, cols // 32), dtype=np.uint8)
    return blocks, scales


def write_pair(src: str, mxfp4_dir: Path, float_dir: Path) -> dict:
    """From the float checkpoint ``src``: ``mxfp4_dir`` with random MXFP4 experts and
    ``float_dir`` with those experts dequantized by `reference_dequantize` (float32, in
    transformers' ``[E, in, out]`` layout); the rest copied. Returns the MXFP4 tensors."""
    for folder in (mxfp4_dir, float_dir):
        shutil.copytree(src, folder)
    tensors = load_file(Path(src) / "model.safetensors")
    rng = np.random.default_rng(1)
    quantized, floats = {}, {}
    for name, array in tensors.items():
        if not name.endswith(EXPERTS):
            quantized[name] = floats[name] = array
            continue
        e, inp, out = array.shape  # transformers' float layout [E, in, out]
        blocks, scales = _mxfp4_expert(rng, e, out, inp)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        weight = reference_dequantize(blocks, scales).astype(np.float32)  # [E, out, in]
        floats[name] = np.ascontiguousarray(weight.transpose(0, 2, 1))
    save_file(quantized, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, float_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    return quantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 folder, its float twin, the MXFP4 tensors) of a tiny gpt-oss: 3 layers,
    8 experts (top 4) of width 32, random sinks and biases."""
    root = tmp_path_factory.mktemp("mxfp4")
    config = transformers.GptOssConfig(**gpt_oss_tiny(TINY, sliding_window=16, swiglu_limit=1.0))
    src = save_tiny(config, root / "src")
    randomize_saved(src)
    tensors = write_pair(src, root / "mxfp4", root / "float")
    return root / "mxfp4", root / "float", tensors


def _load(path, placement=None):
    return load_model(ModelConfig(model=str(path), dtype="float32"), LoadConfig(), placement)


def test_experts_stay_4bit_and_match_the_dequantized_model(checkpoints):
    mxfp4_dir, float_dir, tensors = checkpoints
    loaded, ref = _load(mxfp4_dir), _load(float_dir)
    assert str(loaded.config.quantization) == "mxfp4, group 32"
    stored = bf16 = 0
    for i in range(3):
        moe = loaded.params["model"][f"layers_{i}"]["mlp"]
        for proj, (out, inp) in {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}.items():
            weight, scale = moe[f"experts_{proj}_proj"], moe[f"experts_{proj}_proj_scale"]
            # stored [E, in, out] (the grouped matmul's layout), bytes still along the input
            assert weight.dtype == jnp.uint8 and weight.shape == (8, inp // 2, out)
            assert scale.dtype == jnp.uint8 and scale.shape == (8, inp // 32, out)
            stored += weight.nbytes + scale.nbytes
            bf16 += 8 * out * inp * 2
        attn = loaded.params["model"][f"layers_{i}"]["self_attn"]
        assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(attn)} == {np.dtype("float32")}
    assert stored / bf16 == pytest.approx(1 / 4 + 1 / 64)  # a byte of exponent per 32 values
    # the bytes as the checkpoint holds them: gate at its even rows, up at its odd ones
    blocks = tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"]  # [E, 2I, G, 16]
    moe = loaded.params["model"]["layers_1"]["mlp"]
    want = blocks[:, 1::2].reshape(8, 32, 32).transpose(0, 2, 1)  # [E, in / 2, out]
    np.testing.assert_array_equal(moe["experts_up_proj"], want)

    prompts = [list(p[:n]) for p, n in zip(default_prompts(256), (11, 9, 22, 5), strict=True)]
    outs = []
    for model in (loaded, ref):
        loop = GreedyLoop(model.module, model.config, model.params, page_size=4)
        outs.append(loop.generate(prompts, 6, return_logits=True))
    (tokens, logits), (ref_tokens, ref_logits) = outs
    assert tokens == ref_tokens
    for step, (got, want) in enumerate(zip(logits, ref_logits, strict=True)):
        for r in range(len(prompts)):
            rel = np.abs(got[r] - want[r]).max() / np.abs(want[r]).max()
            assert rel < 1e-5, f"step {step}, request {r}: relative error {rel:.2e}"


def test_expert_parallel_splits_the_packed_experts(checkpoints):
    mxfp4_dir, _, _ = checkpoints
    placement = Placement(
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), jax.devices()[:2]
    )
    moe = _load(mxfp4_dir, placement).params["model"]["layers_0"]["mlp"]
    shards = {"experts_gate_proj": (4, 32, 32), "experts_gate_proj_scale": (4, 2, 32),
              "experts_down_proj": (4, 16, 64), "experts_down_proj_scale": (4, 1, 64)}  # fmt: skip
    for name, shard in shards.items():
        assert moe[name].sharding.spec == P("tensor", None, None), name
        assert {s.data.shape for s in moe[name].addressable_shards} == {shard}, name
    # tensor parallelism alone would split down_proj's one block of 32 inputs: refused
    placement = Placement(ParallelConfig(tensor_parallel_size=2), jax.devices()[:2])
    with pytest.raises(ValueError, match="experts_down_proj_scale .mlp axis of size 1"):
        _load(mxfp4_dir, placement)


def test_engine_with_expert_parallelism_matches_transformers(checkpoints):
    """The MXFP4 checkpoint through `jaxengine.LLM` with EP 2 on the virtual CPU
    devices (chunked prefill, preemption, a prefix-cache hit) against transformers'
    float32 run of the dequantized twin: greedy tokens exact, top-5 logprobs close."""
    mxfp4_dir, float_dir, _ = checkpoints
    prompts = default_prompts(256)
    ref = reference(float_dir, prompts, 8)
    check_engine(mxfp4_dir, ref, prompts, tensor_parallel_size=2, enable_expert_parallel=True)


def test_quantization_flag_and_dummy_weights(checkpoints):
    """``--quantization mxfp4`` takes an MXFP4 checkpoint and refuses a float one;
    dummy weights get e8m0 exponents of 2^-7 (random bytes would reach 2^128)."""
    mxfp4_dir, float_dir, _ = checkpoints
    flagged = ModelConfig(model=str(mxfp4_dir), dtype="float32", quantization="mxfp4")
    assert str(load_model(flagged, LoadConfig()).config.quantization) == "mxfp4, group 32"
    with pytest.raises(CheckpointError, match="needs a mxfp4 checkpoint"):
        load_model(ModelConfig(model=str(float_dir), quantization="mxfp4"), LoadConfig())
    dummy = load_model(ModelConfig(model=str(mxfp4_dir)), LoadConfig(load_format="dummy"))
    moe = dummy.params["model"]["layers_0"]["mlp"]
    assert np.all(np.asarray(moe["experts_down_proj_scale"]) == 127 - 7)
    stored = (moe[f"experts_down_proj{s}"] for s in ("", "_scale"))  # [E, in, out]
    weight = dequantize_mxfp4(*(leaf.swapaxes(1, 2) for leaf in stored))
    assert 0.01 < float(jnp.std(weight)) < 0.05


def _rewrite(path: Path, change) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_scales_are_named(checkpoints, tmp_path):
    mxfp4_dir, _, _ = checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_dir, bad)
    name = "model.layers.2.mlp.experts.down_proj_scales"
    _rewrite(bad, lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=f"'{name}' missing"):
        _load(bad)


@pytest.mark.parametrize("tensor", ["blocks", "scales"])
def test_wrong_block_size_is_named(checkpoints, tmp_path, tensor):
    """Blocks of 64 values (32 bytes), or scales of another shape than the blocks'."""
    mxfp4_dir, _, _ = checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_dir, bad)
    name = f"model.layers.0.mlp.experts.gate_up_proj_{tensor}"

    def change(tensors):
        array = tensors[name]  # blocks [8, 64, 2, 16] or scales [8, 64, 2]
        if tensor == "blocks":
            tensors[name] = np.ascontiguousarray(array.reshape(8, 64, 1, 32))
        else:
            tensors[name] = np.ascontiguousarray(array[..., :1])

    _rewrite(bad, change)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is uint8"):
        _load(bad)
