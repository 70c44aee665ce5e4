"""The SigLIP image encoders of Idefics3 (SmolVLM) and Gemma 3 against transformers.

Tiny random models (every parameter redrawn at std 0.2, so a dropped ``1 +`` in a
norm or a swapped patch shows), float32. Pixel values come from the models' own
image processors (PIL backend) on random images: Idefics3 tiles of two images of
different tile counts (3 and 5, padded by the processor with an all-zero tile), Gemma
3 two ``image_size`` images. Our features must equal ``get_image_features``'s to
1e-4, each image's alone or in a batch with the other (and with padding tiles). The
parameters come from the checkpoint: Idefics3 from ``save_pretrained``'s safetensors,
Gemma 3 from the state dict under transformers 5's and Google's names.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jaxengine.loader.encoder_params import load_module_params
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.safetensors_io import iter_safetensors
from jaxengine.models.vision import gemma3, idefics3
from tests.models.hf_reference import reference_threads

TOL = 1e-4
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)  # 4 x 4 patches per tile / image
TEXT = dict(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _images(seed: int = 0) -> list[Image.Image]:
    """A wide image (1 x 2 crops + global = 3 tiles) and a square one (2 x 2 + 1 = 5)."""
    rng = np.random.default_rng(seed)
    sizes = ((20, 80), (50, 60))  # (height, width)
    return [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in sizes]


def _max_err(ours, theirs) -> float:
    return float(np.max(np.abs(np.asarray(ours) - theirs.detach().numpy())))


@pytest.fixture(scope="module")
def tiny_idefics3(tmp_path_factory):
    """(transformers model, our config, our params loaded from its safetensors)."""
    reference_threads()
    config = transformers.Idefics3Config(vision_config=VISION, text_config=TEXT, scale_factor=2)
    hf = _randomize(transformers.Idefics3ForConditionalGeneration(config), seed=0)
    folder = tmp_path_factory.mktemp("idefics3")
    hf.save_pretrained(folder)
    ours = idefics3.from_hf(config, jnp.float32)
    module, inputs = idefics3.Idefics3VisionEncoder(ours), idefics3.example_inputs(ours)
    return hf, ours, load_module_params(module, inputs, iter_safetensors(folder), str(folder))


@pytest.fixture(scope="module")
def idefics3_inputs():
    """The processor's padded batch: two prompts of one image each (3 and 5 tiles)."""
    processor = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, return_row_col_info=True
    )
    out = processor([[image] for image in _images()], return_tensors="np")
    tiles = [r[0] * c[0] + 1 for r, c in zip(out["rows"], out["cols"], strict=True)]
    assert tiles == [3, 5] and out["pixel_values"].shape == (2, 5, 3, 32, 32)
    return out["pixel_values"], out["pixel_attention_mask"], tiles


def test_idefics3_tiles_match_transformers(tiny_idefics3, idefics3_inputs):
    hf, config, params = tiny_idefics3
    pixels, pixel_mask, tiles = idefics3_inputs
    assert config.tokens_per_tile == 4
    with torch.no_grad():
        theirs = hf.model.get_image_features(
            torch.from_numpy(pixels), torch.from_numpy(pixel_mask)
        ).pooler_output  # per prompt: [tiles * 4, 24]
    alone = []
    for i, n in enumerate(tiles):
        ours = idefics3.image_features(config, params, pixels[i, :n], pixel_mask[i, :n])
        assert ours.shape == theirs[i].shape == (n * config.tokens_per_tile, TEXT["hidden_size"])
        assert _max_err(ours, theirs[i]) < TOL
        alone.append(np.asarray(ours))
    # both images' tiles in one call, padded to 10 tiles with zero tiles and masks
    real = np.concatenate([pixels[i, :n] for i, n in enumerate(tiles)])
    masks = np.concatenate([pixel_mask[i, :n] for i, n in enumerate(tiles)])
    batch = np.concatenate([real, np.zeros((2, *real.shape[1:]), real.dtype)])
    batch_masks = np.concatenate([masks, np.zeros((2, *masks.shape[1:]), masks.dtype)])
    out = np.asarray(idefics3.encode_tiles(config, params, batch, batch_masks))
    assert np.all(np.isfinite(out))
    split = np.split(out[: sum(tiles)], np.cumsum(tiles)[:-1])
    for ours, single in zip(split, alone, strict=True):
        np.testing.assert_allclose(ours.reshape(single.shape), single, rtol=0, atol=1e-5)


def test_idefics3_padded_tile_matches_transformers(tiny_idefics3, idefics3_inputs):
    """A tile whose lower-right part is padding (the pixel mask keeps 3 x 2 of its 4 x 4
    patches, one of them only partly): bucketed positions and masked keys as HF's."""
    hf, config, params = tiny_idefics3
    pixels = idefics3_inputs[0][1, :1].copy()
    mask = np.zeros((1, 32, 32), np.int64)
    mask[:, :20, :13] = 1
    pixels[:, :, 20:, :] = 0.0
    pixels[:, :, :, 13:] = 0.0
    with torch.no_grad():
        theirs = hf.model.get_image_features(
            torch.from_numpy(pixels[None]), torch.from_numpy(mask[None])
        ).pooler_output[0]
    ours = idefics3.image_features(config, params, pixels, mask)
    assert _max_err(ours, theirs) < TOL


def test_bucketed_position_ids_match_transformers():
    """Every ``nh x nw`` real region of a 7 x 7 patch grid, on a 4 x 4 position table:
    HF's embeddings with a zero patch kernel and table row i = i give the ids."""
    config = transformers.Idefics3VisionConfig(hidden_size=1, image_size=32, patch_size=8)
    embeddings = transformers.models.idefics3.modeling_idefics3.Idefics3VisionEmbeddings(config)
    with torch.no_grad():
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(16.0)[:, None])
    masks = np.zeros((49, 7, 7), bool)
    for i, (nh, nw) in enumerate(np.ndindex(7, 7)):
        masks[i, : nh + 1, : nw + 1] = True
    with torch.no_grad():
        theirs = embeddings(torch.zeros(49, 3, 56, 56), torch.from_numpy(masks))[..., 0]
    ours = idefics3.bucketed_position_ids(jnp.asarray(masks), 4)
    np.testing.assert_array_equal(np.asarray(ours), theirs.numpy().astype(np.int32))


@pytest.fixture(scope="module")
def tiny_gemma3():
    """(transformers model, our config, its state dict)."""
    reference_threads()
    config = transformers.Gemma3Config(
        vision_config=dict(VISION, model_type="siglip_vision_model", vision_use_head=False),
        text_config=dict(TEXT, head_dim=12),
        mm_tokens_per_image=4,
    )
    hf = _randomize(transformers.Gemma3ForConditionalGeneration(config), seed=1)
    return hf, gemma3.from_hf(config, jnp.float32), hf.state_dict()


def _gemma3_params(config, tensors):
    module = gemma3.Gemma3VisionEncoder(config)
    return load_module_params(module, gemma3.example_inputs(config), tensors, "tiny")


def test_gemma3_images_match_transformers(tiny_gemma3):
    hf, config, state = tiny_gemma3
    params = _gemma3_params(config, state.items())
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    pixels = processor(_images(), return_tensors="np")["pixel_values"]  # [2, 3, 32, 32]
    with torch.no_grad():
        theirs = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output
    assert config.pool_size == 2 and theirs.shape == (2, 4, TEXT["hidden_size"])
    for i in range(2):
        ours = gemma3.image_features(config, params, pixels[i : i + 1])
        assert _max_err(ours[0], theirs[i]) < TOL
    batch = np.concatenate([pixels, np.zeros_like(pixels[:1])])  # a padding image
    ours = gemma3.image_features(config, params, batch)
    assert _max_err(ours[:2], theirs) < TOL


def test_gemma3_loads_google_checkpoint_names(tiny_gemma3):
    """Google's names (``vision_tower.vision_model.*``, no ``model.`` prefix) and a
    SigLIP pooling head load to the same tree; the decoder's tensors are skipped."""
    _, config, state = tiny_gemma3
    renamed = {}
    for name, value in state.items():
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = value
    renamed["vision_tower.vision_model.head.probe"] = torch.zeros(1, 1, 32)
    ours, theirs = _gemma3_params(config, renamed.items()), _gemma3_params(config, state.items())
    flat = np.concatenate([np.ravel(x) for x in _values(ours)])
    np.testing.assert_array_equal(flat, np.concatenate([np.ravel(x) for x in _values(theirs)]))


def _values(tree):
    for key in sorted(tree):
        yield from _values(tree[key]) if isinstance(tree[key], dict) else (tree[key],)


def test_checkpoint_errors_name_the_tensor(tiny_gemma3):
    _, config, state = tiny_gemma3
    missing = {k: v for k, v in state.items() if "layers.1.mlp.fc2.bias" not in k}
    with pytest.raises(CheckpointError, match="layers_1/mlp/fc2/bias"):
        _gemma3_params(config, missing.items())
    name = "model.multi_modal_projector.mm_input_projection_weight"
    wrong = {**state, name: torch.zeros(24, 32)}
    with pytest.raises(CheckpointError, match="mm_input_projection_weight"):
        _gemma3_params(config, wrong.items())
