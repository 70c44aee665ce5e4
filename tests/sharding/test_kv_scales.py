"""``--calculate-kv-scales``: an fp8 cache's scales from the first batch.

The references are independent of the calibration: engines without it prefill the
same prompts (one output token, so their caches then hold exactly the prompts' k
and v), and their caches' largest |k| and |v| per layer, over vLLM's ranges (200
and 100), give the scales the calibrated engine must set.
- Layer 0 sees the same k and v as a float32-cache engine: its scales are exact.
- Later layers' inputs went through the fp8 cache (scale 1) of the layers before
  them during the calibrating pass, as they do in an fp8-cache engine without the
  flag. That engine's cache holds those k and v rounded to float8_e4m3fn, so its
  largest values are within e4m3's half step (1/16) of the calibrated ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from tests.sharding.conftest import ENGINE_KWARGS, PROMPTS
from tests.sharding.engine_checks import runner_of


def prefill(llm: LLM) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)


def reference_scales(llama_dir: str, kv_cache_dtype: str) -> np.ndarray:
    """``[layers, 2]``: largest |k| / 200 and |v| / 100 in a prefilled cache."""
    reference = LLM(model=llama_dir, **ENGINE_KWARGS, kv_cache_dtype=kv_cache_dtype)
    try:
        prefill(reference)
        # page 0 is the null page that padding tokens write to
        caches = [np.asarray(c[1:]).astype(np.float32) for c in runner_of(reference).kv_caches]
    finally:
        reference.shutdown()
    return np.array(
        [(np.abs(c[:, :, 0::2]).max(), np.abs(c[:, :, 1::2]).max()) for c in caches]
    ) / [
        200,
        100,
    ]


def test_scales_come_from_the_first_batch_and_stay(llama_dir):
    exact, rounded = (reference_scales(llama_dir, dtype) for dtype in ("float32", "fp8"))
    llm = LLM(model=llama_dir, **ENGINE_KWARGS, kv_cache_dtype="fp8", calculate_kv_scales=True)
    try:
        assert set(np.ravel(scales(llm))) == {1.0}
        prefill(llm)
        got = scales(llm)
        np.testing.assert_allclose(got[0], exact[0], rtol=1e-6)
        np.testing.assert_allclose(got, rounded, rtol=1 / 16)
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
