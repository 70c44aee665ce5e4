"""Gemma 4's decoder layer and its parts (`models.gemma4` has the model and the map).

The layer works on ``x [T, H + L * P + S]``: the hidden states, the per-layer inputs
still to be taken (P each, this layer's first) and the shared-KV slots (`Gemma4Spec`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Linear, RMSNorm, _normal, activation
from jaxengine.models.layers.config import LayerSpec, TransformerConfig
from jaxengine.models.layers.mlp import GatedMLP, routed_experts
from jaxengine.models.layers.rope import apply_rope
from jaxengine.models.layers.routing import RoutingSpec, route
from pallas_kernels.kv_cache_update import reference as kv_update
from pallas_kernels.ragged_paged_attention import reference


@dataclasses.dataclass(frozen=True)
class Gemma4Layer:
    """One layer's attention shape and role beyond its `LayerSpec`."""

    head_dim: int
    """This layer's query/key/value width (``global_head_dim`` on full layers)."""
    num_kv_heads: int
    """This layer's KV heads (divides the cache's, `TransformerConfig.num_kv_heads`)."""
    mlp_width: int
    """Dense MLP width (doubled on KV-sharing layers with ``use_double_wide_mlp``)."""
    k_eq_v: bool = False
    """No ``v_proj``: the values are the key projection's output (``attention_k_eq_v``)."""
    kv_role: str | None = None
    """``store``: puts its keys and values into its kind's slot of ``x``; ``reuse``: takes
    them from there (computes none); None: neither."""
    slot: int = 0
    """Offset of its kind's slot in the shared-KV columns (``store`` / ``reuse``)."""


@dataclasses.dataclass(frozen=True)
class Gemma4Spec:
    """`TransformerConfig.family_spec` of a Gemma 4 model."""

    layers: tuple[Gemma4Layer, ...]
    per_layer_input_size: int = 0
    """P: each layer's per-layer input width (``hidden_size_per_layer_input``); 0: none."""
    per_layer_vocab_size: int = 0
    """Rows of ``embed_tokens_per_layer`` (``vocab_size_per_layer_input``)."""
    shared_kv_width: int = 0
    """S: the shared-KV columns of ``x`` (every shared kind's keys and values)."""
    image_pad_token_id: int = 0
    """The token whose per-layer table row an image token takes (``pad_token_id``)."""

    @property
    def per_layer_width(self) -> int:
        return len(self.layers) * self.per_layer_input_size


def _unit_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight over the last axis, in float32 (the value norm)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _cache_layout(k: jax.Array, v: jax.Array, cfg: TransformerConfig) -> tuple[jax.Array, ...]:
    """``[T, h, d]`` keys and values as the cache holds every layer's: each head repeated
    to ``num_kv_heads`` (query head ``i`` still reads its own), ``d`` zero-padded to
    ``head_dim``."""
    repeat, pad = cfg.num_kv_heads // k.shape[1], cfg.head_dim - k.shape[2]
    out = []
    for x in (k, v):
        x = jnp.repeat(x, repeat, axis=1) if repeat > 1 else x
        out.append(jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad else x)
    return tuple(out)


class Gemma4Attention(nn.Module):
    """q/k/v/o at this layer's shape (`Gemma4Layer`) over the shared cache layout.

    Returns ``(out [T, H], kv_cache, shared [T, S])``: a ``store`` layer's keys and
    values go into its slot of ``shared``; a ``reuse`` layer reads them from there."""

    config: TransformerConfig
    spec: LayerSpec
    layer: Gemma4Layer
    attention_fn: Callable[..., jax.Array] = reference.ragged_paged_attention
    update_fn: Callable[..., jax.Array] = kv_update.update_kv_cache

    @nn.compact
    def __call__(self, x, positions, kv_cache, md, shared):
        cfg, lay = self.config, self.layer
        if cfg.kv_cache_scales:
            raise NotImplementedError("an fp8 KV cache is not supported for Gemma 4 yet")
        t, hq, d = x.shape[0], cfg.num_heads, lay.head_dim
        q = self._linear(hq * d, ("q_heads", "embed"), cfg.qkv_bias, "q_proj")(x, md.lora_slots)
        q_norm = RMSNorm(cfg.rms_norm_eps, 0.0, cfg.dtype, "head_dim", name="q_norm")
        q = apply_rope(q_norm(q.reshape(t, hq, d)), positions, self.spec.rope)  # [T, Hq, d]
        width = lay.num_kv_heads * d
        if lay.kv_role == "reuse":
            kv = shared[:, lay.slot : lay.slot + 2 * width]  # [T, 2 h d]
            k, v = (p.reshape(t, lay.num_kv_heads, d) for p in jnp.split(kv, 2, axis=1))
        else:
            k, v = self._keys_values(x, positions, md)  # [T, h, d] x 2
            if lay.kv_role == "store":
                kv = jnp.concatenate([k.reshape(t, width), v.reshape(t, width)], axis=1)
                shared = jax.lax.dynamic_update_slice_in_dim(shared, kv, lay.slot, axis=1)
        kv_cache = self.update_fn(kv_cache, *_cache_layout(k, v, cfg), md.slot_mapping)
        # image tokens attend both ways in sliding layers only (transformers' Gemma 4 masks)
        both_ways = md.attend_until is not None and self.spec.sliding_window is not None
        extra = {"attend_until": md.attend_until} if both_ways else {}
        out = self.attention_fn(
            jnp.pad(q, ((0, 0), (0, 0), (0, cfg.head_dim - d))),
            kv_cache,
            md.seq_lens,
            md.page_table,
            md.query_start_loc,
            md.num_seqs,
            sm_scale=cfg.scale,
            sliding_window=self.spec.sliding_window,
            soft_cap=None,
            **extra,
        )[..., :d]  # [T, Hq, d]
        o_proj = self._linear(cfg.hidden_size, ("embed", "q_heads"), cfg.o_bias, "o_proj")
        return o_proj(out.reshape(t, hq * d), md.lora_slots), kv_cache, shared

    def _keys_values(self, x, positions, md) -> tuple[jax.Array, jax.Array]:
        """This layer's own keys (normed, rotated) and values (normed), ``[T, h, d]``."""
        cfg, lay = self.config, self.layer
        t, h, d = x.shape[0], lay.num_kv_heads, lay.head_dim
        axes = ("kv_heads" if h == cfg.num_kv_heads else None, "embed")  # repeated: whole
        k = self._linear(h * d, axes, cfg.qkv_bias, "k_proj")(x, md.lora_slots).reshape(t, h, d)
        v = k
        if not lay.k_eq_v:
            v = self._linear(h * d, axes, cfg.qkv_bias, "v_proj")(x, md.lora_slots)
            v = v.reshape(t, h, d)
        k = RMSNorm(cfg.rms_norm_eps, 0.0, cfg.dtype, "head_dim", name="k_norm")(k)
        return apply_rope(k, positions, self.spec.rope), _unit_rms(v, cfg.rms_norm_eps)

    def _linear(self, rows: int, axes: tuple, bias: bool, name: str) -> Linear:
        cfg = self.config
        return Linear(rows, axes, bias, cfg.dtype, cfg.quantization, cfg.lora, name=name,
                      weight_dtype=cfg.matmul_dtype)  # fmt: skip


class Gemma4Router(nn.Module):
    """``(weights, experts) [T, K]``: softmax top-k (renormalized) of ``proj`` over the
    weightless RMS norm of ``x`` times ``scale / sqrt(H)``, then ``per_expert_scale``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        e, h = cfg.num_experts, cfg.hidden_size
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        scale = self.param("scale", ones, (h,), cfg.dtype)
        x = _unit_rms(x, cfg.rms_norm_eps) * scale * jnp.asarray(h**-0.5, cfg.dtype)
        logits = Linear(e, ("expert", "embed"), False, cfg.dtype, name="proj")(x)  # [T, E]
        weights, experts = route(logits, RoutingSpec(), cfg.num_experts_per_tok, True)
        per_expert = self.param("per_expert_scale", ones, (e,), cfg.dtype)
        return weights * per_expert[experts].astype(jnp.float32), experts


class Gemma4Experts(nn.Module):
    """The experts as the shared stacked weights, ``experts_gate_proj`` and
    ``experts_up_proj [E, H, I]``, ``experts_down_proj [E, I, H]`` (`layers.mlp`: stored
    ``[E, in, out]``; `Gemma4ForCausalLM.split_tensors` cuts the checkpoint's fused
    ``gate_up_proj``), run by `routed_experts` (or the injected ``experts_fn``: expert
    parallelism)."""

    config: TransformerConfig
    experts_fn: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        cfg = self.config  # x: [T, H] -> float32 [T, H]
        if cfg.quantization is not None:
            raise NotImplementedError("quantized Gemma 4 experts are not supported yet")
        embed, mlp = (cfg.hidden_size, "embed"), (cfg.moe_intermediate_size, "mlp")

        def stacked(name: str, inp: tuple, out: tuple) -> jax.Array:  # [E, in, out]
            init = nn.with_logical_partitioning(_normal(), ("expert", inp[1], out[1]))
            return self.param(name, init, (cfg.num_experts, inp[0], out[0]), cfg.dtype)

        w_gate = stacked("experts_gate_proj", embed, mlp)  # [E, H, I]
        w_up = stacked("experts_up_proj", embed, mlp)
        w_down = stacked("experts_down_proj", mlp, embed)  # [E, I, H]
        fn = self.experts_fn or routed_experts
        return fn(x, weights, experts, w_gate, w_up, w_down, act=activation(cfg.hidden_act))


class Gemma4DecoderLayer(nn.Module):
    """Attention, feed-forward (dense MLP, plus the MoE block), per-layer input and
    ``layer_scalar`` on ``x [T, H + L * P + S]`` (the module docstring's layout)."""

    config: TransformerConfig
    spec: LayerSpec
    attention_kwargs: Any = None
    moe_kwargs: Any = None
    layer: Gemma4Layer | None = None

    @nn.compact
    def __call__(self, x, positions, kv_cache, md):
        cfg, fam = self.config, self.config.family_spec
        if self.layer is None:  # built by the shared `DecoderModel` (a classifier)
            raise NotImplementedError("Gemma 4 as a sequence classifier is not supported yet")
        hidden, p = cfg.hidden_size, fam.per_layer_input_size
        h, ple, shared = jnp.split(x, [hidden, hidden + fam.per_layer_width], axis=1)
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, 0.0, cfg.dtype)
        attn = Gemma4Attention(
            cfg, self.spec, self.layer, **(self.attention_kwargs or {}), name="self_attn"
        )
        a, kv_cache, shared = attn(norm(name="input_layernorm")(h), positions, kv_cache, md, shared)
        h = h + norm(name="post_attention_layernorm")(a)
        h = h + norm(name="post_feedforward_layernorm")(self._feed_forward(h, md, norm))
        if p:  # this layer's P inputs, then the next layer's first
            gate = Linear(p, ("mlp", "embed"), False, cfg.dtype, name="per_layer_input_gate")(h)
            g = activation(cfg.hidden_act)(gate) * ple[:, :p]
            g = Linear(hidden, ("embed", "mlp"), False, cfg.dtype, name="per_layer_projection")(g)
            h = h + norm(name="post_per_layer_input_norm")(g)
            ple = jnp.concatenate([ple[:, p:], ple[:, :p]], axis=1)
        ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
        h = h * self.param("layer_scalar", ones, (1,), cfg.dtype)
        return jnp.concatenate([h, ple, shared], axis=1), kv_cache

    def _feed_forward(self, h: jax.Array, md: Any, norm: Callable) -> jax.Array:
        """The dense MLP on ``pre_feedforward_layernorm(h)``; with the MoE block, its
        normed output plus the normed experts' (routed on ``h`` itself)."""
        cfg = self.config
        mlp = GatedMLP(cfg, self.layer.mlp_width, name="mlp")
        out = mlp(norm(name="pre_feedforward_layernorm")(h), md.lora_slots)
        if not self.spec.moe:
            return out
        weights, experts = Gemma4Router(cfg, name="router")(h)
        moe = Gemma4Experts(cfg, **(self.moe_kwargs or {}), name="experts")
        routed = moe(norm(name="pre_feedforward_layernorm_2")(h), weights, experts)
        routed = norm(name="post_feedforward_layernorm_2")(routed.astype(h.dtype))
        return norm(name="post_feedforward_layernorm_1")(out) + routed
