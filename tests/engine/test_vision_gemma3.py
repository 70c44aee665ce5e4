"""Gemma 3 with images through the engine against transformers, on a tiny random model.

Gemma 3's image tokens attend to each other both ways (``attend_until``), so a
prefill chunk never ends inside an image. The tiny model's greedy token is the same
for most prompts, so each step's top-5 logprobs are compared with transformers'
(1e-4): they differ between images and would differ by 4e-2 if image tokens attended
causally.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from PIL import Image

from jaxengine import LLM
from tests.engine.vision_golden import (
    TOP,
    check_top_logprobs,
    run_images,
    top_logprobs_reference,
)
from tests.models.hf_reference import reference_threads

IMAGE = "<start_of_image>"


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


WIDE, SQUARE = _image(20, 80, 0), _image(50, 60, 1)


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_vlm, xla_cache_dir):
    llm = LLM(
        model=str(tiny_gemma3_vlm[0]),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        compile_token_buckets=[8, 32],
        enable_prefix_caching=True,
        max_logprobs=TOP,
        compilation_cache_dir=xla_cache_dir,
    )
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_gemma3_vlm):
    """transformers' greedy tokens and each step's top-5 logprobs, per prompt."""
    reference_threads()
    folder, model = tiny_gemma3_vlm
    processor = transformers.AutoProcessor.from_pretrained(folder)

    return top_logprobs_reference(model, processor)


def test_batch_of_image_counts_matches_transformers(gemma3, reference):
    prompts = [
        (_chat(f"{IMAGE}What is it?{IMAGE}"), [WIDE, SQUARE]),
        (_chat("Hello there, how are you today?"), []),
        (_chat(f"Describe {IMAGE} briefly"), [SQUARE]),
        (_chat(f"Describe {IMAGE} briefly"), [WIDE]),
    ]
    logprobs = check_top_logprobs(run_images(gemma3, prompts), prompts, reference)
    assert np.max(np.abs(np.subtract(logprobs[2], logprobs[3]))) > 1e-3  # the image counts
    assert gemma3.engine.executor.compiles_after_warmup == 0


def test_a_chunk_never_ends_inside_an_image(gemma3, reference):
    """A prompt whose image tokens straddle the 32-token step budget: the first chunk
    stops before the image, which runs whole in the next one."""
    processor = gemma3.engine.images.processor
    pad = next(  # text before the image, long enough to put it across position 32
        n for n in range(1, 40) if _straddles(processor, _chat("x " * n + IMAGE), 32)
    )
    prompt = (_chat("x " * pad + IMAGE), [SQUARE])
    check_top_logprobs(run_images(gemma3, [prompt]), [prompt], reference)


def _straddles(processor, text: str, boundary: int) -> bool:
    ids = processor(text=[text], images=[[SQUARE]], return_tensors="np")["input_ids"][0]
    image = np.flatnonzero(ids == processor.tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    return image[0] < boundary <= image[-1]


def test_same_image_hits_the_prefix_cache(gemma3, reference):
    prompt = (_chat(f"Look at {IMAGE} and tell me everything you can see"), [WIDE])
    first = run_images(gemma3, [prompt])[0]
    again = run_images(gemma3, [prompt])[0]
    assert again.num_cached_tokens > first.num_cached_tokens
    check_top_logprobs([again], [prompt], reference)
