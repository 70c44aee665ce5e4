"""Gated MLP (gate/up/down) and a sparse mixture of experts with grouped matmuls."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers import quant
from jaxengine.models.layers.basic import Linear, _normal, activation, quantized_params
from jaxengine.models.layers.config import TransformerConfig


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF names gate_proj, up_proj, down_proj.

    With ``config.fused_projections`` gate and up are one ``gate_up_proj`` of rows
    ``[gate; up]`` (concatenated by the loader); its ``mlp`` axis is right only
    unsplit (tensor size 1), which is when the loader fuses.
    """

    config: TransformerConfig
    intermediate_size: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        cfg = self.config  # x: [T, H] -> [T, H]; lora_slots: `layers.lora`
        width = self.intermediate_size or cfg.intermediate_size

        def proj(rows: int, name: str) -> jax.Array:
            return Linear(
                rows, ("mlp", "embed"), cfg.mlp_bias, cfg.dtype, cfg.quantization, cfg.lora,
                name=name, weight_dtype=cfg.matmul_dtype,
            )(x, lora_slots)  # fmt: skip

        if cfg.fused_projections:  # rows [gate; up], one matmul, split after
            gate, up = jnp.split(proj(2 * width, "gate_up_proj"), 2, axis=-1)  # [T, I] each
        else:
            gate, up = proj(width, "gate_proj"), proj(width, "up_proj")
        hidden = activation(cfg.hidden_act)(gate) * up  # [T, I]
        down = Linear(
            cfg.hidden_size,
            ("embed", "mlp"),
            cfg.mlp_bias,
            cfg.dtype,
            cfg.quantization,
            cfg.lora,
            name="down_proj",
            weight_dtype=cfg.matmul_dtype,
        )
        return down(hidden, lora_slots)


def routed_experts(x, weights, experts, w_gate, w_up, w_down, *, act, first_expert=0, scales=None):
    """Weighted sum of the routed experts' outputs, for the experts these weights hold.

    ``x [T, H]``, ``weights``/``experts [T, K]`` (routing), stacked weights
    ``w_gate``/``w_up [E', I, H]`` and ``w_down [E', H, I]`` of experts
    ``first_expert .. first_expert + E'``. Rows are sorted by expert and each expert
    runs one `jax.lax.ragged_dot` group; routes to experts held elsewhere sort last,
    outside every group, and weigh zero. No token is dropped (no capacity limit).
    ``scales`` (quantized experts, `layers.quant`): the per-row scales ``[E', out]``
    of the three weights, applied to each row's result by its expert.
    Returns float32 ``[T, H]`` (partial sums when ``E'`` is a shard of the experts).
    """
    num_tokens, hidden = x.shape
    k, local = experts.shape[1], w_gate.shape[0]
    flat = experts.reshape(-1) - first_expert  # [T*K]
    mine = (flat >= 0) & (flat < local)
    flat = jnp.where(mine, flat, local)
    order = jnp.argsort(flat)
    token_of = order // k  # [T*K], source token of each sorted row
    dtype = w_gate.dtype if scales is None else x.dtype
    xs = x[token_of].astype(dtype)  # [T*K, H]
    group_sizes = jnp.bincount(flat, length=local + 1)[:local].astype(jnp.int32)  # [E']
    row_expert = jnp.minimum(flat[order], local - 1)  # [T*K]
    s_gate, s_up, s_down = (None, None, None) if scales is None else scales

    def expert_dot(h, w, s):  # [T*K, in] x [E', out, in] -> [T*K, out]
        y = jax.lax.ragged_dot(h, jnp.swapaxes(w, 1, 2).astype(dtype), group_sizes)
        return y if s is None else y * s[row_expert].astype(dtype)

    gate = expert_dot(xs, w_gate, s_gate)  # [T*K, I]
    up = expert_dot(xs, w_up, s_up)
    out = expert_dot(act(gate) * up, w_down, s_down)
    row_weight = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    out = jnp.where(row_weight[:, None] != 0, out.astype(jnp.float32), 0.0) * row_weight[:, None]
    return jnp.zeros((num_tokens, hidden), jnp.float32).at[token_of].add(out)


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE layout), computed with `jax.lax.ragged_dot`.

    Parameters: ``gate.weight [E, H]`` (the router) and the experts stacked on a
    leading axis: ``experts.{gate_proj,up_proj,down_proj}`` of ``[E, out, in]``. The
    expert computation is injected (``experts_fn``, `routed_experts` by default) so
    `sharding/` can run it per expert shard.
    """

    config: TransformerConfig
    experts_fn: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        cfg = self.config
        hidden = x.shape[1]
        e, k, width = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        router = Linear(e, ("expert", "embed"), False, cfg.dtype, name="gate")(x)
        probs = jax.nn.softmax(router.astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, k)  # [T, K]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)

        def stacked(name: str, shape: tuple[int, ...], axes: tuple[str, ...]):
            """The stacked weight, and its per-row scales when quantized per row.
            Grouped and int4 weights are dequantized here, to ``dtype``."""
            scheme = cfg.quantization
            if scheme is None:
                init = nn.with_logical_partitioning(_normal(), axes)
                return self.param(name, init, shape, cfg.dtype), None
            leaves = quantized_params(self, name, shape, axes, scheme)
            if scheme.group_size or scheme.has_offset:
                return quant.dequantize(leaves, scheme).astype(cfg.dtype), None
            return leaves[""], leaves["_scale"]

        w_gate, s_gate = stacked(
            "experts_gate_proj", (e, width, hidden), ("expert", "mlp", "embed")
        )
        w_up, s_up = stacked("experts_up_proj", (e, width, hidden), ("expert", "mlp", "embed"))
        w_down, s_down = stacked(
            "experts_down_proj", (e, hidden, width), ("expert", "embed", "mlp")
        )
        scales = None if s_gate is None else (s_gate, s_up, s_down)
        fn = self.experts_fn or routed_experts
        act = activation(cfg.hidden_act)
        out = fn(x, weights, experts, w_gate, w_up, w_down, act=act, scales=scales)
        return out.astype(x.dtype)
