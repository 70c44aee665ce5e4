"""SmolVLM (Idefics3) through the engine against transformers, on a tiny random model.

One engine with a 32-token step budget (a prompt's image tokens are split between
chunks), an encoder cache of 32 embeddings (two images at most) and 8 KV pages
(requests are preempted). Greedy tokens must equal transformers' ``generate`` and
each token's logprob its ``log_softmax`` (1e-4); the same text with another image
must give the other image's tokens; the same image again must hit the prefix cache
and the encoder cache; nothing compiles after warm-up.
"""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jaxengine import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy_images, reference_threads

MAX_TOKENS = 6
ENGINE = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    compile_token_buckets=[8, 32],
    num_gpu_blocks_override=9,
    swap_space=0,
    enable_prefix_caching=True,
    max_logprobs=1,
    enable_sleep_mode=True,
)


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


WIDE, SQUARE, SMALL = _image(20, 80, 0), _image(50, 60, 1), _image(30, 30, 2)  # 3, 5, 1 tiles


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [  # (prompt text, images): 2, 0, 1 and 1 images, text-only mixed in
    (_chat("<image>What is it?<image>"), [WIDE, SQUARE]),
    (_chat("Hello there, how are you today?"), []),
    (_chat("Describe <image> briefly"), [SQUARE]),
    (_chat("<image>"), [SMALL]),
]


def _input(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@pytest.fixture(scope="module")
def smolvlm(tiny_smolvlm, xla_cache_dir):
    llm = LLM(model=str(tiny_smolvlm[0]), compilation_cache_dir=xla_cache_dir, **ENGINE)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_smolvlm):
    """transformers' greedy tokens and their logprobs, per (text, images)."""
    reference_threads()
    folder, model = tiny_smolvlm
    processor = transformers.AutoProcessor.from_pretrained(folder)

    def generate(text: str, images: list) -> tuple[list[int], list[float]]:
        tokens, rows = hf_greedy_images(model, processor, text, images, MAX_TOKENS)
        return tokens, [row[t].item() for row, t in zip(rows, tokens, strict=True)]

    return generate


def _greedy(llm: LLM, prompts) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    return llm.generate([_input(t, i) for t, i in prompts], params)


def _check(outputs, prompts, reference) -> None:
    for request, (text, images) in zip(outputs, prompts, strict=True):
        out = request.outputs[0]
        tokens, logprobs = reference(text, images)
        assert list(out.token_ids) == tokens
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, tokens, strict=True)]
        np.testing.assert_allclose(ours, logprobs, rtol=0, atol=1e-4)


def test_batch_of_image_counts_matches_transformers(smolvlm, reference):
    """0, 1 and 2 images of different sizes in one batch; the two-image prompt (66
    tokens) runs in three chunks, the second image split between two; the cache of
    32 embeddings cannot hold every image at once and 8 pages not every request."""
    preempted = smolvlm.engine.get_stats().num_preemptions
    _check(_greedy(smolvlm, PROMPTS * 2), PROMPTS * 2, reference)
    assert smolvlm.engine.get_stats().num_preemptions > preempted
    assert smolvlm.engine.executor.compiles_after_warmup == 0


def test_same_image_hits_the_caches_another_image_misses(smolvlm, reference):
    """The same text and image again: its pages come from the prefix cache; the same
    text with another image: only the pages before the image do; the same image
    after other text: the prefix cache misses, the encoder cache hits."""
    cache = smolvlm.engine.scheduler.encoder.cache
    text = _chat("Look: <image> and tell me everything you see in it")
    first = _greedy(smolvlm, [(text, [SQUARE])])[0]
    again = _greedy(smolvlm, [(text, [SQUARE])])[0]
    other = _greedy(smolvlm, [(text, [WIDE])])[0]
    assert again.num_cached_tokens > first.num_cached_tokens
    assert other.num_cached_tokens < again.num_cached_tokens
    hits = cache.hits
    later = (_chat("Something else first, then <image>"), [SQUARE])
    out = _greedy(smolvlm, [later])
    assert cache.hits == hits + 1
    _check([first, again, other, *out], [(text, [SQUARE])] * 2 + [(text, [WIDE]), later], reference)


def test_an_image_is_encoded_once_across_chunks(smolvlm):
    """The two-image prompt with two 5-tile images alone: each image is encoded once
    (the 32-row cache holds one of them: the second waits until the first is passed)."""
    cache = smolvlm.engine.scheduler.encoder.cache
    queries, hits = cache.queries, cache.hits
    text, images = PROMPTS[0]
    smolvlm.generate([_input(text, [_image(40, 64, 7), _image(64, 40, 8)])],
                     SamplingParams(max_tokens=1))  # fmt: skip
    assert (cache.queries - queries, cache.hits - hits) == (2, 0)


def test_sleep_drops_the_encoded_images(smolvlm, reference):
    """Sleep frees the encoder's weights and rows with the rest; after waking, an image
    encoded before is encoded again (the cache forgot it) and the outputs hold."""
    prompt = (_chat("Once more: <image>"), [SMALL])
    _greedy(smolvlm, [prompt])
    smolvlm.sleep(level=1)
    smolvlm.wake_up()
    cache = smolvlm.engine.scheduler.encoder.cache
    hits = cache.hits
    _check(_greedy(smolvlm, [prompt]), [prompt], reference)
    assert cache.hits == hits


def test_update_weights_writes_the_encoder_too(smolvlm, tiny_smolvlm):
    """RL weight updates reach the image encoder (its projection halved): the engine
    then answers as transformers does with the same change; a misshapen encoder
    tensor changes nothing."""
    from jaxengine.loader.errors import CheckpointError

    folder, model = tiny_smolvlm
    name = "model.connector.modality_projection.proj.weight"
    original = model.state_dict()[name].clone()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.state_dict()[name].mul_(0.5)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    prompt = (_chat("Describe <image>"), [WIDE])
    before = list(_greedy(smolvlm, [prompt])[0].outputs[0].token_ids)
    with pytest.raises(CheckpointError, match=name):
        smolvlm.update_weights({name: original[:, :3]})
    try:
        smolvlm.update_weights({name: changed.state_dict()[name]})
        want, _ = hf_greedy_images(changed, processor, *prompt, MAX_TOKENS)
        assert want != before  # the change shows in transformers' tokens
        assert list(_greedy(smolvlm, [prompt])[0].outputs[0].token_ids) == want
    finally:
        smolvlm.update_weights({name: original})


def test_chat_with_image_parts_is_the_rendered_prompt(smolvlm, tiny_smolvlm):
    """`LLM.chat` with vLLM's ``image_pil`` part and an ``image_url`` data: URL gives
    the tokens of the same prompt rendered by the model's processor."""
    buffer = io.BytesIO()
    WIDE.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [
        {"type": "image_pil", "image_pil": SQUARE},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat = smolvlm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    (direct,) = _greedy(smolvlm, [(_chat("<image>and<image>"), [SQUARE, WIDE])])
    assert chat[0].prompt_token_ids == direct.prompt_token_ids
    assert chat[0].outputs[0].token_ids == direct.outputs[0].token_ids


def test_tensor_parallel_engine_matches_transformers(tiny_smolvlm, xla_cache_dir, reference):
    """Two virtual devices: the decoder split, the encoder and its rows replicated."""
    kwargs = {**ENGINE, "compile_token_buckets": [32], "tensor_parallel_size": 2}
    llm = LLM(model=str(tiny_smolvlm[0]), compilation_cache_dir=xla_cache_dir, **kwargs)
    try:
        _check(_greedy(llm, PROMPTS[:3]), PROMPTS[:3], reference)
        assert llm.engine.executor.compiles_after_warmup == 0
    finally:
        llm.engine.shutdown()
