"""New model families through the whole engine against transformers (issue 56).

Each case is a tiny random checkpoint of one family, checked by
`tests.models.family_engine.check_engine` (greedy tokens exact, top-5 logprobs within
1e-4, under chunked prefill, a prefix-cache hit and preemption, no compilation after
warm-up) in each of its parallel layouts on the 8 virtual CPU devices. To add a
family, append a `Case`: its config factory (vocabulary `VOCAB`) and its layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import pytest
import transformers

from jaxengine.models import get_model
from tests.models.deepseek_v3_tiny import deepseek_v3_tiny, kimi_k2_tiny
from tests.models.family_engine import (
    ENGINE_KWARGS,
    check_engine,
    default_prompts,
    reference,
    save_tiny,
)
from tests.models.gemma4_tiny import gemma4_moe_tiny, gemma4_tiny, randomize_saved_scales
from tests.models.glm4_moe_tiny import glm4_moe_tiny, randomize_saved_correction_bias
from tests.models.gpt_oss_tiny import gpt_oss_tiny, randomize_saved, set_saved_sinks
from tests.models.tiny_configs import TINY_SIZES, llama4_tiny, longrope_parameters

VOCAB = 256
MAX_TOKENS = 8
TP1: dict = {}
TP2 = {"tensor_parallel_size": 2}
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
TINY = dict(TINY_SIZES, vocab_size=VOCAB, num_hidden_layers=2)


def mixtral() -> Any:
    """4 experts, top 2; a 16-token window, shorter than the longer prompts."""
    return transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=16
    )


def phi3_longrope() -> Any:
    """Phi-4-mini's shape of LongRoPE (3/4 of each head rotates) in the long regime:
    an original length of 8, below every prompt, so transformers takes the long
    factors at every step, as the engine (context 64 > 8) does throughout."""
    return transformers.Phi3Config(
        **TINY,
        pad_token_id=0,
        original_max_position_embeddings=8,
        rope_parameters=longrope_parameters(TINY),
    )


def llama4() -> Any:
    """Llama 4 text (`llama4_tiny`): three chunked-local rope layers (chunks of 8: every
    prompt and the cached prefix cross them) and a global NoPE layer; layer 0 dense,
    layers 1-3 sigmoid top-1 MoE over 4 experts with a shared expert."""
    return transformers.Llama4TextConfig(**llama4_tiny(TINY))


def glm4_moe() -> Any:
    """GLM-4.5: a dense layer then two MoE layers of 8 sigmoid-routed experts in 4
    groups (2 eligible, 3 experts per token, correction bias randomized by
    `randomize_saved_correction_bias`), a shared expert, half of each head rotating."""
    return transformers.Glm4MoeConfig(**glm4_moe_tiny(TINY))


def deepseek_v3() -> Any:
    """DeepSeek-V3 (`deepseek_v3_tiny`): multi-head latent attention on the latent cache
    (one row of kv_lora_rank + rope values a token), YaRN with mscale, 2 dense then 2
    MoE layers of 8 sigmoid-routed experts in 4 groups, a shared expert, random
    correction bias (`randomize_saved_correction_bias`)."""
    return transformers.DeepseekV3Config(**deepseek_v3_tiny(TINY))


def kimi_k2() -> Any:
    """Kimi K2's shape of DeepSeek-V3 (`kimi_k2_tiny`): 16 experts in one group, 4 per
    token, one dense layer, queries through one q_proj."""
    return transformers.DeepseekV3Config(**kimi_k2_tiny(TINY))


def gpt_oss() -> Any:
    """gpt-oss: sliding (a 16-token window, shorter than the longer prompts), full and
    sliding layers with attention sinks (sinks and biases drawn by `randomize_saved`), yarn
    without truncation, 8 experts (top 4) with biases and a SwiGLU limit of 1.0,
    which clamps some gate and up values of this model."""
    return transformers.GptOssConfig(**gpt_oss_tiny(TINY, sliding_window=16, swiglu_limit=1.0))


def gemma4() -> Any:
    """Gemma 4 text, the small checkpoints' shape (`gemma4_tiny`): per-layer inputs,
    sliding (a 6-token window) and full layers of head widths 16 and 32, the last two
    layers sharing the KV of earlier ones; norms and scales off one
    (`randomize_saved_scales`)."""
    return transformers.Gemma4TextConfig(**gemma4_tiny(TINY))


def gemma4_moe() -> Any:
    """Gemma 4 text, the MoE shape (`gemma4_moe_tiny`): each layer's dense MLP beside 4
    experts (top 2), full layers with one KV head whose keys are the values."""
    return transformers.Gemma4TextConfig(**gemma4_moe_tiny(TINY))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: Callable[[], Any]
    """A transformers config of vocabulary `VOCAB`."""
    layouts: tuple[tuple[str, dict], ...]
    """(id, `LLM` keyword arguments) of each parallel layout to check."""
    prepare: Callable[[str], None] | None = None
    """Changes the saved checkpoint (its folder) before the reference reads it."""


CASES = [
    Case("mixtral", mixtral, (("tp1", TP1), ("tp2", TP2), ("ep2", EP2))),
    Case("phi3_longrope", phi3_longrope, (("tp1", TP1), ("tp2", TP2))),
    Case("llama4", llama4, (("tp1", TP1), ("tp2", TP2), ("ep2", EP2))),
    Case(
        "glm4_moe",
        glm4_moe,
        (("tp1", TP1), ("tp2", TP2), ("ep2", EP2)),
        prepare=randomize_saved_correction_bias,
    ),
    Case(  # tp4: one query head per device, four copies of the latent cache
        "deepseek_v3",
        deepseek_v3,
        (("tp1", TP1), ("tp2", TP2), ("ep2", EP2), ("tp4", {"tensor_parallel_size": 4})),
        prepare=randomize_saved_correction_bias,
    ),
    Case("kimi_k2", kimi_k2, (("tp1", TP1), ("ep2", EP2)), prepare=randomize_saved_correction_bias),
    Case("gpt_oss", gpt_oss, (("tp1", TP1), ("tp2", TP2), ("ep2", EP2)), prepare=randomize_saved),
    Case("gemma4", gemma4, (("tp1", TP1), ("tp2", TP2)), prepare=randomize_saved_scales),
    Case(
        "gemma4_moe",
        gemma4_moe,
        (("tp1", TP1), ("tp2", TP2), ("ep2", EP2)),
        prepare=randomize_saved_scales,
    ),
]
PARAMS = [
    pytest.param(case, kwargs, id=f"{case.name}-{layout}")
    for case in CASES
    for layout, kwargs in case.layouts
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """name -> (checkpoint folder, transformers' `Reference`), built once per family."""
    built: dict[str, tuple] = {}

    def get(case: Case) -> tuple:
        if case.name not in built:
            path = save_tiny(case.config(), tmp_path_factory.mktemp(case.name))
            if case.prepare is not None:
                case.prepare(path)
            built[case.name] = path, reference(path, default_prompts(VOCAB), MAX_TOKENS)
        return built[case.name]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_auto_takes_the_jax_model(case):
    """The registry has the family: ``--model-impl auto`` falls back to transformers'
    PyTorch model only when `get_model` raises `UnsupportedArchitectureError`."""
    module, _ = get_model(case.config(), jnp.float32)
    assert type(module).__module__.startswith("jaxengine.models.")


@pytest.mark.parametrize(("case", "parallel"), PARAMS)
def test_engine_matches_transformers(case, parallel, references):
    path, ref = references(case)
    check_engine(path, ref, default_prompts(VOCAB), **parallel)


@pytest.mark.parametrize(
    ("name", "parallel"),
    [("phi3_longrope", TP1), ("phi3_longrope", TP2), ("gemma4", TP1)],
    ids=["phi3_longrope-tp1", "phi3_longrope-tp2", "gemma4-tp1"],
)
def test_update_weights_turns_dummy_weights_into_the_checkpoint(name, parallel, references):
    """`LLM.update_weights` with the checkpoint's own tensors turns a random-weight
    engine into the checkpoint: transformers' greedy tokens. Phi-3's ``qkv_proj`` and
    ``gate_up_proj`` are kept fused at TP 1 and split by `Phi3ForCausalLM.split_tensors`
    at TP 2; Gemma 4's per-layer scalars and shared-KV layers take their tensors too."""
    from safetensors.numpy import load_file

    from jaxengine import LLM, SamplingParams

    path, ref = references(next(c for c in CASES if c.name == name))
    tensors = load_file(f"{path}/model.safetensors")
    assert name != "phi3_longrope" or any(n.endswith("qkv_proj.weight") for n in tensors)
    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 32, **parallel}
    llm = LLM(path, load_format="dummy", **kwargs)
    try:
        assert llm.update_weights(tensors) > 0
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in default_prompts(VOCAB)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == ref.tokens
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "config",
    [mixtral, phi3_longrope, deepseek_v3],
    ids=["mixtral", "phi3_longrope", "deepseek_v3"],
)
def test_sequence_classifier_reads_the_family_checkpoint(config, tmp_path):
    """``<Family>ForSequenceClassification`` (the family's decoder under a ``score``
    head) loads its family's checkpoint layout (Mixtral's expert names, Phi-3's fused
    tensors, DeepSeek-V3's router and MLA names) and classifies as transformers does,
    softmax within 1e-4."""
    import numpy as np
    import torch

    from jaxengine import LLM

    hf_config = config()
    hf_config.num_labels, hf_config.pad_token_id = 3, 0
    name = type(hf_config).__name__.removesuffix("Config") + "ForSequenceClassification"
    torch.manual_seed(0)
    model = getattr(transformers, name)(hf_config).eval()
    model.save_pretrained(tmp_path)
    prompts = [[1 + t for t in p] for p in default_prompts(VOCAB - 1)]  # no pad id
    one_step = dict(max_num_batched_tokens=64, compile_token_buckets=[64])  # no chunks
    llm = LLM(str(tmp_path), **{**ENGINE_KWARGS, "num_gpu_blocks_override": 32, **one_step})
    try:
        outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            want = torch.softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
        np.testing.assert_allclose(out.outputs.probs, want, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "pallas"], ids=["xla-cpu", "pallas-interpret"])
def test_gpt_oss_sinks_change_the_engine_output(backend, references, tmp_path):
    """The engine reads and uses the sinks: a copy of the checkpoint whose sinks are
    all -1e9 (no probability mass: no sinks) gives other logprobs, on the CPU
    attention and on the Pallas GPU kernel in interpret mode (``--attention-backend
    pallas`` on CPU), while the checkpoint's own sinks give transformers' tokens."""
    import shutil

    from jaxengine import LLM, SamplingParams

    path, ref = references(next(c for c in CASES if c.name == "gpt_oss"))
    no_sinks = tmp_path / "no_sinks"
    shutil.copytree(path, no_sinks)
    set_saved_sinks(no_sinks, value=-1e9)
    prompts = [{"prompt_token_ids": p} for p in default_prompts(VOCAB)[:2]]
    params = SamplingParams(temperature=0, logprobs=5, max_tokens=3, ignore_eos=True)
    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 32, "attention_backend": backend}
    firsts = []
    for folder in (path, no_sinks):
        llm = LLM(str(folder), **kwargs)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        firsts.append([o.outputs[0].logprobs[0] for o in outputs])
        if folder == path:
            assert [list(o.outputs[0].token_ids) for o in outputs] == [
                t[:3] for t in ref.tokens[:2]
            ]
    for with_sinks, without in zip(*firsts, strict=True):
        shared = set(with_sinks) & set(without)
        assert shared, "no common top token"
        diff = max(abs(with_sinks[t].logprob - without[t].logprob) for t in shared)
        assert diff > 1e-2, f"the sinks changed the logprobs by only {diff:.2e}"
