"""Llama 4 beyond the shared golden test (`test_golden_tiny.py`'s ``llama4``): the layer
specs read from a config, and the text decoder of a vision-language checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from jaxengine.config import LoadConfig, ModelConfig
from jaxengine.loader import load_model
from jaxengine.models import llama4
from jaxengine.runner.greedy_loop import GreedyLoop
from tests.models.test_golden_tiny import FAMILIES, PROMPT_LENS, SMALL


def test_layer_specs_follow_the_config():
    """Rope layers are chunked with the weightless QK norm; the NoPE layer is global
    with attention temperature; MoE where ``moe_layers`` says; widths swapped in."""
    config = llama4.from_hf(FAMILIES["llama4"](), np.float32)
    kinds = [
        (s.use_rope, s.attention_chunk_size, s.qk_l2_norm, s.attn_temperature, s.moe)
        for s in config.layers
    ]
    assert kinds == [
        (True, 8, True, None, False),
        (True, 8, True, None, True),
        (True, 8, True, None, True),
        (False, None, False, (4.0, 0.5), True),
    ]
    assert all(s.rope.interleaved for s in config.layers)
    assert (config.intermediate_size, config.moe_intermediate_size) == (80, 96)
    assert config.routing.scoring == "sigmoid"


def test_conditional_generation_text_decoder(tmp_path):
    """``Llama4ForConditionalGeneration``: the ``language_model.`` tensors load (the
    vision tower's are skipped) and its text-only logits match transformers'."""
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32,
    )  # fmt: skip
    text = FAMILIES["llama4"]()
    hf_config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    hf_model = transformers.Llama4ForConditionalGeneration(hf_config).float().eval()
    hf_model.save_pretrained(tmp_path)

    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), LoadConfig())
    assert isinstance(loaded.module, llama4.Llama4ForConditionalGeneration)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in PROMPT_LENS]
    loop = GreedyLoop(loaded.module, loaded.config, loaded.params, page_size=4)
    _, step_logits = loop.generate(prompts, 1, return_logits=True)
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            # its language model: transformers 5.24's text-only forward of the whole
            # model reads a field its decoder's output lacks (image_outputs)
            want = hf_model.language_model(torch.tensor([prompt])).logits[0, -1].numpy()
        rel = np.abs(step_logits[0][r] - want).max() / np.abs(want).max()
        assert rel < 1e-4, f"request {r}: relative error {rel:.2e}"
