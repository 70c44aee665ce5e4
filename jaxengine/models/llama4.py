"""Llama 4 text decoder: chunked local attention, NoPE global layers, sigmoid top-1 MoE.

Every layer is ``x + attn(norm(x))`` then ``x + feed_forward(norm(x))``. The layers
differ by ``no_rope_layers`` (1: a rope layer) and ``layer_types``:

- rope layers rotate q and k by the interleaved (complex-pair) rope, then, with
  ``use_qk_norm``, normalize both to unit RMS without a weight; they attend within
  chunks of ``attention_chunk_size`` positions (``chunked_attention``);
- NoPE layers (every fourth) attend over the whole causal context without rope; with
  ``attn_temperature_tuning`` their queries grow with the position,
  ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``.

Layers in ``moe_layers`` have a mixture of experts: the router's top
``num_experts_per_tok`` logits, each through a sigmoid, scale the token *before* it
enters its expert (not the expert's output), and a shared expert runs on every token;
both have width ``intermediate_size``. The other layers have a dense MLP of width
``intermediate_size_mlp``. Checkpoint names follow transformers: ``feed_forward.*``,
the experts fused as ``experts.gate_up_proj [E, H, 2I]`` (gate columns first), cut
at load into ``experts.gate_proj`` and ``experts.up_proj``, and ``experts.down_proj
[E, I, H]``, all kept ``[E, in, out]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models import llama
from jaxengine.models.layers.basic import Linear, _normal, activation
from jaxengine.models.layers.config import LayerSpec, TransformerConfig, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM, DecoderLayer, hf_param_path
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.models.layers.mlp import GatedMLP, routed_experts
from jaxengine.models.layers.routing import RoutingSpec, route


def _layer_specs(hf_config: Any) -> tuple[LayerSpec, ...]:
    """One spec per layer from ``no_rope_layers``, ``layer_types`` and ``moe_layers``."""
    rope = dataclasses.replace(rope_from_hf(hf_config), interleaved=True)
    moe_layers = set(hf_config.moe_layers or ())
    temperature = (float(hf_config.floor_scale), float(hf_config.attn_scale))
    specs = []
    for i in range(hf_config.num_hidden_layers):
        use_rope = bool(hf_config.no_rope_layers[i])
        chunked = hf_config.layer_types[i] == "chunked_attention"
        specs.append(
            LayerSpec(
                rope=rope,
                moe=i in moe_layers,
                attention_chunk_size=hf_config.attention_chunk_size if chunked else None,
                use_rope=use_rope,
                qk_l2_norm=bool(hf_config.use_qk_norm) and use_rope,
                attn_temperature=None
                if use_rope or not hf_config.attn_temperature_tuning
                else temperature,
            )
        )
    return tuple(specs)


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Llama4TextConfig (a Llama4Config's ``text_config``)."""
    hf_config = getattr(hf_config, "text_config", None) or hf_config
    base = llama.from_hf(hf_config, dtype)  # vocab, sizes, heads, norms, attention bias
    return dataclasses.replace(
        base,
        intermediate_size=hf_config.intermediate_size_mlp,  # the dense layers'
        layers=_layer_specs(hf_config),
        num_experts=hf_config.num_local_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.intermediate_size,  # experts' and shared expert's
        routing=RoutingSpec(scoring="sigmoid"),  # top-k of logits = of their sigmoids
    )


_FUSED_EXPERTS = "feed_forward.experts.gate_up_proj"


class StackedExperts(nn.Module):
    """The experts' weights, ``[E, in, out]``: ``gate_proj`` and ``up_proj [E, H, I]``
    (the checkpoint's fused ``gate_up_proj`` cut at load, `Llama4ForCausalLM.
    split_tensors`: slicing it in the step copied both halves of every expert each
    step), ``down_proj [E, I, H]``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        e, h, width = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def param(name, shape, axes):
            init = nn.with_logical_partitioning(_normal(), axes)
            return self.param(name, init, shape, cfg.dtype)

        gate = param("gate_proj", (e, h, width), ("expert", "embed", "mlp"))
        up = param("up_proj", (e, h, width), ("expert", "embed", "mlp"))
        down = param("down_proj", (e, width, h), ("expert", "mlp", "embed"))
        return gate, up, down


class Llama4MoE(nn.Module):
    """Sigmoid top-k routing with the score on the expert's input, plus a shared expert.

    Each of a token's ``K`` routes runs `routed_experts` (or the injected
    ``experts_fn``, expert parallelism) on ``x * sigmoid(logit)`` with weight 1: the
    expert sees the scaled token, as transformers' ``Llama4TextMoe`` computes it
    (unselected experts get a zero input, and a bias-free expert maps 0 to 0).
    """

    config: TransformerConfig
    experts_fn: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        cfg = self.config  # x: [T, H] -> [T, H]
        if cfg.quantization is not None:
            raise NotImplementedError("quantized Llama 4 experts are not supported yet")
        e, k, width = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        logits = Linear(e, ("expert", "embed"), False, cfg.dtype, name="router")(x)  # [T, E]
        scores, experts = route(logits, cfg.routing, k, renormalize=False)  # [T, K]
        w_gate, w_up, w_down = StackedExperts(cfg, name="experts")()  # [E, in, out]
        fn = self.experts_fn or routed_experts
        act = activation(cfg.hidden_act)
        ones = jnp.ones((x.shape[0], 1), jnp.float32)
        routed = sum(
            fn(
                x * scores[:, i : i + 1].astype(x.dtype),
                ones,
                experts[:, i : i + 1],
                w_gate,
                w_up,
                w_down,
                act=act,
            )  # fmt: skip
            for i in range(k)
        )
        shared = GatedMLP(cfg, width, name="shared_expert")(x, lora_slots)
        return (shared.astype(jnp.float32) + routed).astype(x.dtype)


class Llama4DecoderLayer(DecoderLayer):
    """`DecoderLayer` (pre-norm attention and feed-forward blocks) whose feed-forward
    block is ``feed_forward``: dense, or `Llama4MoE`."""

    def feed_forward(self, h: jax.Array, md: AttentionMetadata) -> jax.Array:
        if self.spec.moe:
            ff = Llama4MoE(self.config, **(self.moe_kwargs or {}), name="feed_forward")
        else:
            ff = GatedMLP(self.config, name="feed_forward")
        return ff(h, md.lora_slots)


class Llama4ForCausalLM(CausalLM):
    """`CausalLM` with Llama 4 decoder layers."""

    layer_cls: Any = Llama4DecoderLayer

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, Any]], config: TransformerConfig
    ) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` pairs with each fused ``experts.gate_up_proj [E, H, 2I]``
        cut into ``experts.gate_proj`` and ``experts.up_proj`` (gate columns first);
        the rest pass through."""
        del config  # the layout is the same for every config
        for name, array in tensors:
            if not name.endswith(_FUSED_EXPERTS):
                yield name, array
                continue
            stem, width = name.removesuffix("gate_up_proj"), array.shape[-1] // 2
            yield f"{stem}gate_proj", array[..., :width]
            yield f"{stem}up_proj", array[..., width:]


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The text decoder of a Llama 4 vision-language checkpoint (``text_config``,
    tensors under ``language_model.``); the vision tower's tensors are skipped, and
    images are not supported."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``language_model.*`` -> the decoder's ``*``; the tower's and projector's
        tensors -> None."""
        if name.startswith(("vision_model.", "multi_modal_projector.")):
            return None
        return hf_param_path(name.removeprefix("language_model."))
