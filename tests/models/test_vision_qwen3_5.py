"""Qwen3.5 images: the vision tower and M-RoPE against transformers, and the engine.

A tiny random ``Qwen3_5ForConditionalGeneration`` (float32): a 2-block tower of
8-pixel patches (2 x 2 merged into a token, a 4 x 4 learned position table resampled
to each grid) whose every weight is redrawn (LayerNorm scales near one), and a hybrid
decoder of a Gated DeltaNet layer and a gated full-attention layer whose rotary
frequencies are split over the (t, h, w) rows interleaved. Two images of different
sizes from transformers' own image processor: our tower must equal transformers'
``get_image_features`` (1e-4) in one padded call and each image alone. The prompt's
M-RoPE positions must equal ``get_rope_index`` and their rotation transformers'.
The engine must give transformers' ``generate`` greedy tokens and top-5 logprobs
(1e-4) on prompts with an image, and compile nothing after warm-up; so must it for
``Qwen3_5MoeForConditionalGeneration`` (the same model with every MLP routed experts
plus a gated shared expert) on an image prompt and a text-only one.
"""

from __future__ import annotations

import string
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

from jaxengine.loader.encoder_params import load_module_params
from jaxengine.models import qwen3_5_vl
from jaxengine.models.layers.rope import apply_mrope
from jaxengine.models.vision import qwen2_5_vl_inputs as positions_host
from jaxengine.models.vision import qwen3_5_inputs as host
from jaxengine.models.vision.qwen3_5 import Qwen3_5VisionModel, example_inputs
from jaxengine.multimodal import qwen3_5 as processing
from tests.models.hf_reference import reference_threads

TOL = 1e-4
WORDS = 120
TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
START, END, IMAGE, VIDEO = range(WORDS, WORDS + 4)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              patch_size=8, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75,
            mrope_section=[2, 2, 2], mrope_interleaved=True)  # fmt: skip  # 6 frequencies
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"], max_position_embeddings=256,
            rope_parameters=ROPE, initializer_range=0.2, eos_token_id=0)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip
PROCESSOR = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=256,
                 max_pixels=4096)  # fmt: skip


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


WIDE, SQUARE = _image(40, 72, 0), _image(56, 48, 1)  # grids 4 x 8 and 8 x 6: 8 and 12 tokens


def _save_tokenizer(folder) -> None:
    """Byte-level BPE without merges: ``WORDS`` one-character tokens (``!``, the end of
    text, first; ``Ġ``, a space; letters; digits; ...), then Qwen's vision tokens.
    transformers loads any tokenizer of a Qwen3.5 folder as ``Qwen3_5Tokenizer`` (a
    byte-level BPE over the file's vocabulary and merges), so a word-level vocabulary
    would tokenize every word to nothing: these characters survive it."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    first = list("!Ġ" + string.ascii_lowercase + string.digits)
    chars = first + sorted(set(alphabet) - set(first))
    vocab = {c: i for i, c in enumerate(chars[:WORDS])}
    vocab |= {t: WORDS + i for i, t in enumerate(TOKENS)}
    inner = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = tokenizers.decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="!")
    tokenizer.add_special_tokens({"additional_special_tokens": list(TOKENS)})
    tokenizer.save_pretrained(folder)


def _save_vlm(folder, config, model_cls):
    """(folder, transformers model, processor): a seeded random ``model_cls`` whose
    tower weights are redrawn, saved with its tokenizer and image processor."""
    reference_threads()
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            scale = name.endswith("weight") and p.ndim == 1  # LayerNorm scales
            p.copy_(float(scale) + 0.2 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(folder)
    return folder, model, processing.load_processor(str(folder))


IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
           vision_end_token_id=END)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The dense model (`_save_vlm`)."""
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, **IDS)
    folder = tmp_path_factory.mktemp("qwen3_5_vlm")
    return _save_vlm(folder, config, transformers.Qwen3_5ForConditionalGeneration)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """Qwen3.5-MoE (`_save_vlm`): the same decoder with every MLP 4 experts (top 2)
    plus a gated shared expert, its text config nested in the VL config."""
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | MOE
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **IDS)
    folder = tmp_path_factory.mktemp("qwen3_5_moe_vlm")
    return _save_vlm(folder, config, transformers.Qwen3_5MoeForConditionalGeneration)


@pytest.fixture(scope="module")
def tower(tiny):
    """``(config, params, jitted apply)`` loaded from transformers' state dict."""
    model = tiny[1]
    config = host.Qwen3_5VisionConfig.from_hf(model.config.vision_config)
    module = Qwen3_5VisionModel(config)
    params = load_module_params(
        module, example_inputs(config), model.state_dict().items(), "state dict"
    )
    return config, params, jax.jit(lambda p, x, layout: module.apply({"params": p}, x, layout))


def _run_tower(tower, pixel_values, grid, num_patches: int, pad_fill: float = 0.0) -> list:
    config, params, apply = tower
    rows = np.full((num_patches, config.patch_dim), pad_fill, np.float32)
    rows[: len(pixel_values)] = pixel_values
    layout = host.vision_layout(grid, config, num_patches)
    out = np.asarray(apply(params, jnp.asarray(rows), layout))
    return positions_host.split_tokens(out, grid, config.spatial_merge_size)


def test_tower_matches_transformers(tiny, tower):
    """Both images in one call padded to 96 rows, and each alone padded to 64 (other
    padding values): transformers' merged tokens to 1e-4."""
    _, model, processor = tiny
    out = processor.image_processor([WIDE, SQUARE], return_tensors="np")
    pixel_values, grid = out["pixel_values"].astype(np.float32), out["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 8], [1, 8, 6]]
    with torch.no_grad():
        features = model.model.get_image_features(
            torch.from_numpy(pixel_values), torch.from_numpy(grid)
        )
    reference = [r.numpy() for r in features.pooler_output]
    batch = _run_tower(tower, pixel_values, grid, 96, pad_fill=7.0)
    first = int(np.prod(grid[0]))
    alone = [
        _run_tower(tower, pixel_values[:first], grid[:1], 64)[0],
        _run_tower(tower, pixel_values[first:], grid[1:], 64, pad_fill=-3.0)[0],
    ]
    for ours_batch, ours_alone, ref in zip(batch, alone, reference, strict=True):
        assert ours_batch.shape == ref.shape and np.abs(ref).max() > 0.5
        np.testing.assert_allclose(ours_batch, ref, rtol=0, atol=TOL)
        np.testing.assert_allclose(ours_alone, ref, rtol=0, atol=TOL)


def _prompt_ids(grid) -> np.ndarray:
    counts = positions_host.tokens_per_image(grid, 2)
    image = [[START] + [IMAGE] * int(n) + [END] for n in counts]
    return np.array([5, 6, 7] + image[0] + [8, 9] + image[1] + [10, 11, 12, 13])


def test_mrope_matches_transformers(tiny):
    """Positions of a two-image prompt (``get_rope_index``) and their interleaved
    rotation (``Qwen3_5TextRotaryEmbedding``, ``apply_rotary_pos_emb``)."""
    _, model, processor = tiny
    grid = processor.image_processor([WIDE, SQUARE], return_tensors="np")["image_grid_thw"]
    ids = _prompt_ids(grid)
    ours, delta = positions_host.mrope_positions(ids, grid, IMAGE, 2)
    input_ids = torch.from_numpy(ids)[None]
    ref, ref_delta = model.model.get_rope_index(
        input_ids, (input_ids == IMAGE).int(), image_grid_thw=torch.from_numpy(grid)
    )
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta) < 0
    spec = qwen3_5_vl.from_hf(model.config, jnp.float32).layers[1].rope
    assert spec.mrope_section == (2, 2, 2) and spec.mrope_interleaved
    q = torch.randn(1, 2, len(ids), 16, generator=torch.Generator().manual_seed(2))
    rotary = hf_qwen.Qwen3_5TextRotaryEmbedding(model.config.text_config)
    cos, sin = rotary(q, torch.from_numpy(ours).long()[:, None])
    expected, _ = hf_qwen.apply_rotary_pos_emb(q, q, cos, sin)
    rotated = apply_mrope(jnp.asarray(q[0].transpose(0, 1).numpy()), jnp.asarray(ours), spec)
    np.testing.assert_allclose(rotated, expected[0].transpose(0, 1).numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["tiny", "tiny_moe"])
def test_engine_matches_transformers(variant, request):
    """Dense: three image prompts, and a video refused. MoE: an image prompt and a
    text-only one (its text config nested in the VL config, its experts' names)."""
    from jaxengine import LLM
    from tests.engine.vision_golden import check_top_logprobs, run_images, top_logprobs_reference

    folder, model, processor = request.getfixturevalue(variant)
    engine = dict(max_model_len=64, max_num_seqs=3, max_num_batched_tokens=64, max_logprobs=5,
                  compile_token_buckets=[64], num_gpu_blocks_override=32)  # fmt: skip
    # MoE: the tokenizer loaded, for the text-only prompt (images go through the processor)
    skip = variant == "tiny"
    llm = LLM(str(folder), skip_tokenizer_init=skip, dtype="float32", **engine)
    try:
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        prompts = [
            (f"w7 w8 {image} w9 w10", [WIDE]),
            (f"w7 w8 {image} w9 w10", [SQUARE]),
            (f"w3 {image} w4 {image} w5", [SQUARE, WIDE]),
        ]
        if variant == "tiny_moe":
            prompts = [prompts[0], ("w7 w8 w9 w10", [])]  # the same words, no image
        outputs = run_images(llm, prompts)
        logprobs = check_top_logprobs(outputs, prompts, top_logprobs_reference(model, processor))
        assert np.max(np.abs(np.subtract(logprobs[0], logprobs[1]))) > 1e-3  # the image counts
        assert llm.engine.executor.compiles_after_warmup == 0
        if variant == "tiny":
            with pytest.raises(ValueError, match=r"\['video'\]: only 'image' is supported"):
                video = {"prompt": "w5", "multi_modal_data": {"video": [WIDE]}}
                llm.generate(video, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_host_modules_do_not_import_jax():
    code = (
        "import sys, jaxengine.models.vision.qwen3_5_inputs, jaxengine.multimodal.qwen3_5; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
