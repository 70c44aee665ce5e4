"""Mixtral family: Mistral attention with a top-2 mixture of experts in every layer.

Each layer's MLP is a `layers.mlp.SparseMoE`: a softmax over ``num_local_experts``
router logits, the top ``num_experts_per_tok`` kept and renormalized to sum to one
(Mixtral always renormalizes), each expert a SwiGLU of width ``intermediate_size``.
The router's training-time jitter noise does not apply at inference. Attention is
Mistral's (grouped-query, rope, an optional ``sliding_window``).

Checkpoint names (as transformers 5.x saves them) map onto the shared layers:
``block_sparse_moe.gate`` is the router ``mlp.gate``, and expert ``N``'s ``w1`` /
``w3`` / ``w2`` are row ``N`` of the stacked ``experts_gate_proj`` / ``experts_up_proj``
/ ``experts_down_proj``: the Qwen3-MoE layout, so `sharding/` places Mixtral's
experts (the ``expert`` axis) as it places Qwen3-MoE's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxengine.models import llama
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM, hf_param_path

_EXPERT_WEIGHTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a MixtralConfig: every layer sparse."""
    base = llama.from_hf(hf_config, dtype)
    return dataclasses.replace(
        base,
        layers=tuple(dataclasses.replace(spec, moe=True) for spec in base.layers),
        num_experts=hf_config.num_local_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.intermediate_size,
        norm_topk_prob=True,
    )


def _renamed(name: str) -> str:
    """A Mixtral tensor name in the shared layers' (Qwen3-MoE's) naming."""
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_EXPERT_WEIGHTS[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


class MixtralForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`, with Mixtral's checkpoint names."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``...block_sparse_moe.experts.5.w1.weight`` -> the stacked
        ``experts_gate_proj`` at index 5 (w3: up, w2: down); the router
        ``block_sparse_moe.gate`` -> ``mlp.gate``; the rest as `hf_param_path`."""
        return hf_param_path(_renamed(name))
