"""Gemma 4 text decoder: per-layer head shapes, per-layer inputs, shared KV, MoE.

Each layer is Gemma 3's sandwich (norms before and after attention and the MLP), with
norms that multiply by ``weight`` (no ``1 +``) and a learned ``layer_scalar`` on the
layer's output. What Gemma 4 adds, and how it maps onto the engine:

- Layer kinds (``layer_types``): sliding layers use ``head_dim`` and ``rope_parameters
  ["sliding_attention"]``; full layers use ``global_head_dim`` (transformers'
  ``per_layer_config``), their own KV-head count with ``attention_k_eq_v`` (no
  ``v_proj``: values are the raw keys) and the "proportional" rope. Queries, keys and
  values are RMS-normed (values without a weight); the softmax scale is 1.
- One KV-cache layout serves every layer: ``head_dim`` and ``num_kv_heads`` of the
  `TransformerConfig` are the largest of the layers'. A layer with fewer KV heads
  stores each head repeated (GQA groups are unchanged), a narrower head is zero-padded
  (scores and values unchanged; the output is cut back). That costs memory on the
  narrower layers, not accuracy.
- Per-layer inputs (``hidden_size_per_layer_input`` P > 0): a token's ``L * P``
  inputs (a table lookup plus a projection of its embedding) travel with the hidden
  states through the layers as extra columns of ``x [T, H + L * P + S]``; each layer
  takes the first P, gates them into its output, and rotates them left by P, so every
  layer of a kind has the same body.
- Shared KV (``num_kv_shared_layers``): the last ``num_kv_shared_layers`` layers
  compute no keys or values; they attend over those of the last earlier layer of
  their kind. That layer puts its step's keys and values into the last ``S`` columns
  of ``x``, and each sharing layer writes them into its own cache pages and attends
  there: the same keys, values and mask as transformers (prefix caching, chunked
  prefill and preemption see ordinary caches), without the memory saving.
- MoE (``enable_moe_block``): besides the dense MLP, a router (RMS norm, ``scale``,
  softmax top-k renormalized, ``per_expert_scale``) on the residual picks experts that
  run on ``pre_feedforward_layernorm_2(residual)``; the two outputs are normed apart
  and summed before ``post_feedforward_layernorm``.

Refused: ``use_bidirectional_attention="all"`` (paged attention is causal), every layer
sharing KV, an fp8 KV cache, quantized experts, a sequence-classification head, and
per-layer inputs under pipeline parallelism (the tables would sit with the last stage).
A ``Gemma4ForConditionalGeneration`` checkpoint takes images (`Gemma4ImageEncoder`, on
the engine's image path like Gemma 3): an image token's input is its encoder output
(no embedding scale) and its per-layer inputs are those of ``pad_token_id`` projected
from that output, as in transformers. With ``use_bidirectional_attention="vision"`` an
image's tokens attend to each other both ways in the sliding layers only (the full
layers stay causal). Video and audio are refused (`multimodal.processor`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.gemma4_layers import Gemma4DecoderLayer, Gemma4Layer, Gemma4Spec
from jaxengine.models.layers.basic import Embed, Linear, RMSNorm, float32_dots
from jaxengine.models.layers.config import LayerSpec, TransformerConfig, rope_from_hf
from jaxengine.models.layers.decoder import CausalLM, DecoderModel, hf_param_path, run_layers
from jaxengine.models.vision import gemma4 as vision


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def _refuse(text: Any) -> None:
    """ValueError naming a Gemma 4 setting this port cannot serve."""
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError(
            "Gemma 4 with use_bidirectional_attention='all' is not supported: every token "
            "would attend to later ones, and the paged KV cache attends causally"
        )
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared >= text.num_hidden_layers:
        raise ValueError(
            f"Gemma 4 with num_kv_shared_layers={shared} of {text.num_hidden_layers} layers "
            "is not supported: no layer would compute the keys and values the others share"
        )


def _layer_value(text: Any, i: int, name: str) -> Any:
    """``name`` of layer ``i`` (transformers' ``per_layer_config`` overrides it on a
    heterogeneous config, where the global value raises)."""
    if name in (getattr(text, "per_layer_attributes", None) or ()):
        return getattr(text.per_layer_config[i], name)
    return getattr(text, name)


def _layers(text: Any) -> tuple[tuple[Gemma4Layer, ...], int]:
    """Each layer's `Gemma4Layer` and the shared-KV width S."""
    n, types = text.num_hidden_layers, list(text.layer_types)
    roles = list(text.kv_sharing_modes) if text.num_kv_shared_layers else [None] * n
    shapes = [(_layer_value(text, i, "head_dim"), _layer_value(text, i, "num_key_value_heads"))
              for i in range(n)]  # fmt: skip
    reused = sorted({t for t, r in zip(types, roles, strict=True) if r == "reuse"})
    slots, width = {}, 0
    for kind in reused:  # one slot per kind that has sharing layers, at its producer's shape
        d, hkv = shapes[next(i for i in range(n) if roles[i] == "store" and types[i] == kind)]
        slots[kind], width = width, width + 2 * hkv * d
    double = bool(getattr(text, "use_double_wide_mlp", False))
    layers = tuple(
        Gemma4Layer(
            head_dim=shapes[i][0],
            num_kv_heads=shapes[i][1],
            mlp_width=text.intermediate_size * (2 if double and roles[i] == "reuse" else 1),
            k_eq_v=bool(text.attention_k_eq_v) and types[i] != "sliding_attention",
            kv_role=roles[i] if types[i] in slots else None,
            slot=slots.get(types[i], 0),
        )
        for i in range(n)
    )
    return layers, width


def from_hf(hf_config: Any, dtype: Any) -> TransformerConfig:
    """The TransformerConfig of a Gemma4TextConfig (a Gemma4Config's ``text_config``)."""
    text = _text_config(hf_config)
    _refuse(text)
    layers, shared_width = _layers(text)
    num_kv_heads, head_dim = max(g.num_kv_heads for g in layers), max(g.head_dim for g in layers)
    if any(num_kv_heads % g.num_kv_heads for g in layers):
        counts = sorted({g.num_kv_heads for g in layers})
        raise ValueError(f"Gemma 4 layers' KV-head counts {counts} must divide the largest")
    specs = tuple(
        LayerSpec(
            rope=rope_from_hf(text, t),
            sliding_window=text.sliding_window if t == "sliding_attention" else None,
            moe=bool(text.enable_moe_block),
        )
        for t in text.layer_types
    )
    per_layer = text.hidden_size_per_layer_input or 0
    moe = bool(text.enable_moe_block)
    return TransformerConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=text.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layers=specs,
        rms_norm_eps=text.rms_norm_eps,
        hidden_act=text.hidden_activation,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        qkv_bias=bool(text.attention_bias),
        o_bias=bool(text.attention_bias),
        qk_norm=True,
        sm_scale=1.0,
        final_logit_softcap=text.final_logit_softcapping,
        embed_scale=text.hidden_size**0.5,
        num_experts=(text.num_experts or 0) if moe else 0,
        num_experts_per_tok=(text.top_k_experts or 0) if moe else 0,
        moe_intermediate_size=(text.moe_intermediate_size or 0) if moe else 0,
        norm_topk_prob=True,
        dtype=dtype,
        family_spec=Gemma4Spec(
            layers,
            per_layer,
            text.vocab_size_per_layer_input if per_layer else 0,
            shared_width,
            int(getattr(text, "pad_token_id", None) or 0),
        ),
    )


class Gemma4TextModel(DecoderModel):
    """Embeddings (and the per-layer inputs' tables), the layers, the final norm."""

    def setup(self) -> None:
        cfg, fam = self.config, self.config.family_spec
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = [
            self.layer_cls(cfg, spec, self.attention_kwargs, self.moe_kwargs, layer)
            for spec, layer in zip(cfg.layers, fam.layers, strict=True)
        ]
        self.norm = RMSNorm(cfg.rms_norm_eps, 0.0, cfg.dtype)
        if fam.per_layer_input_size:
            width = fam.per_layer_width
            self.embed_tokens_per_layer = Embed(fam.per_layer_vocab_size, width, cfg.dtype)
            self.per_layer_model_projection = Linear(width, (None, "embed"), False, cfg.dtype)
            self.per_layer_projection_norm = RMSNorm(cfg.rms_norm_eps, 0.0, cfg.dtype)

    @float32_dots
    def stage(self, inputs, positions, kv_caches, md, start, stop, first, last, image_embeds=None):
        """Layers ``start:stop`` on ``x [T, H + L * P + S]`` (`DecoderModel.stage`);
        ``last`` returns the normed ``[T, H]``."""
        cfg, fam = self.config, self.config.family_spec
        x = inputs
        if first:
            ids = inputs
            if image_embeds is not None:  # image tokens: the pad token's table rows
                embeds, mask = image_embeds
                ids = jnp.where(mask, fam.image_pad_token_id, inputs)
            h = self.embed_tokens(ids) * jnp.asarray(cfg.embed_scale, cfg.dtype)  # [T, H]
            if image_embeds is not None:  # as they are: no embedding scale
                h = jnp.where(mask[:, None], embeds.astype(h.dtype), h)
            shared = jnp.zeros((h.shape[0], fam.shared_kv_width), h.dtype)
            x = jnp.concatenate([h, self._per_layer_inputs(ids, h), shared], axis=1)
        x, new_caches = run_layers(self, self.layers[start:stop], x, positions, kv_caches, md)
        return (self.norm(x[:, : cfg.hidden_size]) if last else x), new_caches

    def _per_layer_inputs(self, token_ids: jax.Array, h: jax.Array) -> jax.Array:
        """``[T, L * P]``: (the normed projection of ``h`` + the token's scaled table
        row) / sqrt(2), layer by layer; ``[T, 0]`` without per-layer inputs."""
        cfg, fam = self.config, self.config.family_spec
        t, p = h.shape[0], fam.per_layer_input_size
        if not p:
            return jnp.zeros((t, 0), h.dtype)
        if not (self.is_initializing() or self.has_variable("params", "embed_tokens_per_layer")):
            raise NotImplementedError(  # a pipeline's first stage: its tables are the last's
                "Gemma 4's per-layer inputs (hidden_size_per_layer_input > 0) with "
                "--pipeline-parallel-size > 1 are not supported yet"
            )
        rows = self.embed_tokens_per_layer(token_ids) * jnp.asarray(p**0.5, cfg.dtype)
        proj = self.per_layer_model_projection(h) * jnp.asarray(cfg.hidden_size**-0.5, cfg.dtype)
        proj = self.per_layer_projection_norm(proj.reshape(t, len(fam.layers), p))
        return ((proj + rows.reshape(proj.shape)) * jnp.asarray(2**-0.5, cfg.dtype)).reshape(t, -1)


_SHARED_KV_TENSOR = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class Gemma4ForCausalLM(CausalLM):
    """`CausalLM` on `Gemma4TextModel` (q/k/v and gate/up never fused: the layers'
    shapes differ)."""

    layer_cls: Any = Gemma4DecoderLayer
    supports_fused_projections = False

    def setup(self) -> None:
        cfg = self.config
        self.model = Gemma4TextModel(cfg, self.layer_cls, self.attention_kwargs, self.moe_kwargs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, ("vocab", "embed"), False, cfg.dtype)

    @staticmethod
    def split_tensors(
        tensors: Iterable[tuple[str, np.ndarray]], config: TransformerConfig
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The checkpoint without the key/value tensors of KV-sharing layers (some
        checkpoints keep them; transformers ignores them too), its fused experts as
        the shared stacked ones (``[E, out, in]``, as every checkpoint gives them: the
        loader stores them ``[E, in, out]``)."""
        layers, width = config.family_spec.layers, config.moe_intermediate_size
        for name, array in tensors:
            shared = _SHARED_KV_TENSOR.search(name)
            if shared is not None and layers[int(shared.group(1))].kv_role == "reuse":
                continue
            if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H], gate rows first
                yield name.replace(".gate_up_proj", ".experts_gate_proj"), array[:, :width]
                yield name.replace(".gate_up_proj", ".experts_up_proj"), array[:, width:]
            elif name.endswith(".experts.down_proj"):  # [E, H, I]
                yield name.replace(".down_proj", ".experts_down_proj"), array
            else:
                yield name, array


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text decoder of a Gemma 4 checkpoint with vision / audio towers (its
    ``text_config``); the towers' tensors are skipped here (the image encoder loads
    its own: `Gemma4ImageEncoder`), audio inputs are refused
    (`multimodal.processor.prompt_images`)."""

    @staticmethod
    def hf_param_path(name: str) -> tuple[tuple[str, ...], int | None] | None:
        """``model.language_model.*`` -> the decoder's ``model.*``; the towers' and
        their embedders' tensors -> None."""
        body = name.removeprefix("model.")
        if body.startswith(("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")):
            return None
        if body.startswith("language_model."):
            name = "model." + body.removeprefix("language_model.")
        return hf_param_path(name)


class Gemma4ImageEncoder:
    """What the engine's encoder step needs of Gemma 4's image encoder
    (`vision.gemma4`): one unit is one soft token (``k x k`` patch rows), an image's
    patch rows padded to a bucket of units."""

    def __init__(self, hf_config: Any, dtype: Any) -> None:
        self.config = vision.from_hf(hf_config, dtype)
        self.module = vision.Gemma4VisionEncoder(self.config)

    @property
    def hidden_size(self) -> int:
        return self.config.text_hidden_size

    @property
    def embeds_per_unit(self) -> int:
        return 1

    def pad(self, inputs: dict[str, np.ndarray] | None, units: int) -> dict[str, np.ndarray]:
        """One image's real patch rows padded to ``units * k^2`` rows (coordinates -1:
        no key, no token); all padding when ``inputs`` is None (warm-up)."""
        cfg = self.config
        rows = units * cfg.patches_per_token
        pixels = np.zeros((1, rows, cfg.patch_dim), np.float32)
        coords = np.full((1, rows, 2), -1, np.int32)
        if inputs is not None:
            n = inputs["pixel_values"].shape[0]
            pixels[0, :n], coords[0, :n] = inputs["pixel_values"], inputs["image_position_ids"]
        return {"pixel_values": pixels, "image_position_ids": coords}

    def apply(self, params: Any, inputs: dict[str, jax.Array]) -> jax.Array:
        """``[units, hidden_size]``: the image's soft tokens first, then padding."""
        pixels = inputs["pixel_values"].astype(self.config.dtype)
        out = self.module.apply({"params": params}, pixels, inputs["image_position_ids"])
        return out.reshape(-1, out.shape[-1])

    def example_inputs(self) -> tuple:
        """The module's init inputs (`loader.encoder_params`)."""
        return vision.example_inputs(self.config)


def image_encoder(hf_config: Any, dtype: Any) -> Gemma4ImageEncoder | None:
    """A checkpoint's image encoder; None without a vision tower (a text checkpoint)."""
    if getattr(hf_config, "vision_config", None) is None:
        return None
    return Gemma4ImageEncoder(hf_config, dtype)
