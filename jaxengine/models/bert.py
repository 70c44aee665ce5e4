"""BERT family: bidirectional encoders (BERT, MiniLM, sentence-transformers embedders).

Post-norm encoder: word + learned absolute position + token-type embeddings and a
LayerNorm, then per layer ``x = LN(x + attn(x))`` and ``x = LN(x + mlp(x))`` with
biased projections and a GELU MLP. The forward has the decoders' contract
(`layers.decoder.CausalLM`): ``(token_ids[T], positions[T], kv_caches, md) ->
(hidden[T, H], kv_caches)``. Attention is bidirectional within each request of the
flat packed batch: the whole prompt comes in one step; every token's k/v is written
to the request's pages, then each token attends to all of them (the backend's
attention with ``causal=False``). Token types ride in the ids' high bits
(`TOKEN_TYPE_SHIFT`): 0 for a single text, 1 for a pair's second text.

Parameters follow the checkpoint's names: ``encoder.layer.3.attention.self.query.weight``
is ``encoder/layer_3/attention/self/query/weight``; each module class maps the names
with its ``hf_param_path`` (`loader.params` uses it in place of the decoders').
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxengine.models.layers.basic import Embed, LayerNorm, Linear, activation, float32_dots
from jaxengine.models.layers.config import LayerSpec, RopeSpec, TransformerConfig
from jaxengine.models.layers.metadata import AttentionMetadata
from jaxengine.pooling_params import TOKEN_TYPE_SHIFT
from pallas_kernels.encoder_attention import encoder_attention
from pallas_kernels.kv_cache_update import reference as kv_update
from pallas_kernels.ragged_paged_attention import reference


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a BertConfig (``num_labels`` only for a classifier)."""
    position_type = getattr(hf_config, "position_embedding_type", "absolute")
    if position_type != "absolute" or getattr(hf_config, "is_decoder", False):
        raise ValueError(
            f"BERT with position_embedding_type={position_type!r} or is_decoder=True is "
            "not supported: only absolute-position encoders"
        )
    heads = hf_config.num_attention_heads
    archs = getattr(hf_config, "architectures", None) or ()
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hf_config.hidden_size // heads,
        layers=(LayerSpec(rope=RopeSpec()),) * hf_config.num_hidden_layers,  # rope unused
        hidden_act=hf_config.hidden_act,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        bidirectional=True,
        max_position_embeddings=hf_config.max_position_embeddings,
        type_vocab_size=hf_config.type_vocab_size,
        layer_norm_eps=hf_config.layer_norm_eps,
        num_labels=hf_config.num_labels if classifier else 0,
        dtype=dtype,
    )


class BertSelfAttention(nn.Module):
    """q/k/v projections and bidirectional attention over the request's own tokens.
    The step writes every token's k/v to the paged cache; each token then attends to
    all of its request's keys: from the step's own keys, each request padded to 32
    slots, when the requests are short and whole (`encoder_attention`), else through
    `attention_fn` with ``causal=False``."""

    config: TransformerConfig
    attention_fn: Callable[..., jax.Array] = reference.ragged_paged_attention
    update_fn: Callable[..., jax.Array] = kv_update.update_kv_cache

    @nn.compact
    def __call__(self, x: jax.Array, kv_cache: jax.Array, md: AttentionMetadata):
        cfg = self.config
        num_tokens, hq, d = x.shape[0], cfg.num_heads, cfg.head_dim
        proj = dict(
            use_bias=True, dtype=cfg.dtype, quant=cfg.quantization, weight_dtype=cfg.matmul_dtype
        )
        q, k, v = (
            Linear(hq * d, (heads, "embed"), **proj, name=n)(x).reshape(num_tokens, hq, d)
            for n, heads in (("query", "q_heads"), ("key", "kv_heads"), ("value", "kv_heads"))
        )  # [T, Hq, D] each
        out = encoder_attention(
            q, k, v, kv_cache, md.page_table, md.query_start_loc, md.num_seqs,
            sm_scale=cfg.scale, fallback=self.attention_fn,
            update=lambda cache, slots: self.update_fn(cache, k, v, slots),
            compute_dtype=cfg.matmul_dtype or jnp.float32,
        )  # fmt: skip  # the layer's cache is left as it is (`encoder_attention`)
        return out.reshape(num_tokens, hq * d), kv_cache


class BertResidual(nn.Module):
    """``LN(residual + dense(x))``: BERT's ``attention.output`` and ``output`` blocks."""

    config: TransformerConfig
    axes: tuple[str, str]  # of ``dense``: (embed, q_heads) or (embed, mlp)

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
        cfg = self.config
        dense = Linear(
            cfg.hidden_size, self.axes, True, cfg.dtype, cfg.quantization, name="dense",
            weight_dtype=cfg.matmul_dtype,
        )  # fmt: skip
        return LayerNorm(cfg.layer_norm_eps, cfg.dtype, name="LayerNorm")(residual + dense(x))


class BertAttention(nn.Module):
    """``self`` (attention) then ``output`` (o-projection, residual, LayerNorm)."""

    config: TransformerConfig
    attention_kwargs: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, kv_cache: jax.Array, md: AttentionMetadata):
        attn = BertSelfAttention(self.config, **(self.attention_kwargs or {}), name="self")
        h, kv_cache = attn(x, kv_cache, md)
        return BertResidual(self.config, ("embed", "q_heads"), name="output")(h, x), kv_cache


class BertIntermediate(nn.Module):
    """The MLP's up-projection and activation (``intermediate.dense``)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, I]
        cfg = self.config
        dense = Linear(
            cfg.intermediate_size, ("mlp", "embed"), True, cfg.dtype, cfg.quantization,
            name="dense", weight_dtype=cfg.matmul_dtype,
        )  # fmt: skip
        return activation(cfg.hidden_act)(dense(x))


class BertLayer(nn.Module):
    """One post-norm encoder layer: attention block, then MLP block."""

    config: TransformerConfig
    attention_kwargs: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, kv_cache: jax.Array, md: AttentionMetadata):
        attention = BertAttention(self.config, self.attention_kwargs, name="attention")
        x, kv_cache = attention(x, kv_cache, md)
        h = BertIntermediate(self.config, name="intermediate")(x)
        return BertResidual(self.config, ("embed", "mlp"), name="output")(h, x), kv_cache


class BertEmbeddings(nn.Module):
    """Word + position + token-type (all 0) embeddings, then LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, token_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.config
        small = (None, "embed")  # position and token-type tables stay whole
        words = Embed(cfg.vocab_size, cfg.hidden_size, cfg.dtype, name="word_embeddings")
        pos = Embed(cfg.max_position_embeddings, cfg.hidden_size, cfg.dtype, small,
                    name="position_embeddings")  # fmt: skip
        types = Embed(cfg.type_vocab_size, cfg.hidden_size, cfg.dtype, small,
                      name="token_type_embeddings")  # fmt: skip
        positions = jnp.clip(positions, 0, cfg.max_position_embeddings - 1)  # padding rows
        kinds = jnp.clip(token_ids >> TOKEN_TYPE_SHIFT, 0, cfg.type_vocab_size - 1)
        token_ids = token_ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        x = words(token_ids) + types(kinds) + pos(positions)  # [T, H]
        return LayerNorm(cfg.layer_norm_eps, cfg.dtype, name="LayerNorm")(x)


class BertEncoder(nn.Module):
    """The encoder layers (Linen names them ``layer_{i}``, as ``encoder.layer.{i}``)."""

    config: TransformerConfig
    attention_kwargs: Any = None

    def setup(self) -> None:
        self.layer = [BertLayer(self.config, self.attention_kwargs) for _ in self.config.layers]

    def __call__(self, x: jax.Array, kv_caches: tuple, md: AttentionMetadata):
        new_caches = []
        for layer, kv_cache in zip(self.layer, kv_caches, strict=True):
            x, kv_cache = layer(x, kv_cache, md)
            new_caches.append(kv_cache)
        return x, tuple(new_caches)


class BertPooler(nn.Module):
    """``tanh(dense(x))`` of each request's first ([CLS]) hidden state."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [R, H] -> [R, H]
        cfg = self.config
        return jnp.tanh(
            Linear(cfg.hidden_size, ("embed", "embed"), True, cfg.dtype, name="dense")(x)
        )


class BertModel(nn.Module):
    """The encoder: ``hidden`` is HF's ``last_hidden_state`` (after the last LayerNorm).

    As a checkpoint's top-level model (``architectures: ["BertModel"]``, e.g.
    sentence-transformers) it has no pooler: a checkpoint's ``pooler.*`` tensors,
    like any head's (``cls.*`` of a pre-training checkpoint loaded through
    ``model_type: bert``), are skipped. Inside `BertForSequenceClassification`
    (``with_pooler``) it holds ``pooler.dense``.
    """

    config: TransformerConfig
    attention_kwargs: Any = None  # attention_fn / update_fn (the backend's)
    with_pooler: bool = False
    supports_fused_projections: ClassVar[bool] = False  # q/k/v stay apart (`loader._model`)

    def setup(self) -> None:
        if self.config.lora is not None:
            raise ValueError("LoRA adapters are not supported on BERT models")
        self.embeddings = BertEmbeddings(self.config)
        self.encoder = BertEncoder(self.config, self.attention_kwargs)
        if self.with_pooler:
            self.pooler = BertPooler(self.config)

    @float32_dots
    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32, 0..n-1 within each request
        kv_caches: tuple[jax.Array, ...],  # per layer [P, S, 2*Hkv, D]
        md: AttentionMetadata,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return self.encoder(self.embeddings(token_ids, positions), kv_caches, md)

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """The hidden states; touches every parameter (for init; the pooler is touched
        by `BertForSequenceClassification.classify`)."""
        return self(token_ids, positions, kv_caches, md)[0]

    @float32_dots
    def pool(self, hidden: jax.Array) -> jax.Array:  # [R, H] [CLS] rows -> [R, H]
        return self.pooler(hidden)

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """A checkpoint tensor's parameter path; None for the pooler and heads."""
        return hf_param_path(name, head_model=False)


class BertForSequenceClassification(nn.Module):
    """`BertModel` (``bert``, with its pooler) and a linear ``classifier`` head."""

    config: TransformerConfig
    attention_kwargs: Any = None  # attention_fn / update_fn (the backend's)
    supports_fused_projections: ClassVar[bool] = False

    def setup(self) -> None:
        cfg = self.config
        self.bert = BertModel(cfg, self.attention_kwargs, with_pooler=True)
        self.classifier = Linear(cfg.num_labels, (None, "embed"), True, cfg.dtype)

    def __call__(self, token_ids, positions, kv_caches, md):
        """`BertModel`'s forward: ``(hidden[T, H], kv_caches)``."""
        return self.bert(token_ids, positions, kv_caches, md)

    def forward_and_logits(self, token_ids, positions, kv_caches, md) -> jax.Array:
        """Logits of each request's first token; touches every parameter (for init)."""
        hidden, _ = self(token_ids, positions, kv_caches, md)
        return self.classify(hidden[md.query_start_loc[:-1]])  # [R, num_labels]

    @float32_dots
    def classify(self, hidden: jax.Array) -> jax.Array:
        """``[R, H]`` [CLS] hidden states -> ``[R, num_labels]`` float32 logits."""
        return self.classifier(self.bert.pool(hidden)).astype(jnp.float32)

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], None] | None:
        """A checkpoint tensor's parameter path (``bert.*``, ``classifier.*``)."""
        return hf_param_path(name, head_model=True)


_ENCODER = ("embeddings", "encoder")  # the body's tensors BertModel keeps
_BUFFERS = ("position_ids", "token_type_ids")  # registered buffers, not parameters
_LEGACY = {"gamma": "weight", "beta": "bias"}  # TF-era LayerNorm names
_LAYER = re.compile(r"(?<=encoder)\.layer\.(\d+)\.")


def hf_param_path(name: str, head_model: bool) -> tuple[tuple[str, ...], None] | None:
    """Maps a BERT checkpoint tensor name to ``(parameter path, None)``, or None to skip.

    ``encoder.layer.3.output.LayerNorm.weight`` -> ``(encoder, layer_3, output,
    LayerNorm, weight)``; ``gamma``/``beta`` are read as ``weight``/``bias``. With
    ``head_model`` (`BertForSequenceClassification`) the body (embeddings, encoder,
    pooler) lives under ``bert``, prefixed or not in the checkpoint, and other tensors
    keep their names (``classifier.weight``); without, a ``bert.`` prefix is dropped
    and the pooler and any head are skipped. Buffers (``position_ids``) are skipped.
    """
    body = name.removeprefix("bert.")
    top, leaf = body.split(".", 1)[0], body.rsplit(".", 1)[-1]
    if leaf in _BUFFERS:
        return None
    if head_model:
        path = "bert." + body if top in (*_ENCODER, "pooler") else name
    elif top in _ENCODER:
        path = body
    else:
        return None
    *parent, leaf = _LAYER.sub(lambda m: f".layer_{m.group(1)}.", path).split(".")
    return (*parent, _LEGACY.get(leaf, leaf)), None
