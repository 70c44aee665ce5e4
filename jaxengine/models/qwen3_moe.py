"""Qwen3-MoE family: Qwen3 attention with sparse mixture-of-experts MLPs.

Layer ``i`` is sparse when ``num_experts > 0``, ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; other layers keep a dense MLP. Routing is a
softmax over experts, the top ``num_experts_per_tok`` kept (renormalized when
``norm_topk_prob``); experts run as grouped matmuls (`layers.mlp.SparseMoE`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxengine.models import qwen3
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Qwen3MoeConfig."""
    base = qwen3.from_hf(hf_config, dtype)
    only_dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    num_experts = hf_config.num_experts
    layers = tuple(
        dataclasses.replace(
            spec, moe=num_experts > 0 and i not in only_dense and (i + 1) % step == 0
        )
        for i, spec in enumerate(base.layers)
    )
    return dataclasses.replace(
        base,
        layers=layers,
        num_experts=num_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
    )


class Qwen3MoeForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`."""
