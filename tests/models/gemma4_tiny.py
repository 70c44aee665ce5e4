"""Tiny Gemma 4 text models (``Gemma4ForCausalLM``) for the golden and engine tests.

Two shapes, on a test's own tiny base (``small``: vocabulary, hidden size, heads):

- `gemma4_tiny`: the small checkpoints' shape (E2B / E4B): per-layer inputs, the last
  layers sharing the KV of earlier ones (both kinds shared) with a double-wide MLP,
  sliding and full layers of different head widths;
- `gemma4_moe_tiny`: the 26B-A4B's shape: the MoE block beside the dense MLP in every
  layer, full layers with ``attention_k_eq_v`` and fewer KV heads than the sliding ones.

transformers initializes every norm weight, ``layer_scalar``, the router's ``scale``
and ``per_expert_scale`` to one, which would let a model that ignores any of them pass;
`randomize_scales` (a model) and `randomize_saved_scales` (a saved checkpoint) move
them off one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SLIDING, FULL = "sliding_attention", "full_attention"
SCALES = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")
"""Names ending so: weights transformers starts at one (`randomize_scales`)."""


def _base(small: dict, layer_types: list[str]) -> dict:
    return {
        **small,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "head_dim": 16,
        "global_head_dim": 32,
        "sliding_window": 6,
        "final_logit_softcapping": 30.0,
        "vocab_size_per_layer_input": small["vocab_size"],
    }


def gemma4_tiny(small: dict) -> dict:
    """Gemma4TextConfig keyword arguments: five layers (sliding, full, sliding, sliding,
    full; a window of 6), the last two sharing the KV of layers 2 and 1 with a
    double-wide MLP, per-layer inputs of 8, heads of 16 (sliding) and 32 (full)."""
    return {
        **_base(small, [SLIDING, FULL, SLIDING, SLIDING, FULL]),
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
    }


def gemma4_moe_tiny(small: dict) -> dict:
    """Gemma4TextConfig keyword arguments: three layers (sliding, full, full), each with
    the dense MLP and 4 experts of 32 (top 2); full layers with one KV head whose keys
    are the values (``attention_k_eq_v``); no per-layer inputs."""
    return {
        **_base(small, [SLIDING, FULL, FULL]),
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    }


def randomize_scales(model: torch.nn.Module, std: float = 0.3, seed: int = 1) -> None:
    """Adds ``N(0, std^2)`` to every weight in `SCALES` (in place)."""
    generator = torch.Generator().manual_seed(seed)
    found = 0
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(SCALES):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * std)
                found += 1
    assert found, "no norm or scale weights"


def randomize_saved_scales(path: str | Path, std: float = 0.3, seed: int = 1) -> None:
    """`randomize_scales` on a saved single-file checkpoint (``save_tiny``'s)."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    names = sorted(name for name in tensors if name.endswith(SCALES))
    assert names, f"{file} has no norm or scale weights"
    for name in names:
        tensors[name] = tensors[name] + torch.randn(tensors[name].shape, generator=generator) * std
    save_file(tensors, file, metadata={"format": "pt"})
