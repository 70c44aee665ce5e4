"""Gated MLP (gate/up/down) and a sparse mixture of experts with grouped matmuls
(routes from `layers.routing`, an optional shared expert).

The experts are stacked ``[E, in, out]``, the layout `jax.lax.ragged_dot` takes (a
weight stored as the checkpoint's ``[E, out, in]`` was transposed, a copy of every
expert, in every step); the loader swaps each checkpoint tensor once
(`checkpoint_transposed`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers import quant
from jaxengine.models.layers.basic import (
    Linear,
    _normal,
    activation,
    quantized_params,
    quantizes,
)
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.routing import route
from pallas_kernels.quantized_gmm import reference as gmm_reference
from pallas_kernels.quantized_gmm import tpu as gmm_tpu


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


TRANSPOSED_EXPERTS = ("experts_gate_proj", "experts_up_proj", "experts_down_proj")
"""`SparseMoE`'s stacked weights, stored ``[E, in, out]``: their checkpoint tensors'
transposes."""


def checkpoint_transposed(name: str, ndim: int) -> bool:
    """Whether the parameter leaf ``name`` of ``ndim`` dimensions holds the transpose
    (last two axes) of what a checkpoint gives for it (``[E, out, in]``, or ``[out,
    in]`` per expert): a `TRANSPOSED_EXPERTS` weight, or its grouped scales and
    offsets (`quant.transposed`; per-row ones ``[E, out]`` are not)."""
    base = next((name.removesuffix(s) for s in quant.SUFFIXES if name.endswith(s)), name)
    return base in TRANSPOSED_EXPERTS and ndim == 3


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation ``(gate, up) -> hidden``: the gate clipped above at
    ``limit``, the up projection to ``[-limit, limit]``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)`` (`TransformerConfig.swiglu_clamp`)."""

    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))

    return glu


class Mxfp4Experts(NamedTuple):
    """Stacked MXFP4 experts as stored (`layers.quant`'s transposed ``mxfp4`` leaves):
    ``packed [E, in / 2, out]`` and ``scales [E, in / 32, out]`` uint8, passed to
    `routed_experts` as they are, so the step never widens them in HBM."""

    packed: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:  # [E, in, out], as a float stack's
        return (self.packed.shape[0], 2 * self.packed.shape[1], self.packed.shape[2])


class Fp8Experts(NamedTuple):
    """Stacked block-fp8 experts as stored (`layers.quant`'s transposed grouped ``fp8``
    leaves, DeepSeek-V3's): ``values [E, in, out]`` float8_e4m3fn and ``scales [E, in
    / g, out]`` float32, ``g`` dividing ``in``; dequantized inside the grouped matmul."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:  # [E, in, out]
        return self.values.shape


QUANTIZED_EXPERTS = {
    Mxfp4Experts: (gmm_reference.mxfp4_ragged_dot, gmm_tpu.mxfp4_ragged_dot),
    Fp8Experts: (gmm_reference.fp8_ragged_dot, gmm_tpu.fp8_ragged_dot),
}
"""Experts passed as stored -> (the dequantizing reference, the Mosaic kernel) of
their grouped matmul (`pallas_kernels.quantized_gmm`)."""


def _grouped_dot(
    h: jax.Array, w: Any, group_sizes: jax.Array, dtype: Any, kernels: bool
) -> jax.Array:
    """``h``'s sorted rows times their expert's weight: `jax.lax.ragged_dot`, or for
    experts passed as stored (`QUANTIZED_EXPERTS`) their grouped matmul (with
    ``kernels``, the Mosaic kernel when lowered for TPU; the dequantizing reference
    elsewhere); rows of no expert are masked by the caller."""
    if type(w) not in QUANTIZED_EXPERTS:
        return jax.lax.ragged_dot(h, w.astype(dtype), group_sizes)
    reference, kernel = QUANTIZED_EXPERTS[type(w)]
    if not kernels:
        return reference(h, *w, group_sizes)
    return jax.lax.platform_dependent(h, *w, group_sizes, tpu=kernel, default=reference)


def routed_experts(
    x,
    weights,
    experts,
    w_gate,
    w_up,
    w_down,
    *,
    act,
    first_expert=0,
    scales=None,
    biases=None,
    glu=None,
    kernels=True,
):
    """Weighted sum of the routed experts' outputs, for the experts these weights hold.

    ``x [T, H]``, ``weights``/``experts [T, K]`` (routing), stacked weights
    ``[E', in, out]``: ``w_gate``/``w_up [E', H, I]`` and ``w_down [E', I, H]`` of experts
    ``first_expert .. first_expert + E'``, read as `jax.lax.ragged_dot` takes them. Rows
    are sorted by expert and each expert runs one `jax.lax.ragged_dot` group; routes to
    experts held elsewhere sort last, outside every group, and weigh zero. No token is
    dropped (no capacity limit).
    ``scales`` (quantized experts, `layers.quant`): the per-row scales ``[E', out]``
    of the three weights, applied to each row's result by its expert.
    ``biases`` (gpt-oss): ``[E', I]``, ``[E', I]``, ``[E', H]`` added to each row's
    gate, up and down results by its expert; ``glu``: ``(gate, up) -> hidden`` in place
    of ``act(gate) * up`` (`clamped_swiglu`). ``kernels``: MXFP4 and block-fp8
    experts may run their Pallas kernel (`_grouped_dot`); False where XLA partitions
    the experts itself (tensor parallelism without expert parallelism), a split that a
    Pallas call cannot follow: the dequantizing reference then.
    Returns float32 ``[T, H]`` (partial sums when ``E'`` is a shard of the experts).
    """
    num_tokens, hidden = x.shape
    k, local = experts.shape[1], w_gate.shape[0]
    flat = experts.reshape(-1) - first_expert  # [T*K]
    mine = (flat >= 0) & (flat < local)
    flat = jnp.where(mine, flat, local)
    order = jnp.argsort(flat)
    token_of = order // k  # [T*K], source token of each sorted row
    stored = type(w_gate) in QUANTIZED_EXPERTS  # not widened: the activations' dtype
    dtype = x.dtype if scales is not None or stored else w_gate.dtype
    xs = x[token_of].astype(dtype)  # [T*K, H]
    group_sizes = jnp.bincount(flat, length=local + 1)[:local].astype(jnp.int32)  # [E']
    row_expert = jnp.minimum(flat[order], local - 1)  # [T*K]
    s_gate, s_up, s_down = (None, None, None) if scales is None else scales
    b_gate, b_up, b_down = (None, None, None) if biases is None else biases

    def expert_dot(h, w, s, b=None):  # [T*K, in] x [E', in, out] -> [T*K, out]
        y = _grouped_dot(h, w, group_sizes, dtype, kernels)
        y = y if s is None else y * s[row_expert].astype(dtype)
        return y if b is None else y + b[row_expert].astype(dtype)

    gate = expert_dot(xs, w_gate, s_gate, b_gate)  # [T*K, I]
    up = expert_dot(xs, w_up, s_up, b_up)
    h = act(gate) * up if glu is None else glu(gate, up)  # [T*K, I]
    out = expert_dot(h, w_down, s_down, b_down)  # [T*K, H], sorted by expert
    return _combine(out, order, jnp.where(mine, weights.reshape(-1), 0.0), num_tokens, k)


def _combine(out, order, route_weight, num_tokens: int, k: int):
    """Float32 ``[T, H]``: each token's ``k`` rows of ``out`` (sorted by expert:
    ``order``) weighted by ``route_weight`` (``[T*K]``, token-major; 0 for routes held
    elsewhere, whose rows are left unset by the grouped matmul, so never read). The rows
    go back to token order by a gather and each token sums its ``k``: a scatter-add of
    the weighted sorted rows wrote a float32 ``[T*K, H]`` product to HBM and read it
    back on TPU (DeepSeek-V3 at 256 tokens: 0.3 GB a MoE layer)."""
    rows = out[jnp.argsort(order)].reshape(num_tokens, k, -1)  # token-major
    w = route_weight.reshape(num_tokens, k).astype(jnp.float32)
    rows = jnp.where(w[..., None] != 0, rows.astype(jnp.float32), 0.0)
    return (rows * w[..., None]).sum(axis=1)  # elementwise: no dot, so no TF32 on GPUs


def as_stored(leaves: dict, scheme: quant.QuantScheme, inputs: int) -> Any:
    """The transposed leaves of stacked experts of ``inputs`` input rows as their
    grouped matmul takes them (`QUANTIZED_EXPERTS`), or None: `Mxfp4Experts`;
    `Fp8Experts` for fp8 in contiguous groups that divide the input (no partial last
    group)."""
    if scheme.method == "mxfp4":
        return Mxfp4Experts(leaves[""], leaves["_scale"])
    group = scheme.group_size
    if scheme.method == "fp8" and group and not scheme.act_order and inputs % group == 0:
        return Fp8Experts(leaves[""], leaves["_scale"])
    return None


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE layout), computed with `jax.lax.ragged_dot`.

    Parameters: ``gate.weight [E, H]`` (the router) and the experts stacked on a
    leading axis, ``[E, in, out]`` (module docstring): ``experts_gate_proj`` and
    ``experts_up_proj [E, H, I]``, ``experts_down_proj [E, I, H]``; quantized, their
    `layers.quant` leaves stored transposed (per-row scales ``[E, out]``). The
    expert computation is injected (``experts_fn``, `routed_experts` by default) so
    `sharding/` can run it per expert shard. Routing follows ``config.routing``
    (`layers.routing.route`); with its ``correction_bias`` the layer holds
    ``e_score_correction_bias [E]`` (float32; a family maps the checkpoint's
    ``mlp.gate.e_score_correction_bias`` here, `models.glm4_moe`). With
    ``config.shared_expert_intermediate_size`` a dense `GatedMLP` ``shared_experts``
    runs on every token and adds to the routed output (its ``mlp`` axis splits under
    tensor parallelism whether or not the experts are split by expert).
    """

    config: TransformerConfig
    experts_fn: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, H]
        cfg = self.config
        hidden = x.shape[1]
        e, k, width = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        router_dtype = jnp.float32 if cfg.routing.float32_router else cfg.dtype
        router = Linear(e, ("expert", "embed"), cfg.router_bias, router_dtype, name="gate")(
            x.astype(router_dtype)
        )  # [T, E]
        bias = None
        if cfg.routing.correction_bias:  # checkpoint: mlp.gate.e_score_correction_bias
            init = nn.with_logical_partitioning(nn.initializers.zeros, ("expert",))
            bias = self.param("e_score_correction_bias", init, (e,), jnp.float32)
        weights, experts = route(router, cfg.routing, k, cfg.norm_topk_prob, bias)  # [T, K]

        def stacked(name: str, out: tuple[int, str], inp: tuple[int, str]):
            """The stacked weight ``[E, in, out]`` (``out``/``inp``: size and logical
            axis), and its per-row scales ``[E, out]`` when quantized per row. MXFP4
            and block-fp8 ones come as they are stored (`as_stored`); other grouped
            and int4 weights are dequantized here, to ``dtype``, in that layout."""
            scheme = cfg.quantization
            if scheme is not None and not quantizes(scheme, self, "experts"):
                scheme = None  # the checkpoint keeps these experts unquantized
            if scheme is None:
                init = nn.with_logical_partitioning(_normal(), ("expert", inp[1], out[1]))
                return self.param(name, init, (e, inp[0], out[0]), cfg.dtype), None
            shape, axes = (e, out[0], inp[0]), ("expert", out[1], inp[1])  # [E, out, in]
            leaves = quantized_params(self, name, shape, axes, scheme, transpose=True)
            if (experts := as_stored(leaves, scheme, inp[0])) is not None:
                return experts, None  # dequantized inside the grouped matmul
            if scheme.group_size or scheme.has_offset:
                return quant.dequantize(leaves, scheme, transpose=True).astype(cfg.dtype), None
            return leaves[""], leaves["_scale"]

        mlp, embed = (width, "mlp"), (hidden, "embed")
        w_gate, s_gate = stacked("experts_gate_proj", out=mlp, inp=embed)  # [E, H, I]
        w_up, s_up = stacked("experts_up_proj", out=mlp, inp=embed)
        w_down, s_down = stacked("experts_down_proj", out=embed, inp=mlp)  # [E, I, H]
        scales = None if s_gate is None else (s_gate, s_up, s_down)
        fn = self.experts_fn or routed_experts
        act = activation(cfg.hidden_act)
        out = fn(x, weights, experts, w_gate, w_up, w_down, act=act, scales=scales,
                 **self._variant(e, width, hidden))  # fmt: skip
        if cfg.shared_expert_intermediate_size:
            shared = GatedMLP(cfg, cfg.shared_expert_intermediate_size, name="shared_experts")
            out = out + shared(x).astype(jnp.float32)
        return out.astype(x.dtype)

    def _variant(self, e: int, width: int, hidden: int) -> dict:
        """gpt-oss's expert options for ``experts_fn`` ({} without them): ``biases``
        with ``config.expert_bias`` (``experts_{gate,up,down}_proj_bias [E, out]`` in
        ``dtype``, unquantized beside weights that may be) and the clamped SwiGLU
        ``glu`` with ``config.swiglu_clamp``."""
        cfg, extra = self.config, {}
        if cfg.expert_bias:
            shapes = {"gate": (width, "mlp"), "up": (width, "mlp"), "down": (hidden, "embed")}
            extra["biases"] = tuple(
                self.param(
                    f"experts_{name}_proj_bias",
                    nn.with_logical_partitioning(nn.initializers.zeros, ("expert", axis)),
                    (e, rows),
                    cfg.dtype,
                )
                for name, (rows, axis) in shapes.items()
            )
        if cfg.swiglu_clamp is not None:
            extra["glu"] = clamped_swiglu(*cfg.swiglu_clamp)
        return extra
