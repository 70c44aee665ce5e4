"""Qwen3-Next and Qwen3.5 (text): hybrid decoders of Gated DeltaNet layers and gated
full-attention layers (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``).

``config.layer_types`` names each layer's token mixer: ``linear_attention``, a Gated
DeltaNet (`layers.gated_delta`, whose cache entry is its per-request state pools), or
``full_attention``: grouped-query attention over the paged cache with zero-centred
QK norms, partial rotary and an output gate, ``o_proj(attn * sigmoid(gate))``, where
the checkpoint's ``q_proj`` holds each head's query and gate rows side by side (split
at load time into ``q_proj`` and ``q_gate``). Every RMS norm but the DeltaNet's gated
one multiplies by ``1 + weight``. Feed-forward: a dense MLP, or (Qwen3-Next,
Qwen3.5-MoE) softmax top-k experts plus a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. Text rotary only: Qwen3.5's M-RoPE sections
coincide with plain rope for text positions (`qwen3_5_vl` turns them on for images).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxengine.models import glm4_moe, llama
from jaxengine.models.layers.attention import _position_terms, _project_qkv
from jaxengine.models.layers.basic import Linear, RMSNorm
from jaxengine.models.layers.config import LayerSpec, TransformerConfig
from jaxengine.models.layers.decoder import CausalLM, DecoderLayer, hf_param_path
from jaxengine.models.layers.gated_delta import GatedDeltaNet, GatedDeltaSpec
from jaxengine.models.layers.mlp import GatedMLP, SparseMoE
from pallas_kernels.kv_cache_update import reference as kv_update
from pallas_kernels.ragged_paged_attention import reference


@dataclasses.dataclass(frozen=True)
class HybridLayerSpec(LayerSpec):
    """A layer of a hybrid model: `LayerSpec` plus its token mixer."""

    linear: bool = False
    """A Gated DeltaNet layer (``linear_attention``); False: gated full attention."""


@dataclasses.dataclass(frozen=True)
class Qwen3NextSpec:
    """The family's settings beyond `TransformerConfig` (``config.family_spec``)."""

    gated_delta: GatedDeltaSpec
    """Shapes of the Gated DeltaNet layers (and of their state pools)."""
    shared_expert_size: int = 0
    """Width of the sigmoid-gated shared expert of each MoE layer; 0: none."""


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Qwen3NextConfig, Qwen3_5TextConfig or
    Qwen3_5MoeTextConfig."""
    if not getattr(hf_config, "intermediate_size", None):  # Qwen3.5-MoE: experts only
        hf_config = _with(hf_config, intermediate_size=hf_config.moe_intermediate_size)
    base = llama.from_hf(hf_config, dtype)
    rope = dataclasses.replace(base.layers[0].rope, mrope_section=None)
    num_experts = getattr(hf_config, "num_experts", 0) or 0
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    layers = tuple(
        HybridLayerSpec(
            rope=rope,
            linear=kind == "linear_attention",
            moe=num_experts > 0 and i not in dense and (i + 1) % step == 0,
        )
        for i, kind in enumerate(hf_config.layer_types[: hf_config.num_hidden_layers])
    )
    gdn = GatedDeltaSpec(
        num_k_heads=hf_config.linear_num_key_heads,
        num_v_heads=hf_config.linear_num_value_heads,
        head_k_dim=hf_config.linear_key_head_dim,
        head_v_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
    )
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    return dataclasses.replace(
        base,
        layers=layers,
        norm_offset=1.0,
        qk_norm=True,
        num_experts=num_experts,
        num_experts_per_tok=getattr(hf_config, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(hf_config, "moe_intermediate_size", 0) or 0,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        family_spec=Qwen3NextSpec(gdn, shared if num_experts else 0),
    )


def _with(hf_config: Any, **fields: Any) -> Any:
    """A copy of ``hf_config`` with ``fields`` set."""
    import copy

    out = copy.copy(hf_config)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: q/k/v with zero-centred QK norms and (partial)
    rope, paged attention, then ``o_proj(out * sigmoid(q_gate(x)))``."""

    config: TransformerConfig
    spec: LayerSpec
    attention_fn: Callable[..., jax.Array] = reference.ragged_paged_attention
    update_fn: Callable[..., jax.Array] = kv_update.update_kv_cache

    @nn.compact
    def __call__(self, x, positions, kv_cache, md):
        cfg = self.config
        num_tokens, width = x.shape[0], cfg.num_heads * cfg.head_dim
        lin = dict(dtype=cfg.dtype, weight_dtype=cfg.matmul_dtype)
        q, k, v = _project_qkv(x, cfg, md.lora_slots)  # [T, Hq, D], [T, Hkv, D] x 2
        gate = Linear(width, ("q_heads", "embed"), name="q_gate", **lin)(x)  # [T, Hq*D]
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
        q = RMSNorm(**norm, axis_name="head_dim", name="q_norm")(q)
        k = RMSNorm(**norm, axis_name="head_dim", name="k_norm")(k)
        q, k = _position_terms(q, k, positions, self.spec, md, cfg.rms_norm_eps)
        kv_cache = self.update_fn(kv_cache, k, v, md.slot_mapping)
        out = self.attention_fn(
            q, kv_cache, md.seq_lens, md.page_table, md.query_start_loc, md.num_seqs,
            sm_scale=cfg.scale, sliding_window=None, soft_cap=None,
        )  # fmt: skip
        out = out.reshape(num_tokens, width) * jax.nn.sigmoid(gate.astype(out.dtype))
        o_proj = Linear(cfg.hidden_size, ("embed", "q_heads"), cfg.o_bias, name="o_proj", **lin)
        return o_proj(out.astype(x.dtype)), kv_cache


class Qwen3NextDecoderLayer(DecoderLayer):
    """``x + mixer(norm(x))`` then ``x + ffn(norm(x))``; the mixer is ``linear_attn``
    (Gated DeltaNet, its cache the state pools) or ``self_attn`` (`GatedAttention`).
    ``attention_kwargs``: the attention functions, and the backend's
    ``gated_delta_fn`` and ``state_write_fn``, which go to the Gated DeltaNet."""

    @nn.compact
    def __call__(self, x, positions, cache, md):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
        h = RMSNorm(**norm, name="input_layernorm")(x)
        kwargs = dict(self.attention_kwargs or {})
        names = ("gated_delta_fn", "state_write_fn")  # the backend's; absent: the reference
        fns = {n: f for n in names if (f := kwargs.pop(n, None)) is not None}
        if self.spec.linear:
            gdn = cfg.family_spec.gated_delta
            h, cache = GatedDeltaNet(cfg, gdn, **fns, name="linear_attn")(h, cache, md)
        else:
            attn = GatedAttention(cfg, self.spec, **kwargs, name="self_attn")
            h, cache = attn(h, positions, cache, md)
        x = x + h
        h = RMSNorm(**norm, name="post_attention_layernorm")(x)
        return x + self.feed_forward(h, md), cache

    def feed_forward(self, h: jax.Array, md: Any) -> jax.Array:
        """Dense ``mlp``, or ``mlp`` experts plus the gated ``shared_expert``."""
        cfg, shared = self.config, self.config.family_spec.shared_expert_size
        if not self.spec.moe:
            return GatedMLP(cfg, name="mlp")(h, md.lora_slots)
        out = SparseMoE(cfg, **(self.moe_kwargs or {}), name="mlp")(h)
        if shared:
            expert = GatedMLP(cfg, shared, name="shared_expert")(h)
            gate = Linear(1, (None, "embed"), name="shared_expert_gate", dtype=cfg.dtype)(h)
            out = out + (jax.nn.sigmoid(gate) * expert).astype(out.dtype)
        return out


_RENAMES = ((".mlp.shared_expert_gate.", ".shared_expert_gate."),)
_RENAMES += ((".mlp.shared_expert.", ".shared_expert."),)
_SKIPPED_PREFIXES = ("mtp.", "model.visual.")


class Qwen3NextForCausalLM(CausalLM):
    """`CausalLM` of `Qwen3NextDecoderLayer`s configured by `from_hf`."""

    layer_cls: Any = Qwen3NextDecoderLayer

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """The shared expert and its gate sit beside ``mlp`` (``shared_expert``,
        ``shared_expert_gate``); multi-token-prediction and vision tensors are skipped."""
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return hf_param_path(name)

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, np.ndarray]], config: TransformerConfig
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Fused experts split per expert (`glm4_moe`), ``q_proj`` into query and gate
        rows, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` into Qwen3.5's
        ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
        spec = config.family_spec.gated_delta
        for name, array in glm4_moe.Glm4MoeForCausalLM.split_tensors(tensors, config):
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            if ".self_attn.q_proj." in name:
                per_head = array.reshape(config.num_heads, 2, config.head_dim, *array.shape[1:])
                yield name, per_head[:, 0].reshape(-1, *array.shape[1:])
                yield (
                    name.replace(".q_proj.", ".q_gate."),
                    per_head[:, 1].reshape(-1, *array.shape[1:]),
                )
            elif name.endswith(".in_proj_qkvz.weight"):
                yield from _split_qkvz(name, array, spec)
            elif name.endswith(".in_proj_ba.weight"):
                ba = array.reshape(spec.num_k_heads, 2, -1, array.shape[-1])  # [Hk, 2, r, H]
                prefix = name.removesuffix("in_proj_ba.weight")
                yield prefix + "in_proj_b.weight", ba[:, 0].reshape(-1, array.shape[-1])
                yield prefix + "in_proj_a.weight", ba[:, 1].reshape(-1, array.shape[-1])
            else:
                yield name, array


def _split_qkvz(name: str, array: np.ndarray, spec: GatedDeltaSpec):
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads' v, then z)
    as ``in_proj_qkv`` (all q, all k, all v) and ``in_proj_z``."""
    hidden, ratio = array.shape[-1], spec.num_v_heads // spec.num_k_heads
    dk, dv = spec.head_k_dim, spec.head_v_dim
    groups = array.reshape(spec.num_k_heads, -1, hidden)  # [Hk, 2Dk + 2rDv, H]
    q, k, v, z = np.split(groups, np.cumsum([dk, dk, ratio * dv]), axis=1)
    prefix = name.removesuffix("in_proj_qkvz.weight")
    flat = [x.reshape(-1, hidden) for x in (q, k, v, z)]
    yield prefix + "in_proj_qkv.weight", np.concatenate(flat[:3], axis=0)
    yield prefix + "in_proj_z.weight", flat[3]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):  # noqa: N801 - the checkpoint's name
    """Qwen3.5 (dense): the same layers, Qwen3.5's checkpoint names."""


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):  # noqa: N801 - the checkpoint's name
    """Qwen3.5-MoE: the same layers, every MLP experts plus a shared expert."""
