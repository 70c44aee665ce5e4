"""GLM-4.5 / GLM-4.6 family (``Glm4MoeForCausalLM``): grouped-query attention with
partial rotary, then dense MLPs for the first ``first_k_dense_replace`` layers and
mixtures of experts after.

Attention: q/k/v carry a bias when ``attention_bias`` (o_proj never does), queries and
keys are RMS-normalized over head_dim before rope when ``use_qk_norm``, and only the
first ``head_dim * partial_rotary_factor`` features of each head rotate (rotate-half
form within them).

MoE layers (`layers.mlp.SparseMoE`): ``n_routed_experts`` experts of width
``moe_intermediate_size``, routed by sigmoid scores, chosen with the
``e_score_correction_bias`` among the best ``topk_group`` of ``n_group`` expert groups,
weighted by the uncorrected scores, renormalized (``norm_topk_prob``) and scaled by
``routed_scaling_factor`` (`layers.routing`); a shared expert of width
``moe_intermediate_size * n_shared_experts`` runs on every token. DeepSeek-V3 routes
the same way.

Checkpoint names are transformers' (experts one tensor each, as published and as
transformers 5.x saves them; its in-memory fused ``experts.gate_up_proj [E, 2I, H]``
and ``experts.down_proj [E, H, I]`` are split per expert too); the router's
``mlp.gate.e_score_correction_bias`` maps to the MoE layer's own parameter, and the
multi-token-prediction layers that GLM-4.5 checkpoints append after the last decoder
layer (``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers``) are
skipped: the engine does not use them for speculation.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxengine.models import llama
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM, hf_param_path
from jaxengine.models.layers.routing import RoutingSpec

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_CORRECTION_BIAS = ".mlp.gate.e_score_correction_bias"


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Glm4MoeConfig."""
    base = llama.from_hf(hf_config, dtype)  # attention, rope (partial), norms, vocab
    first_moe = hf_config.first_k_dense_replace
    layers = tuple(
        dataclasses.replace(spec, moe=i >= first_moe) for i, spec in enumerate(base.layers)
    )
    routing = RoutingSpec(
        scoring="sigmoid",
        correction_bias=True,
        n_group=hf_config.n_group or 1,
        topk_group=hf_config.topk_group or 1,
        scaling_factor=float(hf_config.routed_scaling_factor),
        float32_router=True,
    )
    shared = hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0)
    return dataclasses.replace(
        base,
        layers=layers,
        o_bias=False,
        qk_norm=bool(getattr(hf_config, "use_qk_norm", False)),
        num_experts=hf_config.n_routed_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        routing=routing,
        shared_expert_intermediate_size=shared,
    )


class Glm4MoeForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`, with GLM-4.5's checkpoint names."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``...mlp.gate.e_score_correction_bias`` -> ``mlp.e_score_correction_bias``
        (`layers.mlp.SparseMoE`); the rest as `hf_param_path`."""
        return hf_param_path(name.replace(_CORRECTION_BIAS, ".mlp.e_score_correction_bias"))

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, np.ndarray]], config: TransformerConfig
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint's tensors without its multi-token-prediction layers (layer
        indices from ``config.num_layers`` on), fused experts split per expert."""
        for name, array in tensors:
            layer = _LAYER_INDEX.match(name)
            if layer is not None and int(layer.group(1)) >= config.num_layers:
                continue
            fused = _FUSED_EXPERTS.search(name)
            if fused is None:
                yield name, array
                continue
            prefix = name[: fused.start()] + ".mlp.experts"
            for e, expert in enumerate(array):  # [2I, H] (gate rows first) or [H, I]
                if fused.group(1) == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", expert
                else:
                    gate, up = np.split(expert, 2, axis=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
