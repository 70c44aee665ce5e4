"""The pre-norm decoder stack shared by the Llama-like families, and the causal-LM head.

`CausalLM` is the module every family exposes. Its forward is the DESIGN §3 contract:
``(token_ids[T], positions[T], kv_caches, md) -> (hidden[T, H], kv_caches)``, jitted
as a pure function of the parameter tree via `Module.apply`; `compute_logits` maps
selected hidden states to vocabulary logits.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.attention import Attention, qkv_rows
from jaxengine.models.layers.basic import Embed, Linear, RMSNorm, float32_dots
from jaxengine.models.layers.config import LayerSpec, TransformerConfig
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.models.layers.mlp import GatedMLP, SparseMoE


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (Llama, Mistral, Qwen2/3);
    ``input_norm`` False: ``x + attn(x)`` (an EAGLE head's first layer, `models.eagle`).
    A family with another feed-forward block (Llama 4) overrides `feed_forward`."""

    config: TransformerConfig
    spec: LayerSpec
    attention_kwargs: Any = None
    moe_kwargs: Any = None
    input_norm: bool = True

    def __post_init__(self) -> None:
        # the layer's modules see its own unquantized modules (`LayerSpec.unquantized`)
        scheme = self.config.quantization
        if scheme is not None and scheme.unquantized != self.spec.unquantized:
            scheme = dataclasses.replace(scheme, unquantized=self.spec.unquantized)
            config = dataclasses.replace(self.config, quantization=scheme)
            object.__setattr__(self, "config", config)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, positions, kv_cache, md):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, dtype=cfg.dtype)
        attn = Attention(cfg, self.spec, **(self.attention_kwargs or {}), name="self_attn")
        h = RMSNorm(**norm, name="input_layernorm")(x) if self.input_norm else x
        h, kv_cache = attn(h, positions, kv_cache, md)
        x = x + h
        h = RMSNorm(**norm, name="post_attention_layernorm")(x)
        return x + self.feed_forward(h, md), kv_cache

    def feed_forward(self, h: jax.Array, md: AttentionMetadata) -> jax.Array:
        """The feed-forward block on the normed residual ``h [T, H]``, named ``mlp``:
        `SparseMoE` on a MoE layer, else `GatedMLP` (with the batch's LoRA slots).
        Called from ``__call__`` (a compact method), so it may define submodules."""
        if self.spec.moe:
            return SparseMoE(self.config, **(self.moe_kwargs or {}), name="mlp")(h)
        return GatedMLP(self.config, name="mlp")(h, md.lora_slots)


class DecoderModel(nn.Module):
    """Embedding, the decoder layers (Linen names them ``layers_{i}``), the final norm."""

    config: TransformerConfig
    layer_cls: Any = DecoderLayer
    attention_kwargs: Any = None
    moe_kwargs: Any = None

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = [
            self.layer_cls(cfg, spec, self.attention_kwargs, self.moe_kwargs) for spec in cfg.layers
        ]
        self.norm = RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, cfg.dtype)

    def __call__(self, token_ids, positions, kv_caches, md, image_embeds=None):
        n = len(self.layers)
        return self.stage(token_ids, positions, kv_caches, md, 0, n, True, True, image_embeds)

    @float32_dots
    def stage(self, inputs, positions, kv_caches, md, start, stop, first, last, image_embeds=None):
        """Layers ``start:stop`` (a pipeline stage): from token ids when ``first`` (else
        from the previous stage's hidden states), through the final norm when ``last``.
        ``image_embeds`` (a vision-language model): ``(embeds[T, H], mask[T])``, the
        input embedding of each token where ``mask`` is set."""
        cfg = self.config
        x = inputs
        if first:
            x = self.embed_tokens(inputs)  # [T, H]
            if cfg.embed_scale is not None:
                x = x * jnp.asarray(cfg.embed_scale, dtype=cfg.dtype)
            if image_embeds is not None:
                embeds, mask = image_embeds
                x = jnp.where(mask[:, None], embeds.astype(x.dtype), x)
        x, new_caches = run_layers(self, self.layers[start:stop], x, positions, kv_caches, md)
        return (self.norm(x) if last else x), new_caches

    def attend(self, x):
        return self.embed_tokens.attend(x)


def run_layers(parent, layers, x, positions, kv_caches, md):
    """``x`` through ``layers`` in order, each with its own KV cache; returns ``(x,
    new caches)``.

    Layers of one kind (`layer_kind`: their class and fields) share one traced body:
    each is called through one `jax.jit` of the layer's pure apply with that layer's
    variables, so JAX traces and lowers the body once per kind rather than once per
    layer (a 30-layer model's step traces one layer), and XLA inlines the calls, so
    the compiled step is the same program. Under ``init``, or in a pass that collects
    intermediates (``--calculate-kv-scales``), the layers run as plain submodules.
    """
    shared = not (parent.is_initializing() or parent.is_mutable_collection("intermediates"))
    bodies: dict[Any, Any] = {}
    new_caches = []
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        if shared:
            kind = layer_kind(layer)
            if kind not in bodies:
                bodies[kind] = _layer_body(layer.clone(parent=None))
            x, kv_cache = bodies[kind](layer.variables, x, positions, kv_cache, md)
        else:
            x, kv_cache = layer(x, positions, kv_cache, md)
        new_caches.append(kv_cache)
    return x, tuple(new_caches)


def _layer_body(template: nn.Module):
    """One jitted apply of ``template`` (an unbound layer), named ``decoder_layer`` in
    the lowered module and in profiles."""

    def decoder_layer(variables, x, positions, kv_cache, md):
        return template.apply(variables, x, positions, kv_cache, md)

    return jax.jit(decoder_layer)


def layer_kind(layer: nn.Module) -> tuple:
    """What makes two layer modules trace the same body: their class and every
    field but the name and parent (unhashable values by identity, since the layers of
    one model share the same ``attention_kwargs`` object)."""
    fields = [f.name for f in dataclasses.fields(layer) if f.name not in ("parent", "name")]
    return (type(layer), *(_hashable(getattr(layer, name)) for name in fields))


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


class CausalLM(nn.Module):
    """A decoder model plus the LM head (``lm_head`` unless embeddings are tied)."""

    config: TransformerConfig
    layer_cls: Any = DecoderLayer
    attention_kwargs: Any = None  # attention_fn / update_fn (the backend, per shard)
    moe_kwargs: Any = None  # experts_fn (expert parallelism)

    def setup(self) -> None:
        cfg = self.config
        self.model = DecoderModel(cfg, self.layer_cls, self.attention_kwargs, self.moe_kwargs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, ("vocab", "embed"), False, cfg.dtype)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_caches: tuple[jax.Array, ...],  # per layer [P, S, 2*Hkv, D]
        md: AttentionMetadata,
        image_embeds: tuple[jax.Array, jax.Array] | None = None,  # `DecoderModel.stage`
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return self.model(token_ids, positions, kv_caches, md, image_embeds)

    def stage(self, inputs, positions, kv_caches, md, start, stop, first, last):
        """One pipeline stage's part of the forward (`DecoderModel.stage`)."""
        return self.model.stage(inputs, positions, kv_caches, md, start, stop, first, last)

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """Forward then logits of every token: touches every parameter (for init)."""
        hidden, _ = self(token_ids, positions, kv_caches, md)
        return self.compute_logits(hidden)

    @float32_dots
    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, H] -> [N, V] float32
        cfg = self.config
        if cfg.tie_word_embeddings:
            logits = self.model.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return logits


class SequenceClassifier(nn.Module):
    """A decoder model plus a classification head (``score``, no bias: HF's
    ``*ForSequenceClassification``), read at each request's last token."""

    config: TransformerConfig
    layer_cls: Any = DecoderLayer
    attention_kwargs: Any = None
    moe_kwargs: Any = None

    def setup(self) -> None:
        cfg = self.config
        self.model = DecoderModel(cfg, self.layer_cls, self.attention_kwargs, self.moe_kwargs)
        self.score = Linear(cfg.num_labels, (None, "embed"), False, cfg.dtype)

    def __call__(self, token_ids, positions, kv_caches, md):
        return self.model(token_ids, positions, kv_caches, md)

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """Forward then the head on every token: touches every parameter (for init)."""
        hidden, _ = self(token_ids, positions, kv_caches, md)
        return self.classify(hidden)

    @float32_dots
    def classify(self, hidden: jax.Array) -> jax.Array:  # [R, H] -> [R, num_labels] f32
        return self.score(hidden).astype(jnp.float32)


_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight(\w*)$")  # weight_scale...
_SKIPPED = ("rotary_emb.inv_freq",)


def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
    """Maps a checkpoint tensor name to (parameter path, stacked index) or None.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``(model, layers_3, self_attn,
    q_proj, weight)``; per-expert tensors ``...mlp.experts.5.up_proj.weight`` go to
    the stacked ``experts_up_proj`` at index 5 (``...up_proj.weight_scale`` to
    ``experts_up_proj_scale``, `layers.quant`). Buffers that are not parameters
    (rotary caches) map to None.
    """
    if name.endswith(_SKIPPED):
        return None
    name = _LAYER.sub(lambda m: f".layers_{m.group(1)}.", name)
    index = None
    expert = _EXPERT.search(name)
    if expert:
        index = int(expert.group(1))
        name = name[: expert.start()] + f".experts_{expert.group(2)}{expert.group(3)}"
    return tuple(name.split(".")), index


# A fused model's parameters built from several checkpoint tensors, rows in this order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_param_path(
    path: tuple[str, ...], config: TransformerConfig, fused_rows: int
) -> tuple[tuple[str, ...], slice, int]:
    """Where a q/k/v or gate/up tensor goes in a fused model (`fused_projections`).

    ``path`` is the tensor's own (`hf_param_path`), e.g. ``(..., self_attn, k_proj,
    bias)``; ``fused_rows`` the fused leaf's row count (``2 * width`` for gate/up).
    Returns ``(fused path, its rows in the fused leaf, number of parts)``.
    """
    *parent, name, leaf = path
    fused = fused_name(name)
    parts = FUSED_PROJECTIONS[fused]
    sizes = qkv_rows(config) if fused == "qkv_proj" else (fused_rows // 2,) * 2
    i = parts.index(name)
    start = sum(sizes[:i])
    return (*parent, fused, leaf), slice(start, start + sizes[i]), len(parts)


def fused_name(name: str) -> str | None:
    """The fused projection that holds the projection ``name``, or None."""
    return next((f for f, parts in FUSED_PROJECTIONS.items() if name in parts), None)
