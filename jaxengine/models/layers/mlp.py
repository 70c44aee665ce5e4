"""Gated MLP (gate/up/down) and a sparse mixture of experts with grouped matmuls."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.config import TransformerConfig
from jaxengine.models.layers.basic import Linear, _normal, activation


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with HF names gate_proj, up_proj, down_proj."""

    config: TransformerConfig
    intermediate_size: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        cfg = self.config
        width = self.intermediate_size or cfg.intermediate_size
        gate = Linear(width, ("mlp", "embed"), cfg.mlp_bias, cfg.dtype, name="gate_proj")(x)
        up = Linear(width, ("mlp", "embed"), cfg.mlp_bias, cfg.dtype, name="up_proj")(x)
        hidden = activation(cfg.hidden_act)(gate) * up  # [T, I]
        return Linear(cfg.hidden_size, ("embed", "mlp"), cfg.mlp_bias, cfg.dtype, name="down_proj")(
            hidden
        )


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE layout), computed with `jax.lax.ragged_dot`.

    Parameters: ``gate.weight [E, H]`` (the router) and the experts stacked on a
    leading axis: ``experts.{gate_proj,up_proj,down_proj}`` of ``[E, out, in]``. Tokens
    are sorted by expert so each expert runs one dense matmul over its group; no token
    is ever dropped (there is no capacity limit).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        cfg = self.config
        num_tokens, hidden = x.shape
        e, k, width = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        router = Linear(e, ("expert", "embed"), False, cfg.dtype, name="gate")(x)
        probs = jax.nn.softmax(router.astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, k)  # [T, K]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)

        def stacked(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
            init = nn.with_logical_partitioning(_normal(), axes)
            return self.param(name, init, shape, cfg.dtype)

        w_gate = stacked("experts_gate_proj", (e, width, hidden), ("expert", "mlp", "embed"))
        w_up = stacked("experts_up_proj", (e, width, hidden), ("expert", "mlp", "embed"))
        w_down = stacked("experts_down_proj", (e, hidden, width), ("expert", "embed", "mlp"))

        flat_expert = experts.reshape(-1)  # [T*K]
        order = jnp.argsort(flat_expert)
        token_of = order // k  # [T*K], source token of each sorted row
        xs = x[token_of].astype(cfg.dtype)  # [T*K, H]
        group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)  # [E]
        act = activation(cfg.hidden_act)
        gate = jax.lax.ragged_dot(xs, jnp.swapaxes(w_gate, 1, 2), group_sizes)  # [T*K, I]
        up = jax.lax.ragged_dot(xs, jnp.swapaxes(w_up, 1, 2), group_sizes)
        out = jax.lax.ragged_dot(act(gate) * up, jnp.swapaxes(w_down, 1, 2), group_sizes)
        out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [T*K, H]
        combined = jnp.zeros((num_tokens, hidden), jnp.float32).at[token_of].add(out)
        return combined.astype(x.dtype)
