"""Golden tests on real weights: SmolLM2 (Q4_1) and Gemma 3 270M (Q4_K_M) GGUF files.

jaxengine's loader and forward against transformers loading the same file: greedy
tokens for SmolLM2 chat prompts, logits for Gemma 3 (K-quant dequantization).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxengine.runner.greedy_loop import GreedyLoop
from jaxengine.tokenizer import apply_chat_template
from tests.models.hf_reference import hf_from_gguf, hf_greedy_batch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
]
NEW_TOKENS = 32


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_transformers(smollm2_loaded, smollm2_hf, smollm2_tokenizer):
    prompts = [
        apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": p}])
        for p in CHAT_PROMPTS
    ]
    loop = GreedyLoop(smollm2_loaded.module, smollm2_loaded.config, smollm2_loaded.params)
    ours = loop.generate(prompts, NEW_TOKENS)
    assert ours == hf_greedy_batch(smollm2_hf, prompts, NEW_TOKENS)


@pytest.mark.slow
def test_gemma3_kquant_logits_match_transformers(gemma3_gguf, reference_cache_dir):
    from jaxengine.config import LoadConfig, ModelConfig
    from jaxengine.loader import load_model
    from jaxengine.tokenizer import get_tokenizer

    loaded = load_model(ModelConfig(model=str(gemma3_gguf)), LoadConfig())
    tokenizer = get_tokenizer(gemma3_gguf)
    hf = hf_from_gguf(gemma3_gguf, reference_cache_dir)
    texts = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3,"]
    prompts = [tokenizer.encode(t) for t in texts]
    loop = GreedyLoop(loaded.module, loaded.config, loaded.params)
    outputs, step_logits = loop.generate(prompts, 3, return_logits=True)
    for r, prompt in enumerate(prompts):
        seq = list(prompt)
        for step in range(3):
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0, -1].numpy()
            got = step_logits[step][r]
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            assert rel < 1e-4, f"prompt {r}, step {step}: relative error {rel:.2e}"
            seq.append(outputs[r][step])
