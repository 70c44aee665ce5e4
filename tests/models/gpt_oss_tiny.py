"""A tiny gpt-oss for the golden and engine tests, and the sinks and biases they set.

transformers initializes the sinks from ``N(0, initializer_range^2)`` (at the default
0.02 they take almost no probability mass) and the attention and expert biases to
zero, so a model that ignored any of them would still pass. The tests draw them
(`randomize_sinks_and_biases` before saving, `randomize_saved` after).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

SINKS_NAME = "self_attn.sinks"


def gpt_oss_tiny(small: dict, **overrides) -> dict:
    """GptOssConfig keyword arguments on the shared tiny sizes ``small``: three layers
    (sliding, full, sliding; a window of 6, shorter than the longer prompts), 16-wide
    heads, 8 experts of width 32 with 4 per token (gpt-oss's k), YaRN with
    ``truncate: false`` and eager attention (the reference with sinks)."""
    kwargs = {
        **small,
        "num_hidden_layers": 3,
        "intermediate_size": 32,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 4,
        "sliding_window": 6,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        "attn_implementation": "eager",
    }
    return {**kwargs, **overrides}


def _std(name: str, sinks_std: float, bias_std: float) -> float | None:
    """The draw's scale for tensor ``name``: sinks, biases (attention, router, experts),
    or None for the rest."""
    if name.endswith(SINKS_NAME):
        return sinks_std
    return bias_std if name.endswith("bias") else None


def randomize_sinks_and_biases(
    model: torch.nn.Module, sinks_std: float = 1.5, bias_std: float = 0.05, seed: int = 1
) -> int:
    """Draws every sink and bias of ``model`` (in place) from ``N(0, std^2)``; returns
    how many tensors it changed."""
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    for name, param in model.named_parameters():
        std = _std(name, sinks_std, bias_std)
        if std is not None:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            changed += 1
    assert changed, "the model has no sinks or biases"
    return changed


def _rewrite(path: str | Path, draw) -> None:
    """Replaces each tensor of the checkpoint in ``path`` for which ``draw(name,
    array)`` returns an array."""
    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    changed = 0
    for name, array in tensors.items():
        new = draw(name, array)
        if new is not None:
            tensors[name] = np.asarray(new, array.dtype).reshape(array.shape)
            changed += 1
    assert changed, "nothing to rewrite in the checkpoint"
    save_file(tensors, file, metadata={"format": "pt"})


def randomize_saved(path: str | Path, sinks_std: float = 1.5, bias_std: float = 0.2) -> None:
    """Redraws the sinks and biases of the checkpoint saved in ``path`` (seed 1)."""
    rng = np.random.default_rng(1)

    def draw(name, array):
        std = _std(name, sinks_std, bias_std)
        return None if std is None else rng.standard_normal(array.shape) * std

    _rewrite(path, draw)


def set_saved_sinks(path: str | Path, value: float) -> None:
    """Sets every sink of the checkpoint saved in ``path`` to ``value``."""
    _rewrite(path, lambda name, a: np.full(a.shape, value) if name.endswith(SINKS_NAME) else None)
