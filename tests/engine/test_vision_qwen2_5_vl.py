"""Qwen2.5-VL with images through the engine against transformers, on a tiny random model.

One engine with a 32-token step budget (an image's tokens are split between chunks:
Qwen2.5-VL attends causally), 9 KV pages (requests are preempted) and the prefix
cache. The decoder's M-RoPE positions come from each request's images (text after an
image goes on from the image's largest side), so a wrong position shows in every
token after the first image. Each step's top-5 logprobs must equal transformers'
(1e-4), and its greedy tokens; nothing compiles after warm-up, whatever the images'
counts and sizes (the encoder's token buckets are compiled at warm-up). The buckets
follow the engine's max_pixels (``--mm-processor-kwargs``), which a request may lower
but not raise.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import transformers
from PIL import Image

from jaxengine import LLM, SamplingParams
from jaxengine.config.multimodal import MultiModalConfig
from jaxengine.loader import LoadedModel
from jaxengine.multimodal.qwen2_5_vl import load_processor
from jaxengine.worker.images import encoder_runner, load_images
from tests.engine.vision_golden import (
    MAX_TOKENS,
    TOP,
    check_top_logprobs,
    run_images,
    top_logprobs_reference,
)
from tests.models.hf_reference import reference_threads

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ENGINE = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    compile_token_buckets=[8, 32],
    num_gpu_blocks_override=9,
    swap_space=0,
    enable_prefix_caching=True,
    max_logprobs=TOP,
)


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# tokens (rows x columns of 2x2 patches of 8 pixels): 1 x 5, 3 x 4, 4 x 4
WIDE, SQUARE, BIG = _image(20, 80, 0), _image(50, 60, 1), _image(64, 64, 2)


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [  # (prompt text, images): 2, 0, 1 and 1 images, text-only mixed in
    (_chat(f"Compare {IMAGE} with {IMAGE} please"), [BIG, SQUARE]),
    (_chat("Hello there, how are you today?"), []),
    (_chat(f"Describe {IMAGE} briefly"), [SQUARE]),
    (_chat(f"Describe {IMAGE} briefly"), [WIDE]),
]


@pytest.fixture(scope="module")
def tiny_qwen2_5_vl(smollm2_tokenizer, tmp_path_factory):
    """(folder, transformers model): `tests.tiny_models.save_tiny_qwen2_5_vl`."""
    from tests.tiny_models import save_tiny_qwen2_5_vl

    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    return path, save_tiny_qwen2_5_vl(path, smollm2_tokenizer)


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_5_vl, xla_cache_dir):
    llm = LLM(model=str(tiny_qwen2_5_vl[0]), compilation_cache_dir=xla_cache_dir, **ENGINE)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def processor(tiny_qwen2_5_vl):
    """transformers' processor, built from the folder's parts (no torchvision here)."""
    return load_processor(str(tiny_qwen2_5_vl[0]))


@pytest.fixture(scope="module")
def reference(tiny_qwen2_5_vl, processor):
    """transformers' greedy tokens and each step's top-5 logprobs, per prompt."""
    reference_threads()
    model = tiny_qwen2_5_vl[1]

    return top_logprobs_reference(model, processor)


def _image_span(processor, text: str, images: list) -> tuple[int, int]:
    """First and last prompt position of the last image's tokens."""
    ids = processor(text=[text], images=[images], return_tensors="np")["input_ids"][0]
    image = np.flatnonzero(ids == processor.image_token_id)
    count = int(processor.image_processor(images[-1:], return_tensors="np")["image_grid_thw"]
                .prod()) // 4  # fmt: skip
    return int(image[-count]), int(image[-1])


def test_batch_of_image_counts_matches_transformers(qwen, reference, processor):
    """0, 1 and 2 images of different sizes in one batch, twice over: the two-image
    prompt's second image straddles the 32-token budget, and 9 pages do not hold
    every request (preemption)."""
    first, last = _image_span(processor, *PROMPTS[0])
    assert first < 32 <= last
    preempted = qwen.engine.get_stats().num_preemptions
    logprobs = check_top_logprobs(run_images(qwen, PROMPTS * 2), PROMPTS * 2, reference)
    assert qwen.engine.get_stats().num_preemptions > preempted
    assert np.max(np.abs(np.subtract(logprobs[2], logprobs[3]))) > 1e-3  # the image counts
    assert qwen.engine.executor.compiles_after_warmup == 0


def test_an_image_split_between_chunks(qwen, reference, processor):
    """Alone, the two-image prompt's second image starts in the first 32-token chunk
    and ends in the second: each chunk reads its part of the image's rows and
    positions."""
    check_top_logprobs(run_images(qwen, PROMPTS[:1]), PROMPTS[:1], reference)


def test_same_image_hits_the_prefix_cache_another_misses(qwen, reference):
    """The same text and image again: its pages come from the prefix cache (positions
    past the hit are the image's M-RoPE ones); the same text with another image: only
    the pages before the image do."""
    text = _chat(f"Look at {IMAGE} and tell me everything you can see in it, please")
    first = run_images(qwen, [(text, [BIG])])[0]
    again = run_images(qwen, [(text, [BIG])])[0]
    other = run_images(qwen, [(text, [SQUARE])])[0]
    assert again.num_cached_tokens > first.num_cached_tokens
    assert other.num_cached_tokens < again.num_cached_tokens
    prompts = [(text, [BIG])] * 2 + [(text, [SQUARE])]
    check_top_logprobs([first, again, other], prompts, reference)
    assert qwen.engine.executor.compiles_after_warmup == 0


def test_chat_with_image_parts_is_the_rendered_prompt(qwen):
    """`LLM.chat` with an image part renders Qwen's vision tokens around the image's
    placeholder and gives the tokens of the same prompt given as text."""
    parts = [{"type": "image_pil", "image_pil": WIDE}, {"type": "text", "text": "What?"}]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat = qwen.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    (direct,) = run_images(qwen, [(_chat(f"{IMAGE}What?"), [WIDE])])
    assert chat[0].prompt_token_ids == direct.prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct.outputs[0].token_ids


def test_videos_are_refused(qwen):
    with pytest.raises(ValueError, match="only 'image'"):
        qwen.generate({"prompt": "x", "multi_modal_data": {"video": [np.zeros((2, 8, 8, 3))]}})


def test_max_pixels_sizes_the_encoder(qwen, tiny_qwen2_5_vl):
    """The encoder's token buckets and its largest image follow the engine's
    max_pixels: the folder's 4096 pixels give buckets of 1 to 16 tokens (16 x 16
    pixels each); ``--mm-processor-kwargs '{"max_pixels": 1024}'`` gives 1 to 4 (the
    worker's own path, from the config to the `EncoderRunner`)."""
    assert qwen.engine.executor.runner.encoder.unit_buckets == [1, 2, 4, 8, 16]
    folder = tiny_qwen2_5_vl[0]
    kwargs = MultiModalConfig(mm_processor_kwargs={"max_pixels": 1024})
    config = dataclasses.replace(qwen.engine.config, multimodal_config=kwargs)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    loaded = LoadedModel(None, SimpleNamespace(dtype=np.float32), None, hf_config,
                         SimpleNamespace(path=folder), logical_axes={})  # fmt: skip
    images = load_images(config, loaded)
    assert images.processor.max_units == images.processor.max_embeds_per_image == 4
    assert encoder_runner(config, loaded, images, None, None).unit_buckets == [1, 2, 4]


def test_request_max_pixels_may_lower_not_raise(qwen):
    """A request's max_pixels below the engine's resizes its image to fewer tokens (a
    bucket compiled at warm-up); one above it is refused, naming the limit."""
    text = _chat(f"Describe {IMAGE} briefly")
    params = SamplingParams(temperature=0, max_tokens=1)

    def prompt(max_pixels: int) -> dict:
        kwargs = {"max_pixels": max_pixels}
        return {"prompt": text, "multi_modal_data": {"image": [BIG]}, "mm_processor_kwargs": kwargs}

    full, low = qwen.generate([prompt(4096), prompt(1024)], params, use_tqdm=False)
    assert len(full.prompt_token_ids) - len(low.prompt_token_ids) == 16 - 4
    assert qwen.engine.executor.compiles_after_warmup == 0
    with pytest.raises(ValueError, match="may lower the image size limits"):
        qwen.generate(prompt(8192), params, use_tqdm=False)
