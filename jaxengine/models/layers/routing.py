"""Expert routing: router logits -> each token's top-k experts and their weights.

A `RoutingSpec` (a field of `TransformerConfig`, hashable) names the variant; `route`
computes it. Every variant returns float32 ``weights [T, K]`` and int32
``experts [T, K]``, which `layers.mlp.routed_experts` consumes unchanged.

- ``softmax`` (Qwen3-MoE, Mixtral, the default): probabilities over all experts,
  the top ``K`` kept, renormalized to sum to one when ``renormalize``.
- ``sigmoid`` (GLM-4.5/4.6, DeepSeek-V3; Llama 4 with ``K = 1``): independent scores
  ``s = sigmoid(logits)``. Experts are *chosen* by ``s + bias`` where the layer holds
  an ``e_score_correction_bias`` (``correction_bias``), but *weighted* by the
  uncorrected ``s``: the bias only balances the load. With ``n_group > 1`` the choice
  is group-limited: the ``E`` experts split into ``n_group`` contiguous groups, each
  group is ranked by the sum of its two highest corrected scores, and only experts
  of the best ``topk_group`` groups are eligible. The chosen scores are renormalized
  when ``renormalize`` (GLM's and DeepSeek's ``norm_topk_prob``) and multiplied by
  ``scaling_factor`` (``routed_scaling_factor``).

Ties are broken toward the lower expert index (`jax.lax.top_k`); transformers' torch
``topk`` may break exact ties otherwise, which random weights never produce.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")
_RENORM_EPS = 1e-20  # transformers' GLM/DeepSeek denominator guard


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """How a mixture-of-experts layer turns router logits into routes (module doc)."""

    scoring: str = "softmax"
    """``softmax`` over all experts, or an independent ``sigmoid`` per expert."""
    correction_bias: bool = False
    """The layer holds ``e_score_correction_bias [E]`` (float32), added to the scores
    for choosing experts only (sigmoid scoring)."""
    n_group: int = 1
    """Expert groups for group-limited choice; 1: every expert is eligible."""
    topk_group: int = 1
    """Groups whose experts are eligible, when ``n_group > 1``."""
    scaling_factor: float = 1.0
    """Multiplies the final routing weights (``routed_scaling_factor``)."""
    float32_router: bool = False
    """The router's weight is stored, and its logits computed, in float32 whatever the
    model's dtype (transformers keeps GLM-4.5's and DeepSeek-V3's ``gate.weight`` in
    float32: a bfloat16 router can choose other experts)."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring must be one of {SCORINGS}, not {self.scoring!r}")
        if self.correction_bias and self.scoring != "sigmoid":
            raise ValueError("an expert-score correction bias needs sigmoid scoring")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"need 1 <= topk_group <= n_group, got {self.topk_group} and {self.n_group}"
            )


def route(
    logits: jax.Array,
    spec: RoutingSpec,
    k: int,
    renormalize: bool,
    correction_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(weights [T, K] float32, experts [T, K] int32)`` of router ``logits [T, E]``.

    ``correction_bias [E]`` must be given exactly when ``spec.correction_bias``.
    """
    if (correction_bias is not None) != spec.correction_bias:
        raise ValueError("correction_bias must be given exactly when the spec has one")
    logits = logits.astype(jnp.float32)
    if spec.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)  # [T, E]
        choice = scores
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if spec.n_group > 1:
        choice = _group_limited(choice, spec.n_group, spec.topk_group)
    _, experts = jax.lax.top_k(choice, k)  # [T, K]
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # [T, K], uncorrected
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + _RENORM_EPS)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return weights, experts.astype(jnp.int32)


def _group_limited(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """``choice [T, E]`` with the experts outside each token's best ``topk_group``
    groups set to -inf; a group's rank is the sum of its top-2 scores (its only
    score when groups hold one expert)."""
    num_tokens, num_experts = choice.shape
    if num_experts % n_group:
        raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
    grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    best_two, _ = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))  # [T, G, 2]
    _, groups = jax.lax.top_k(best_two.sum(axis=-1), topk_group)  # [T, topk_group]
    keep = jax.nn.one_hot(groups, n_group, dtype=jnp.int32).sum(axis=1) > 0  # [T, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
