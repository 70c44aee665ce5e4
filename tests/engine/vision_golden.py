"""The image-engine golden checks shared by the Gemma 3 and Qwen2.5-VL tests: the
engine's greedy tokens and each step's top-5 logprobs against transformers'."""

from __future__ import annotations

import numpy as np

from jaxengine import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy_images

MAX_TOKENS, TOP = 4, 5

Prompt = tuple[str, list]
"""(text with the family's image placeholders, its images)."""


def top_logprobs_reference(model, processor):
    """``(text, images) -> (tokens, [{token: logprob}] per step)``: transformers'
    greedy tokens and each step's top-`TOP` logprobs."""

    def generate(text: str, images: list) -> tuple[list[int], list[dict[int, float]]]:
        tokens, rows = hf_greedy_images(model, processor, text, images, MAX_TOKENS)
        tops = [row.topk(TOP) for row in rows]
        return tokens, [dict(zip(i.tolist(), v.tolist(), strict=True)) for v, i in tops]

    return generate


def run_images(llm: LLM, prompts: list[Prompt]):
    """The engine's greedy outputs with top-`TOP` logprobs, one request per prompt."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP)
    inputs = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


def check_top_logprobs(outputs, prompts: list[Prompt], reference) -> list[list[float]]:
    """Asserts tokens and top-`TOP` logprobs equal (1e-4); returns ours per prompt."""
    ours_all = []
    for request, (text, images) in zip(outputs, prompts, strict=True):
        out = request.outputs[0]
        tokens, tops = reference(text, images)
        assert list(out.token_ids) == tokens
        for step, top in zip(out.logprobs, tops, strict=True):
            assert set(top) <= set(step)
            np.testing.assert_allclose([step[t].logprob for t in top], list(top.values()),
                                       rtol=0, atol=1e-4)  # fmt: skip
        ours_all.append([step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)])
    return ours_all
