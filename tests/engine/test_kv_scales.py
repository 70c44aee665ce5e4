"""``--calculate-kv-scales``: an fp8 cache's scales from the first batch.

The reference is independent of the calibration: a float32-cache engine prefills
the same prompts (one output token, so the cache then holds exactly the prompts'
k and v), and its cache's largest |k| and |v| per layer, over vLLM's ranges (200
and 100), are the scales the fp8 engine must have set: exactly for the first
layer, within 1% after it (the calibrating pass runs the layers before through the
fp8 cache at scale 1, which rounds their outputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from jaxengine import LLM, SamplingParams
from tests.sharding.conftest import ENGINE_KWARGS, PROMPTS, save_checkpoint
from tests.sharding.engine_checks import runner_of


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return save_checkpoint(config, tmp_path_factory.mktemp("llama"))


def prefill(llm: LLM) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)


def test_scales_come_from_the_first_batch_and_stay(llama_dir):
    reference = LLM(model=llama_dir, **ENGINE_KWARGS, kv_cache_dtype="float32")
    try:
        prefill(reference)
        caches = [np.asarray(c) for c in runner_of(reference).kv_caches]
    finally:
        reference.shutdown()
    want = [(np.abs(c[:, :, 0::2]).max() / 200, np.abs(c[:, :, 1::2]).max() / 100) for c in caches]

    llm = LLM(model=llama_dir, **ENGINE_KWARGS, kv_cache_dtype="fp8", calculate_kv_scales=True)
    try:
        assert set(np.ravel(scales(llm))) == {1.0}
        prefill(llm)
        got = scales(llm)
        # layer 0 sees the same k and v; later layers' inputs went through the fp8
        # cache (scale 1) of the layers before them during the calibrating pass
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-2)
        llm.generate(
            [{"prompt_token_ids": PROMPTS[3]}], SamplingParams(max_tokens=4), use_tqdm=False
        )
        assert scales(llm) == got
        assert llm.engine.executor.compiles_after_warmup == 0
    finally:
        llm.shutdown()


def scales(llm: LLM) -> list[tuple[float, float]]:
    """``(k_scale, v_scale)`` of each layer, in order."""
    model = runner_of(llm).params["model"]
    layers = sorted((k for k in model if k.startswith("layers_")), key=lambda k: int(k[7:]))
    return [tuple(float(model[k]["self_attn"][s]) for s in ("k_scale", "v_scale")) for k in layers]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "calculate_kv_scales: needs an fp8 KV cache"),
        ({"kv_cache_dtype": "fp8", "pipeline_parallel_size": 2}, "pipeline parallelism"),
    ],
)
def test_refused_without_an_fp8_cache_or_with_pipeline_stages(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=llama_dir, **ENGINE_KWARGS, calculate_kv_scales=True, **kwargs)
