"""Random PEFT LoRA adapters for tests, made with `peft` on a transformers model.

``init_lora_weights=False`` draws B at random too, so an adapter changes the output.
`make_adapter` returns the PEFT model as well: the reference for that adapter.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base,
    out_dir: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    scale: float = 1.0,
):
    """Writes a random adapter for ``base`` (a transformers model, left as it is) to
    ``out_dir``; returns the PEFT model (a copy of ``base`` with the adapter).
    ``scale`` multiplies B (larger deltas make adapters' outputs differ sooner)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.eval()
    model.save_pretrained(str(out_dir))
    return model
