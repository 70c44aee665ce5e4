"""gpt-oss family (``GptOssForCausalLM``): attention sinks, alternating sliding-window
and full attention, and a mixture of experts with biases and a clamped SwiGLU in every
layer.

Each layer is ``x + attn(norm(x))`` then ``x + moe(norm(x))`` (the shared
`layers.decoder.DecoderLayer`). Attention: grouped-query heads with a bias on q, k, v
and o (``attention_bias``), YaRN rope (``rope_parameters``, whose ``truncate: false``
keeps the ramp's ends fractional, `layers.rope`), a ``sliding_window`` on the layers
``layer_types`` marks ``sliding_attention`` (every other one), and per-head attention
sinks ``self_attn.sinks [Hq]``: one more logit in each softmax that takes probability
mass and gives no value (`TransformerConfig.attention_sinks`; every attention kernel
takes them).

MoE (`layers.mlp.SparseMoE`): a router with a bias; each token's top
``num_experts_per_tok`` logits, softmaxed among themselves (the same weights as a
softmax over all experts renormalized over the chosen ones); experts of width
``intermediate_size`` with biases, activated by the clamped SwiGLU
(``swiglu_alpha``, ``swiglu_limit``: `layers.mlp.clamped_swiglu`).

Checkpoint layout (transformers 5.x, float weights): the router is ``mlp.router``
(mapped to the layer's ``mlp.gate``); the experts are fused tensors
``mlp.experts.gate_up_proj [E, H, 2I]`` whose columns interleave gate and up (gate at
even columns), ``gate_up_proj_bias [E, 2I]`` (the same interleaving),
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``. `GptOssForCausalLM.split_tensors`
cuts them at load into the shared stacked experts ``experts_{gate,up,down}_proj``
(and ``_bias [E, out]``), handed on as every checkpoint's experts are, ``[E, out, in]``
views; the loader stores them ``[E, in, out]`` (`layers.mlp`), the fused tensors'
own layout, so the two swaps cancel and nothing is copied but each column half.

MXFP4 checkpoints (``quant_method: mxfp4``, the published ones) store the expert
weights as ``gate_up_proj_blocks [E, 2I, H / 32, 16]`` and ``gate_up_proj_scales
[E, 2I, H / 32]`` (rows already ``[out, in]``, gate at even rows), ``down_proj_blocks
[E, H, I / 32, 16]`` and ``down_proj_scales`` (`loader.mxfp4`); their rows are cut the
same way into the stacked ``mxfp4`` leaves, which the loader stores transposed
(`layers.quant.transposed`): ``experts_*_proj`` (uint8 ``[E, in / 2, out]``, each byte
still two consecutive input columns) and ``experts_*_proj_scale`` (uint8 ``[E, in / 32,
out]``), bytes unchanged; the step dequantizes them straight into ``[E, in, out]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxengine.models import llama
from jaxengine.models.layers.config import LayerSpec, TransformerConfig, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM, hf_param_path

_EXPERTS = ".mlp.experts."


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a GptOssConfig."""
    base = llama.from_hf(hf_config, dtype)  # vocab, sizes, heads, norms
    rope = rope_from_hf(hf_config)
    window = hf_config.sliding_window
    layers = tuple(
        LayerSpec(rope=rope, sliding_window=window if t == "sliding_attention" else None, moe=True)
        for t in hf_config.layer_types
    )
    bias = bool(getattr(hf_config, "attention_bias", True))
    return dataclasses.replace(
        base,
        layers=layers,
        hidden_act="silu",  # unused: the experts' clamped SwiGLU takes its place
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        num_experts=hf_config.num_local_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.intermediate_size,
        norm_topk_prob=True,  # softmax over the chosen logits
        router_bias=True,
        expert_bias=True,
        swiglu_clamp=(float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)),
    )


def _expert_tensors(prefix: str, leaf: str, array: np.ndarray) -> Iterator[tuple[str, Any]]:
    """One fused expert tensor (``leaf`` under ``prefix``, `_EXPERTS` stripped) as the
    shared stacked experts' checkpoint tensors: ``[E, out, in]`` weights (views, which
    the loader swaps back), ``[E, out]`` biases."""
    if leaf == "gate_up_proj":  # [E, H, 2I], gate at even columns
        for name, cols in (("gate", array[..., 0::2]), ("up", array[..., 1::2])):
            yield f"{prefix}.mlp.experts_{name}_proj", cols.transpose(0, 2, 1)
    elif leaf == "gate_up_proj_bias":  # [E, 2I]
        yield f"{prefix}.mlp.experts_gate_proj_bias", np.ascontiguousarray(array[:, 0::2])
        yield f"{prefix}.mlp.experts_up_proj_bias", np.ascontiguousarray(array[:, 1::2])
    elif leaf == "down_proj":  # [E, I, H]
        yield f"{prefix}.mlp.experts_down_proj", array.transpose(0, 2, 1)
    elif leaf == "down_proj_bias":  # [E, H]
        yield f"{prefix}.mlp.experts_down_proj_bias", array
    elif leaf.endswith(tuple(_MXFP4_PARTS)):
        yield from _mxfp4_tensors(prefix, leaf, array)
    else:
        raise ValueError(f"unsupported gpt-oss expert tensor {prefix}{_EXPERTS}{leaf}")


_MXFP4_PARTS = {"_blocks": "", "_scales": "_scale"}
"""An MXFP4 tensor's suffix -> its stacked leaf's (`layers.quant` ``mxfp4``)."""


def _mxfp4_tensors(prefix: str, leaf: str, array: np.ndarray) -> Iterator[tuple[str, Any]]:
    """An MXFP4 expert tensor (module docstring) as its stacked ``mxfp4`` leaves'
    checkpoint tensors (views, which the loader stores transposed): blocks ``[E, out,
    G, 16]`` -> ``[E, out, G * 16]`` packed bytes, scales ``[E, out, G]``."""
    proj, suffix = next(
        (leaf.removesuffix(p), s) for p, s in _MXFP4_PARTS.items() if leaf.endswith(p)
    )
    rows = array.reshape(*array.shape[:2], -1) if suffix == "" else array  # [E, out, bytes or G]
    if proj == "gate_up_proj":  # gate at even rows, up at odd ones
        yield f"{prefix}.mlp.experts_gate_proj{suffix}", rows[:, 0::2]
        yield f"{prefix}.mlp.experts_up_proj{suffix}", rows[:, 1::2]
    elif proj == "down_proj":
        yield f"{prefix}.mlp.experts_down_proj{suffix}", rows
    else:
        raise ValueError(f"unsupported gpt-oss expert tensor {prefix}{_EXPERTS}{leaf}")


class GptOssForCausalLM(CausalLM):
    """`CausalLM` configured by `from_hf`, with gpt-oss's checkpoint names and fused
    expert tensors (module docstring)."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``...mlp.router.*`` -> the MoE layer's router ``mlp.gate.*``; the rest (the
        split experts, ``self_attn.sinks``) as `hf_param_path`."""
        return hf_param_path(name.replace(".mlp.router.", ".mlp.gate."))

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, Any]], config: TransformerConfig
    ) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` pairs with each fused expert tensor cut into the stacked
        ``experts_*_proj`` weights and biases (`_expert_tensors`); the rest pass through."""
        del config  # the layout is the same for every config
        for name, array in tensors:
            prefix, sep, leaf = name.partition(_EXPERTS)
            if not sep:
                yield name, array
                continue
            yield from _expert_tensors(prefix, leaf, np.asarray(array))
