"""Multi-token-prediction (MTP) layers as draft heads
(``--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'``).

DeepSeek-V3 / R1 checkpoints append a multi-token-prediction layer after the decoder
layers, ``model.layers.{num_hidden_layers}.*`` (config ``num_nextn_predict_layers``),
trained to predict the token after next. Like an EAGLE head (`models.eagle`) it reads,
at position ``p``, the next token ``t[p + 1]`` and the target's last hidden state
``h[p]`` (after the final norm, what the target's LM head reads)::

    f[p] = layer(eh_proj([enorm(embed(t[p + 1])); hnorm(h[p])]))

``layer`` being one decoder layer of the family (DeepSeek-V3's: latent attention and
MoE, under the same names as the others). ``shared_head.norm(f[p])`` under the
target's LM head gives the logits of ``t[p + 2]`` (`logits_input`); ``f[p]`` itself
stands in for ``h[p + 1]`` when the layer drafts again (k > 1, as vLLM does).

The embedding and LM head are the target's: the checkpoint's copies in the layer
(``embed_tokens``, ``shared_head.head``) are not read (`mtp_tensor_name`). A family
has an MTP layer when its file defines ``mtp_layer(hf_config, config) -> LayerSpec``;
`models.mtp_head` builds the head with the family's decoder layer and checkpoint hooks.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Embed, Linear, RMSNorm, float32_dots
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import DecoderLayer, run_layers
from jaxengine.models.layers.metadata import AttentionMetadata

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")  # the layer's own, besides its block
_TARGETS = ("embed_tokens.", "shared_head.head.")  # copies of the target's embedding and LM head


class SharedHead(nn.Module):
    """``shared_head``: the norm before the (target's) LM head."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        return RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, cfg.dtype, name="norm")(x)


class MTPModel(nn.Module):
    """Embedding, ``enorm``/``hnorm``, ``eh_proj``, the decoder layer (``layers_0``)
    and ``shared_head`` of a multi-token-prediction layer."""

    config: TransformerConfig
    layer_cls: Any = DecoderLayer
    attention_kwargs: Any = None
    moe_kwargs: Any = None

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.enorm = RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, cfg.dtype)
        self.hnorm = RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, cfg.dtype)
        self.eh_proj = Linear(
            cfg.hidden_size, ("embed", "embed"), False, cfg.dtype, weight_dtype=cfg.matmul_dtype
        )
        self.layers = [
            self.layer_cls(cfg, spec, self.attention_kwargs, self.moe_kwargs) for spec in cfg.layers
        ]
        self.shared_head = SharedHead(cfg)

    @float32_dots
    def __call__(self, token_ids, positions, hidden, kv_caches, md):
        e = self.enorm(self.embed_tokens(token_ids))  # [T, H]
        h = self.hnorm(hidden.astype(self.config.dtype))  # [T, H]
        x = self.eh_proj(jnp.concatenate([e, h], axis=-1))  # [T, 2H] -> [T, H]
        return run_layers(self, self.layers, x, positions, kv_caches, md)

    def head_norm(self, features: jax.Array) -> jax.Array:
        return self.shared_head(features)


class MTPHead(nn.Module):
    """``(token_ids[T], positions[T], hidden[T, H], kv_caches, md) -> (features[T, H],
    kv_caches)``, as `models.eagle.EagleHead`: token ``t[p + 1]`` and the target's
    feature ``h[p]`` give the layer's feature at ``p``; `logits_input` is what the
    target's `compute_logits` reads of it."""

    config: TransformerConfig
    layer_cls: Any = DecoderLayer
    attention_kwargs: Any = None
    moe_kwargs: Any = None

    def setup(self) -> None:
        self.model = MTPModel(self.config, self.layer_cls, self.attention_kwargs, self.moe_kwargs)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        hidden: jax.Array,  # [T, H]
        kv_caches: tuple[jax.Array, ...],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return self.model(token_ids, positions, hidden, kv_caches, md)

    def logits_input(self, features: jax.Array) -> jax.Array:  # [N, H] -> [N, H]
        """``shared_head.norm`` of the features: the LM head's input."""
        return self.model.head_norm(features)

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """The forward on zero features, then the shared head's norm: touches every
        parameter (for init; the logits are the target's)."""
        hidden = jnp.zeros((token_ids.shape[0], self.config.hidden_size), self.config.dtype)
        return self.logits_input(self(token_ids, positions, hidden, kv_caches, md)[0])


def mtp_tensor_name(name: str, layer: int) -> str | None:
    """A checkpoint tensor's name in the head's tree, as the family's checkpoint hooks
    read it: ``model.layers.{layer}.enorm.weight`` -> ``model.enorm.weight``, the
    decoder block's ``model.layers.{layer}.self_attn...`` -> ``model.layers.0.self_attn...``;
    None for the tensors of other layers and for the copies of the target's embedding
    and LM head."""
    prefix = f"model.layers.{layer}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    if rest.startswith(_TARGETS):
        return None
    return f"model.{rest}" if rest.startswith(_OWN) else f"model.layers.0.{rest}"
