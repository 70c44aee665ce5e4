"""EAGLE draft heads (``--speculative-config '{"method": "eagle", "model": PATH}'``).

An EAGLE head drafts from the target's features. At position ``p`` it reads the next
token's embedding and the target's last hidden state at ``p`` (after the final norm,
what the target's LM head reads): ``x = fc([embed(t[p + 1]); h[p]])``, then its decoder
layers (the first without its input norm), and no final norm. The target's LM head
turns the result into the draft's logits for ``t[p + 2]``; the result itself stands
in for ``h[p + 1]`` when the head drafts the token after.

Checkpoints in the EAGLE layout name ``fc.weight`` (``fc.bias`` if the head has one),
``layers.{i}.*`` as the target's family does, and ``embed_tokens.weight`` unless the
head shares the target's embedding; config.json is a config of the target's family
(hidden size, heads, one or more layers). The head's parameters live under
``model`` as the target's do, so the checkpoint's names map with a ``model.`` prefix.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Embed, Linear, float32_dots
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.decoder import DecoderLayer, run_layers
from jaxengine.models.layers.metadata import AttentionMetadata


class EagleModel(nn.Module):
    """Embedding, ``fc`` and the decoder layers of an EAGLE head."""

    config: TransformerConfig
    fc_bias: bool = False
    attention_kwargs: Any = None

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.fc = Linear(cfg.hidden_size, ("embed", "embed"), self.fc_bias, cfg.dtype)
        self.layers = [
            DecoderLayer(cfg, spec, self.attention_kwargs, input_norm=i > 0)
            for i, spec in enumerate(cfg.layers)
        ]

    @float32_dots
    def __call__(self, token_ids, positions, hidden, kv_caches, md):
        x = jnp.concatenate([self.embed_tokens(token_ids), hidden.astype(self.config.dtype)], -1)
        x = self.fc(x)
        return run_layers(self, self.layers, x, positions, kv_caches, md)


class EagleHead(nn.Module):
    """``(token_ids[T], positions[T], hidden[T, H], kv_caches, md) -> (features[T, H],
    kv_caches)``: token ``t[p + 1]`` and the target's feature ``h[p]`` at each position
    ``p`` give the head's feature at ``p``, for the target's `compute_logits`."""

    config: TransformerConfig
    fc_bias: bool = False
    attention_kwargs: Any = None

    def setup(self) -> None:
        self.model = EagleModel(self.config, self.fc_bias, self.attention_kwargs)

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
        """What the target's `compute_logits` reads: the features themselves (a head
        has no final norm)."""
        return features

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """The forward on zero features: touches every parameter (for init; the head
        has no logits of its own)."""
        hidden = jnp.zeros((token_ids.shape[0], self.config.hidden_size), self.config.dtype)
        return self(token_ids, positions, hidden, kv_caches, md)[0]


def eagle_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in the head's tree (``model.`` + name), or None for
    the tensors the head has no place for (rotary buffers)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name if name.startswith("model.") else f"model.{name}"
