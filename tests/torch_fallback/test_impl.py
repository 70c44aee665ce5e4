"""``--model-impl``: which implementation runs, sampling and logprobs through the
PyTorch model, and what the fallback refuses."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from jaxengine import LLM, SamplingParams
from tests.torch_fallback.conftest import ENGINE_KWARGS, PROMPTS

AUTO = {**ENGINE_KWARGS, "model_impl": "auto"}


@pytest.fixture(scope="module")
def gpt2(checkpoints):
    folder, model = checkpoints("gpt2")
    llm = LLM(model=folder, **AUTO)  # no JAX port: auto falls back
    yield llm, model
    llm.shutdown()


def test_auto_falls_back_and_jax_refuses(checkpoints, gpt2, caplog):
    llm, _ = gpt2
    assert type(llm.engine.executor.runner.program).__name__ == "TorchProgram"
    folder, _ = checkpoints("gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported architectures: .*Llama"):
        LLM(model=folder, **{**ENGINE_KWARGS, "model_impl": "jax"})
    llama, _ = checkpoints("llama")
    with caplog.at_level(logging.INFO, logger="jaxengine.executor.build"):
        native = LLM(model=llama, **AUTO)
    try:
        program = type(native.engine.executor.runner.program).__name__
        assert program in ("SingleStage", "PiecewiseStage")  # (PIECEWISE: the CPU default)
        assert "--model-impl auto: using transformers" not in caplog.text
    finally:
        native.shutdown()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(gpt2):
    llm, _ = gpt2
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], seeded, use_tqdm=False)
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], [other, seeded, other], use_tqdm=False
    )
    assert alone[0].outputs[0].token_ids == batch[1].outputs[0].token_ids


def test_logprobs_are_log_softmax_of_transformers_logits(gpt2):
    llm, model = gpt2
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    tokens = PROMPTS[2] + list(out.outputs[0].token_ids)
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1).numpy()
    start = len(PROMPTS[2]) - 1
    for i, (token, step) in enumerate(
        zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    ):
        assert step[token].logprob == pytest.approx(want[start + i, token], abs=1e-4)
        assert len(step) >= 3
    for t in range(1, len(PROMPTS[2])):
        target = PROMPTS[2][t]
        assert out.prompt_logprobs[t][target].logprob == pytest.approx(
            want[t - 1, target], abs=1e-4
        )


def test_refused_flags_and_architectures(checkpoints, tmp_path):
    folder, _ = checkpoints("gpt2")
    for flags, named in [
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"async_scheduling": True}, "--async-scheduling"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype"),
        ({"quantization": "int8"}, "--quantization"),
        ({"model_impl": "auto", "enable_lora": True}, "--enable-lora"),  # auto falls back
    ]:
        with pytest.raises(
            NotImplementedError, match=f"{named} is not supported with --model-impl"
        ):
            LLM(model=folder, **{**ENGINE_KWARGS, **flags})
    config = transformers.FalconConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    transformers.FalconForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="cannot run FalconForCausalLM"):
        LLM(model=str(tmp_path), **ENGINE_KWARGS)
