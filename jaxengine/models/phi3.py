"""Phi-3 / Phi-4 family (`Phi3ForCausalLM`): the Llama layout with fused checkpoints.

The checkpoint stores q/k/v as one ``self_attn.qkv_proj`` (rows ``[q; k; v]``) and the
MLP's gate and up as one ``mlp.gate_up_proj`` (rows ``[gate; up]``). A model loaded
with `TransformerConfig.fused_projections` (tensor size 1) holds exactly those
leaves, so they load as they are; otherwise (tensor parallelism splits q, k, v and
gate, up separately) `Phi3ForCausalLM.split_tensors` cuts them into the shared
layers' ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` at load.

Rotary: ``partial_rotary_factor`` (Phi-4-mini rotates 3/4 of each head) and LongRoPE
(``rope_type`` "longrope": ``short_factor``/``long_factor``, the attention factor as
transformers computes it; how the factors are chosen: `layers.rope`'s docstring).
Phi-3's optional ``sliding_window`` applies to every layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxengine.models import llama
from jaxengine.models.layers.attention import qkv_rows
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import CausalLM

_FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Phi3Config (no biases; rope as `rope_from_hf`)."""
    return llama.from_hf(hf_config, dtype)


def _row_sizes(fused: str, rows: int, config: TransformerConfig) -> tuple[int, ...]:
    """The rows of each part of a fused tensor of ``rows`` rows."""
    return tuple(qkv_rows(config)) if fused == "self_attn.qkv_proj" else (rows // 2,) * 2


class Phi3ForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`; the fused checkpoint tensors split at load
    unless the model keeps them fused."""

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, Any]], config: TransformerConfig
    ) -> Iterable[tuple[str, Any]]:
        """``(name, array)`` pairs with each ``qkv_proj``/``gate_up_proj`` tensor cut into
        its parts' rows (``...self_attn.qkv_proj.weight`` -> ``...self_attn.q_proj.weight``
        and so on), unless ``config.fused_projections``: then all pass through."""
        for name, array in tensors:
            stem, _, leaf = name.rpartition(".")
            fused = next((f for f in _FUSED if stem.endswith("." + f)), None)
            if fused is None or config.fused_projections:
                yield name, array
                continue
            parent = stem.removesuffix(fused.split(".")[1])
            start = 0
            for part, rows in zip(
                _FUSED[fused], _row_sizes(fused, array.shape[0], config), strict=True
            ):
                yield f"{parent}{part}.{leaf}", array[start : start + rows]
                start += rows
