"""Qwen2.5-VL's vision tower and M-RoPE against transformers, on a tiny random model.

The transformers model (float32, fixed seed, every weight, bias and norm scale drawn
at random so a misplaced tensor shows) is the reference. Two random images of
different sizes go through transformers' image processor; with ``window_size`` two
merged units, the windows really split, one of them partially. Our tower runs both
images in one call padded to `NUM_PATCHES` rows (one compiled program for every call
here) and must equal transformers' ``get_image_features`` and each image run alone;
so must a larger image of many windows with full attention in several query blocks.
The host-side layout is checked against transformers' window index on more grids
(video-like ``t = 2`` too), and the prompt's M-RoPE positions and their rotation
against ``get_rope_index`` (whole and by chunks, as the engine's steps ask them), the
decode-time positions and ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers import vision_utils
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jaxengine.loader.encoder_params import load_module_params
from jaxengine.loader.errors import CheckpointError
from jaxengine.models.layers.config import RopeSpec
from jaxengine.models.layers.rope import apply_mrope
from jaxengine.models.vision import qwen2_5_vl_inputs as host
from jaxengine.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer, example_inputs
from tests.models.hf_reference import reference_threads

VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=40,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=32,  # two merged units: 2x2-unit windows
    fullatt_block_indexes=[1],
)
TEXT = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=1,
    eos_token_id=2,
)
IMAGE_TOKEN, VISION_START, VISION_END = 120, 121, 122
IMAGE_SIZES = ((40, 72), (56, 48))  # -> grids (1, 4, 8) and (1, 8, 6): 32 + 48 patches
NUM_PATCHES = 96  # padded rows of every tower call


@pytest.fixture(scope="module")
def hf_model():
    reference_threads()
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = name.endswith("weight") and p.ndim == 1  # RMSNorm scales
            p.copy_((1.0 if is_scale else 0.0) + 0.15 * torch.randn_like(p))
    return model


def process(sizes, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values, image_grid_thw)`` of random images from the image processor."""
    processor = Qwen2VLImageProcessorPil(
        patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=256, max_pixels=16384
    )
    rng = np.random.default_rng(seed)
    pics = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = processor(images=pics, return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"]


@pytest.fixture(scope="module")
def images():
    """``(pixel_values [80, 384], image_grid_thw [2, 3])`` from the image processor."""
    return process(IMAGE_SIZES)


@pytest.fixture(scope="module")
def tower(hf_model):
    """``(config, params, jitted apply)`` loaded from transformers' state dict."""
    config = host.Qwen2_5_VisionConfig.from_hf(hf_model.config.vision_config)
    params = _load(config, hf_model.state_dict().items(), "transformers state dict")
    module = Qwen2_5_VisionTransformer(config)
    return config, params, jax.jit(lambda p, x, layout: module.apply({"params": p}, x, layout))


def run_tower(tower, pixel_values, grid, pad_fill=0.0, num_patches=NUM_PATCHES):
    config, params, apply = tower
    rows = np.full((num_patches, config.patch_dim), pad_fill, np.float32)
    rows[: len(pixel_values)] = pixel_values
    layout = host.vision_layout(grid, config, num_patches)
    out = np.asarray(apply(params, jnp.asarray(rows), layout))
    return host.split_tokens(out, grid, config.spatial_merge_size)


def check_against_transformers(hf_model, ours, pixel_values, grid) -> None:
    with torch.no_grad():
        ref = hf_model.model.get_image_features(
            torch.from_numpy(pixel_values), torch.from_numpy(grid)
        ).pooler_output
    assert [o.shape for o in ours] == [tuple(r.shape) for r in ref]
    for o, r in zip(ours, ref, strict=True):
        assert np.abs(r.numpy()).max() > 0.5  # not a vanishing signal
        np.testing.assert_allclose(o, r.numpy(), rtol=0, atol=1e-4)


def test_tower_matches_transformers(hf_model, images, tower):
    pixel_values, grid = images
    assert grid.tolist() == [[1, 4, 8], [1, 8, 6]]
    ours = run_tower(tower, pixel_values, grid)
    assert [o.shape for o in ours] == [(8, 40), (12, 40)]
    check_against_transformers(hf_model, ours, pixel_values, grid)


def test_window_and_query_blocks_match_transformers(hf_model, tower):
    """One image of 5 x 7 tokens: 12 windows (the last row and column of them partial,
    so windows straddle the 16-row blocks of `window_attention`), padded from 140 to
    192 rows, with full attention in query blocks of 32 rows (the last two blocks
    padding only): still transformers' tokens."""
    pixel_values, grid = process([(80, 112)], seed=3)
    assert grid.tolist() == [[1, 10, 14]]
    config, params, _ = tower
    blocked = dataclasses.replace(config, query_block=32)
    assert blocked.window_rows == 16
    module = Qwen2_5_VisionTransformer(blocked)
    apply = jax.jit(lambda p, x, layout: module.apply({"params": p}, x, layout))
    ours = run_tower((blocked, params, apply), pixel_values, grid, pad_fill=5.0, num_patches=192)
    check_against_transformers(hf_model, ours, pixel_values, grid)


def test_each_image_alone_equals_batch(images, tower):
    """Attention stays within each image: an image's tokens do not depend on the other
    image in the call, nor on what the padding rows hold."""
    pixel_values, grid = images
    batch = run_tower(tower, pixel_values, grid, pad_fill=7.0)
    first = len(pixel_values) - int(np.prod(grid[1]))
    alone = [
        run_tower(tower, pixel_values[:first], grid[:1])[0],
        run_tower(tower, pixel_values[first:], grid[1:], pad_fill=-3.0)[0],
    ]
    for b, a in zip(batch, alone, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "grid", [[[1, 4, 8], [1, 8, 6]], [[2, 6, 10]], [[1, 2, 2], [1, 12, 4], [2, 4, 4]]]
)
def test_layout_matches_transformers_window_index(grid):
    config = host.Qwen2_5_VisionConfig(**{**VISION, "fullatt_block_indexes": (1,)})
    layout = host.vision_layout(grid, config)
    thw = torch.tensor(grid)
    window_index, cu_windows = vision_utils.get_vision_window_index(
        thw, config.spatial_merge_size, config.window_size, config.patch_size
    )
    units = layout.patch_order.reshape(-1, config.merge_unit)
    np.testing.assert_array_equal(units[:, 0] // config.merge_unit, window_index.numpy())
    np.testing.assert_array_equal(segment_bounds(layout.window_segments), cu_windows.numpy())
    cu_frames = vision_utils.get_vision_cu_seqlens(thw).numpy()
    np.testing.assert_array_equal(segment_bounds(layout.frame_segments), cu_frames)
    hw = vision_utils.get_vision_position_ids(thw, config.spatial_merge_size).numpy()
    np.testing.assert_array_equal(layout.rope_hw, hw[layout.patch_order])
    np.testing.assert_array_equal(np.argsort(window_index.numpy()), layout.token_order)


def segment_bounds(segments: np.ndarray) -> np.ndarray:
    """Cumulative boundaries of the runs of equal ids (each id one run)."""
    starts = np.flatnonzero(np.diff(segments)) + 1
    assert len(np.unique(segments)) == len(starts) + 1  # contiguous segments
    return np.concatenate([[0], starts, [len(segments)]])


def prompt_ids(grid) -> np.ndarray:
    """Text, an image, text, another image, text (placeholders as the chat template)."""
    counts = host.tokens_per_image(grid, VISION["spatial_merge_size"])
    rng = np.random.default_rng(1)
    text = [rng.integers(1, 100, n).tolist() for n in (5, 3, 4)]
    image = [[VISION_START] + [IMAGE_TOKEN] * int(n) + [VISION_END] for n in counts]
    return np.array(text[0] + image[0] + text[1] + image[1] + text[2])


def test_mrope_positions_match_get_rope_index(hf_model, images):
    _, grid = images
    ids = prompt_ids(grid)
    ours, delta = host.mrope_positions(ids, grid, IMAGE_TOKEN, VISION["spatial_merge_size"])
    input_ids = torch.from_numpy(ids)[None]
    ref, ref_delta = hf_model.model.get_rope_index(
        input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=torch.from_numpy(grid)
    )
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta) and delta < 0  # images take fewer positions than tokens

    class Cache:  # transformers' decode path reads only the cache length
        def get_seq_length(self):
            return len(ids)

    hf_model.model.rope_deltas = ref_delta  # as the prefill forward leaves them
    decode = hf_model.model.compute_3d_position_ids(
        input_ids=None, image_grid_thw=None, video_grid_thw=None,
        inputs_embeds=torch.zeros(1, 2, TEXT["hidden_size"]), attention_mask=None, cache=Cache(),
    )  # fmt: skip  # the next two tokens after the prompt
    np.testing.assert_array_equal(host.mrope_continuation(len(ids), 2, delta), decode[:, 0])
    firsts = np.flatnonzero(np.diff(ids == IMAGE_TOKEN, prepend=0) == 1).tolist()
    images = list(zip(firsts, host.token_grid(grid, VISION["spatial_merge_size"]), strict=True))
    chunks = [host.mrope_chunk(a, b - a, images) for a, b in ((0, 9), (9, 30), (30, len(ids) + 2))]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1)[:, : len(ids)], ours)
    np.testing.assert_array_equal(chunks[-1][:, -2:], decode[:, 0])  # chunks, then decode


def test_mrope_rotation_matches_transformers(hf_model, images):
    _, grid = images
    ids = prompt_ids(grid)
    positions, _ = host.mrope_positions(ids, grid, IMAGE_TOKEN, VISION["spatial_merge_size"])
    text_config = hf_model.config.text_config
    heads, head_dim = 2, TEXT["hidden_size"] // TEXT["num_attention_heads"]
    q = torch.randn(1, heads, len(ids), head_dim, generator=torch.Generator().manual_seed(2))
    rotary = hf_qwen.Qwen2_5_VLRotaryEmbedding(text_config)
    cos, sin = rotary(q, torch.from_numpy(positions).long()[:, None])
    ref, _ = hf_qwen.apply_rotary_pos_emb(q, q, cos, sin)
    section = host.mrope_section(text_config)
    assert section == (2, 3, 3)
    x = jnp.asarray(q[0].transpose(0, 1).numpy())  # [T, H, D]
    ours = apply_mrope(x, jnp.asarray(positions), RopeSpec(theta=10000.0, mrope_section=section))
    np.testing.assert_allclose(ours, ref[0].transpose(0, 1).numpy(), rtol=0, atol=1e-5)


def test_param_names(hf_model, tower):
    """Every tower tensor maps (both prefixes), the decoder's are skipped, and a missing
    tensor is refused by name."""
    path = Qwen2_5_VisionTransformer.hf_param_path
    for name in hf_model.state_dict():
        assert (path(name) is None) == (not name.startswith("model.visual.")), name
    assert path("visual.merger.mlp.2.bias") == (("merger", "mlp_2", "bias"), None)
    assert path("model.visual.blocks.2.attn.qkv.weight")[0] == ("blocks_2", "attn", "qkv", "weight")
    config = tower[0]
    tensors = [(n, t) for n, t in hf_model.state_dict().items() if "blocks.2.norm1" not in n]
    with pytest.raises(CheckpointError, match="blocks_2/norm1/weight"):
        _load(config, tensors, "incomplete")


def test_config_validation():
    base = {**VISION, "fullatt_block_indexes": (1,)}
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        host.Qwen2_5_VisionConfig(**{**base, "fullatt_block_indexes": (3,)})
    with pytest.raises(ValueError, match="window_size"):
        host.Qwen2_5_VisionConfig(**{**base, "window_size": 8})
    with pytest.raises(ValueError, match="multiple of 4"):
        host.Qwen2_5_VisionConfig(**{**base, "num_heads": 4, "hidden_size": 24})


def test_host_module_does_not_import_jax():
    code = (
        "import sys, jaxengine.models.vision.qwen2_5_vl_inputs; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _load(config, tensors, source: str) -> dict:
    module = Qwen2_5_VisionTransformer(config)
    return load_module_params(module, example_inputs(config), tensors, source)
