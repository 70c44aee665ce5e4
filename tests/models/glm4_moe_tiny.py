"""A tiny GLM-4.5 (``Glm4MoeForCausalLM``) for the golden and engine tests.

transformers initializes the router's ``e_score_correction_bias`` to zeros, which
would let a model that ignores the bias (or weights experts by the corrected scores)
pass; these helpers give it random values, of the order of the spread of the router's
sigmoid scores, so the bias changes which experts are chosen.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BIAS_NAME = "mlp.gate.e_score_correction_bias"


def glm4_moe_tiny(small: dict) -> dict:
    """Glm4MoeConfig keyword arguments from a tiny base (``small``: vocab, hidden,
    heads, ...): one dense layer then MoE layers of 8 experts in 4 groups of which 2
    are eligible, 3 routed experts per token, one shared expert, q/k/v bias, QK-norm,
    half of each head rotating, renormalized and scaled routing weights."""
    return {
        **small,
        "num_hidden_layers": max(3, small.get("num_hidden_layers", 3)),
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    }


def randomize_correction_bias(model: torch.nn.Module, std: float = 0.05, seed: int = 1) -> int:
    """Draws every MoE layer's ``e_score_correction_bias`` (in place) from
    ``N(0, std^2)``; returns how many layers it changed."""
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    for name, buffer in model.named_buffers():
        if name.endswith(BIAS_NAME):
            with torch.no_grad():
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * std)
            changed += 1
    assert changed, "the model has no e_score_correction_bias"
    return changed


def randomize_saved_correction_bias(path: str | Path, std: float = 0.2, seed: int = 1) -> None:
    """`randomize_correction_bias` on a saved single-file checkpoint (``save_tiny``'s)."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    names = sorted(name for name in tensors if name.endswith(BIAS_NAME))
    assert names, f"{file} has no e_score_correction_bias"
    for name in names:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * std
    save_file(tensors, file, metadata={"format": "pt"})
