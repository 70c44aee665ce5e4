"""Golden logits: every model family on a tiny random config against transformers.

Each test builds a random HF model, saves it as safetensors, loads it through
`jaxengine.loader.load_model`, then runs a ragged batch (prefill of prompts of mixed
lengths, then single-token decode steps through the paged cache) and compares every
step's last-token logits with transformers' full-sequence forward in float32.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformers

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import load_model
from jaxengine.runner.attention_backend import kernels, mla_kernels
from jaxengine.runner.greedy_loop import GreedyLoop
from tests.models.deepseek_v3_tiny import deepseek_v3_tiny, kimi_k2_tiny
from tests.models.gemma4_tiny import gemma4_moe_tiny, gemma4_tiny, randomize_scales
from tests.models.glm4_moe_tiny import glm4_moe_tiny, randomize_correction_bias
from tests.models.gpt_oss_tiny import gpt_oss_tiny, randomize_sinks_and_biases
from tests.models.tiny_configs import TINY_SIZES, llama4_tiny, longrope_parameters

SMALL = dict(vocab_size=160, **TINY_SIZES)


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **SMALL,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        attention_bias=True,
        mlp_bias=True,
    ),
    "llama_yarn_tied": lambda: transformers.LlamaConfig(
        **SMALL,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=7),
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=7
    ),
    # chunked local rope layers (chunks of 8: the prompts cross them), a global NoPE
    # layer with attention temperature (floor_scale 4: it grows within the test's
    # positions), a dense layer and sigmoid-routed MoE layers with a shared expert
    "llama4": lambda: transformers.Llama4TextConfig(**llama4_tiny(SMALL)),
    "phi3": lambda: transformers.Phi3Config(**SMALL, partial_rotary_factor=0.5, pad_token_id=0),
    # LongRoPE in the regime of an engine whose context fits the original length: short
    # factors (`layers.rope`); the long regime runs in test_new_families_engine.py
    "phi3_longrope": lambda: transformers.Phi3Config(
        **SMALL,
        pad_token_id=0,
        original_max_position_embeddings=SMALL["max_position_embeddings"],
        rope_parameters=longrope_parameters(SMALL, factor=4.0),
    ),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL,
        head_dim=32,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    ),
    # per-layer inputs, sliding and full layers of head widths 16 and 32 (window 6),
    # the last two sharing layers 2's and 1's KV (double-wide MLP); norms and
    # layer_scalar off one (`PREPARE`)
    "gemma4": lambda: transformers.Gemma4TextConfig(**gemma4_tiny(SMALL)),
    # every layer's MLP beside 4 experts (top 2; router scales off one), full layers
    # with one KV head (of the sliding layers' two) whose keys are the values
    "gemma4_moe": lambda: transformers.Gemma4TextConfig(**gemma4_moe_tiny(SMALL)),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # one dense layer, then sigmoid-routed MoE layers: 8 experts in 4 groups (2 kept),
    # a shared expert, a random correction bias (`PREPARE`), half the head rotating
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**glm4_moe_tiny(SMALL)),
    # multi-head latent attention on the latent cache (q low-rank path, YaRN with
    # mscale / mscale_all_dim), 2 dense then 2 MoE layers (8 experts, 4 groups, 2 kept,
    # shared expert, random correction bias); Kimi K2's shape: 16 experts, one group,
    # q_proj
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**deepseek_v3_tiny(SMALL)),
    "kimi_k2": lambda: transformers.DeepseekV3Config(**kimi_k2_tiny(SMALL)),
    # attention sinks and biases (drawn by `PREPARE`), sliding / full / sliding layers, yarn
    # without truncation, 8 experts (top 4) with biases; a SwiGLU limit of 0.1 clamps
    # some of this tiny model's gate and up values
    "gpt_oss": lambda: transformers.GptOssConfig(**gpt_oss_tiny(SMALL, swiglu_limit=0.1)),
}

PREPARE = {
    "glm4_moe": randomize_correction_bias,
    "deepseek_v3": randomize_correction_bias,
    "kimi_k2": randomize_correction_bias,
    "gpt_oss": randomize_sinks_and_biases,
    "gemma4": randomize_scales,
    "gemma4_moe": randomize_scales,
}
"""Changes to a family's freshly built transformers model before it is saved."""

PROMPT_LENS = (5, 17, 2, 11)
DECODE_STEPS = 5


def reference_logits(hf_model, seqs):
    with torch.no_grad():
        return [hf_model(torch.tensor([s])).logits[0, -1].numpy() for s in seqs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    check_family(family, tmp_path)


# The Pallas kernels (interpret mode) inside the model's forward: window, qk-norm, GQA,
# chunked local attention (llama4), attention sinks (gpt_oss), multi-head latent
# attention (deepseek_v3: the MLA kernels, over its latent cache).
@pytest.mark.parametrize(
    "family", ["deepseek_v3", "gemma3", "gpt_oss", "llama4", "mistral", "qwen3"]
)
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_pallas_kernels_inside_the_model(family, platform, tmp_path):
    attention, update = (mla_kernels if family == "deepseek_v3" else kernels)(platform)
    kwargs = {
        "attention_fn": functools.partial(attention, interpret=True),
        "update_fn": functools.partial(update, interpret=True),
    }
    check_family(family, tmp_path, attention_kwargs=kwargs)


def check_family(family, tmp_path, attention_kwargs=None):
    """Greedy decode through the paged cache; every step's logits within 1e-4."""
    torch.manual_seed(0)
    hf_config = FAMILIES[family]()
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    PREPARE.get(family, lambda model: None)(hf_model)
    shard = "40KB" if family == "llama" else "1GB"  # one family loads a sharded checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size=shard)

    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), LoadConfig())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in PROMPT_LENS]
    module = loaded.module
    if attention_kwargs is not None:
        module = module.clone(attention_kwargs=attention_kwargs)
    loop = GreedyLoop(module, loaded.config, loaded.params, page_size=4)
    outputs, step_logits = loop.generate(prompts, DECODE_STEPS, return_logits=True)

    seqs = [list(p) for p in prompts]
    for step in range(DECODE_STEPS):
        want = reference_logits(hf_model, seqs)
        for r, ref in enumerate(want):
            got = step_logits[step][r]
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            assert rel < 1e-4, f"{family}: step {step}, request {r}: relative error {rel:.2e}"
            seqs[r].append(outputs[r][step])
