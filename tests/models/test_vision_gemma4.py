"""Gemma 4 images: the vision tower against transformers, and the engine end to end.

A tiny random ``Gemma4ForConditionalGeneration`` (`gemma4_tiny`'s decoder with
``use_bidirectional_attention="vision"``, a 2-layer vision tower of 4-pixel patches
pooled 2 x 2, clipped linears with finite bounds, standardization; every tower weight
redrawn), float32. Images of two aspect ratios give 64 and 63 soft tokens through
transformers' own image processor. The tower's pooled states and the projected
embeddings must equal transformers' to 1e-4, each image alone and both in one padded
batch. The engine must give transformers' ``generate`` greedy tokens and top-5
logprobs (1e-4) on prompts with an image (its tokens attend both ways in the sliding
layers: the mask transformers builds from ``mm_token_type_ids``), compile nothing
after warm-up, and refuse audio by name.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from PIL import Image

from jaxengine.loader.encoder_params import load_module_params
from jaxengine.models.vision import gemma4 as vision
from jaxengine.multimodal import gemma4 as host
from tests.models.gemma4_tiny import gemma4_tiny, randomize_scales
from tests.models.hf_reference import reference_threads
from tests.models.tiny_configs import TINY_SIZES

TOL = 1e-4
VOCAB = 256
SPECIAL = dict(video_token=249, image_token=250, audio_token=251, boi_token=252)
SPECIAL.update(eoi_token=253, boa_token=254, eoa_token=255)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=32, use_clipped_linears=True, standardize=True)  # fmt: skip
IMAGE_PROCESSOR = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


WIDE, SQUARE = _image(20, 80, 0), _image(50, 60, 1)  # 64 and 63 soft tokens


def _config() -> transformers.Gemma4Config:
    text = gemma4_tiny(dict(TINY_SIZES, vocab_size=VOCAB))
    text.update(use_bidirectional_attention="vision", initializer_range=0.2)
    ids = {f"{k.removesuffix('_token')}_token_id": v for k, v in SPECIAL.items()}
    ids["eoa_token_index"] = ids.pop("eoa_token_id")
    return transformers.Gemma4Config(
        text_config=text, vision_config=VISION, audio_config=None, **ids
    )


def _redraw_tower(model: torch.nn.Module) -> None:
    """Tower and projection weights at std 0.2 (norm and standardization scales near
    one), clip bounds at +-[1, 3] (transformers starts them at +-inf)."""
    generator = torch.Generator().manual_seed(3)
    tower = [
        *model.model.vision_tower.named_parameters(),
        *model.model.embed_vision.named_parameters(),
    ]
    tower += [(n, b) for n, b in model.model.vision_tower.named_buffers() if "inv_freq" not in n]
    with torch.no_grad():
        for name, t in tower:
            noise = torch.randn(t.shape, generator=generator)
            if name.endswith(("_min", "_max")):
                t.fill_((1 + 2 * torch.rand((), generator=generator)).item())
                t.mul_(-1 if name.endswith("_min") else 1)
            elif name.endswith(("norm.weight", "std_scale")):
                t.copy_(1 + 0.3 * noise)
            else:
                t.copy_(0.2 * noise)


def _tokenizer(folder) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of `VOCAB` words, Gemma 4's media tokens at the top."""
    names = [f"w{i}" for i in range(VOCAB)]
    names[:4] = ["<pad>", "<eos>", "<bos>", "<unk>"]
    for kind, i in SPECIAL.items():
        names[i] = f"<|{kind}|>"
    words = {name: i for i, name in enumerate(names)}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{k}|>" for k in SPECIAL]})
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = {k: f"<|{k}|>" for k in SPECIAL}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model, its processor): saved with tokenizer and image
    processor configs."""
    reference_threads()
    folder = tmp_path_factory.mktemp("gemma4_vlm")
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(_config()).float().eval()
    randomize_scales(model)
    _redraw_tower(model)
    model.save_pretrained(folder)
    _tokenizer(folder)
    image_processor = transformers.Gemma4ImageProcessorPil(**IMAGE_PROCESSOR)
    image_processor.save_pretrained(folder)
    return folder, model, host.load_processor(str(folder))


@pytest.fixture(scope="module")
def pixels(tiny):
    """``(pixel_values, image_position_ids)`` of `WIDE` and `SQUARE` (280 rows each)."""
    out = tiny[2].image_processor([WIDE, SQUARE], return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_position_ids"]


def test_tower_and_projection_match_transformers(tiny, pixels):
    _, model, _ = tiny
    config = vision.from_hf(model.config, jnp.float32)
    module = vision.Gemma4VisionEncoder(config)
    params = load_module_params(module, vision.example_inputs(config), model.state_dict().items(),
                                "state dict")  # fmt: skip
    pv, pos = pixels
    with torch.no_grad():
        features = model.model.get_image_features(torch.from_numpy(pv), torch.from_numpy(pos))
        towers = model.model.vision_tower(torch.from_numpy(pv), torch.from_numpy(pos))
    theirs, pooled = features.pooler_output, towers.last_hidden_state
    assert [len(t) for t in theirs] == [64, 63]
    tower = vision.Gemma4VisionTower(config)
    ours_pooled = np.asarray(tower.apply({"params": params["vision_tower"]}, pv, pos))
    np.testing.assert_allclose(ours_pooled[0, :64], pooled[:64].numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(ours_pooled[1, :63], pooled[64:].numpy(), rtol=0, atol=TOL)
    batch = np.asarray(vision.image_features(config, params, pv, pos))  # [2, 70, 64]
    for i, ref in enumerate(theirs):
        assert np.abs(ref.numpy()).max() > 0.5  # not a vanishing signal
        np.testing.assert_allclose(batch[i, : len(ref)], ref.numpy(), rtol=0, atol=TOL)
        real = np.all(pos[i] != -1, axis=-1)
        alone = vision.image_features(config, params, pv[i : i + 1, real], pos[i : i + 1, real])
        np.testing.assert_allclose(np.asarray(alone)[0], ref.numpy(), rtol=0, atol=TOL)


def test_split_matches_the_processor(tiny):
    """Each image's run of tokens, its real patch rows and its soft-token count."""
    processor = tiny[2]
    out = processor(text=["w5 <|image_token|> w6 <|image_token|>"], images=[[WIDE, SQUARE]],
                    return_tensors="np")  # fmt: skip
    ids = out["input_ids"][0].tolist()
    parts = host.split(ids, out, processor, SPECIAL["image_token"])
    assert [p["units"] for p in parts] == [64, 63]
    for part in parts:
        first, last = part["positions"][0], part["positions"][-1]
        assert ids[first - 1] == SPECIAL["boi_token"] and ids[last + 1] == SPECIAL["eoi_token"]
        assert part["inputs"]["pixel_values"].shape == (4 * part["units"], 48)
    assert host.max_units(processor) == 70 and host.both_ways(tiny[1].config)


def test_engine_matches_transformers(tiny):
    from jaxengine import LLM
    from tests.engine.vision_golden import check_top_logprobs, run_images, top_logprobs_reference

    folder, model, processor = tiny
    engine = dict(max_model_len=160, max_num_seqs=2, max_num_batched_tokens=160, max_logprobs=5,
                  compile_token_buckets=[160], num_gpu_blocks_override=64)  # fmt: skip
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **engine)
    try:
        prompts = [
            ("w7 w8 <|image_token|> w9", [WIDE]),
            ("w7 w8 <|image_token|> w9", [SQUARE]),
        ]
        outputs = run_images(llm, prompts)
        logprobs = check_top_logprobs(outputs, prompts, top_logprobs_reference(model, processor))
        assert np.max(np.abs(np.subtract(logprobs[0], logprobs[1]))) > 1e-3  # the image counts
        assert llm.engine.executor.compiles_after_warmup == 0
        audio = (np.zeros(1600, np.float32), 16000)
        with pytest.raises(ValueError, match=r"\['audio'\]: only 'image' is supported"):
            llm.generate({"prompt": "w5", "multi_modal_data": {"audio": audio}}, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_engine_on_the_pallas_kernels_matches_transformers(tiny, monkeypatch):
    """``--attention-backend pallas`` (on CPU: the Triton kernels interpreted): the
    image's tokens attend both ways inside the kernel (``attend_until``), not through
    a fallback to the reference, and the tokens and logprobs stay transformers'."""
    from jaxengine import LLM
    from tests.engine.vision_golden import check_top_logprobs, run_images, top_logprobs_reference

    folder, model, processor = tiny
    engine = dict(max_model_len=160, max_num_seqs=1, max_num_batched_tokens=160, max_logprobs=5,
                  compile_token_buckets=[160], num_gpu_blocks_override=64)  # fmt: skip
    from jaxengine.runner.attention_backend import select_attention_backend
    from jaxengine.worker import loading

    chosen = []

    def spy(*args, **kwargs):
        chosen.append(select_attention_backend(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(loading, "select_attention_backend", spy)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", attention_backend="pallas",
              **engine)  # fmt: skip
    try:
        assert [b.name for b in chosen] == ["pallas-gpu-interpret"]
        prompts = [("w7 w8 <|image_token|> w9", [WIDE])]
        reference = top_logprobs_reference(model, processor)
        check_top_logprobs(run_images(llm, prompts), prompts, reference)
    finally:
        llm.engine.shutdown()
