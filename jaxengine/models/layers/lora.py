"""LoRA on the device: adapter slots per projection and the batched LoRA matmul.

A projection with LoRA holds ``lora_a [S, r, in]`` and ``lora_b [S, out, r]``: one
slot per resident adapter plus slot 0, which stays zero (the base model). Each
token carries its request's slot (``md.lora_slots``); `lora_delta` adds
``B[slot] @ A[slot] @ x`` to the projection, for every token of a mixed batch in one
fixed-shape computation. Adapters are written into slots between steps
(`runner.lora_slots`), so changing adapters never recompiles. Scaling (``alpha / r``
or rsLoRA's ``alpha / sqrt(r)``) is folded into B when an adapter is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections that can carry an adapter, by their checkpoint names."""
LORA_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """The adapter slots every target projection holds (`TransformerConfig.lora`)."""

    max_loras: int
    """Adapters one batch can mix; the stacks hold ``max_loras + 1`` slots."""
    max_rank: int
    dtype: Any = jnp.float32
    fully_sharded: bool = False
    """A's rank rows are split over the tensor axis for column-parallel projections
    (`sharding.rules`); otherwise A is whole on every device there."""

    @property
    def num_slots(self) -> int:
        return self.max_loras + 1


def lora_delta(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``[T, out]``: each token's ``B[slot] @ A[slot] @ x`` (zero for slot 0).

    ``x [T, in]``, ``slots [T]`` int32, ``a [S, r, in]``, ``b [S, out, r]``. One matmul
    against every slot's A (``[T, S*r]``, small: r is a LoRA rank), the columns of
    other slots masked to zero, then one matmul against every slot's B: dense,
    fixed-shape work that costs ``S*r*(in + out)`` per token and reads each stack
    once, which suits memory-bound decode. Accumulates in float32.
    """
    num_slots = a.shape[0]
    h = jnp.einsum("ti,sri->tsr", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    mine = slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]  # [T, S]
    h = jnp.where(mine[:, :, None], h, 0.0).astype(b.dtype)
    return jnp.einsum("tsr,sor->to", h, b, preferred_element_type=jnp.float32)


def lora_delta_reference(x, slots, a, b):
    """`lora_delta` token by token with a gather (the obvious form, for tests)."""
    a_t, b_t = a[slots], b[slots]  # [T, r, in], [T, out, r]
    h = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a_t.astype(jnp.float32))
    return jnp.einsum("tr,tor->to", h, b_t.astype(jnp.float32))


def target_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """Every projection that can carry an adapter, by checkpoint module name
    (``model.layers.3.self_attn.q_proj``), with its weight's ``(out, in)``."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, width = config.hidden_size, config.intermediate_size
    shapes = {}
    for i, spec in enumerate(config.layers):
        attn = f"model.layers.{i}.self_attn"
        shapes.update({f"{attn}.q_proj": (q, hidden), f"{attn}.k_proj": (kv, hidden),
                       f"{attn}.v_proj": (kv, hidden), f"{attn}.o_proj": (hidden, q)})  # fmt: skip
        if not spec.moe:
            mlp = f"model.layers.{i}.mlp"
            shapes.update({f"{mlp}.gate_proj": (width, hidden), f"{mlp}.up_proj": (width, hidden),
                           f"{mlp}.down_proj": (hidden, width)})  # fmt: skip
    return shapes
