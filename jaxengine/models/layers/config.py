"""`TransformerConfig`: the frozen, hashable architecture description the layers read.

Built from a Hugging Face config by each family file (`from_hf`); layers never read the
HF config directly, so the module tree is pure data and the jitted forward is keyed by
a hashable value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxengine.models.layers.routing import RoutingSpec


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one attention kind (see `layers.rope`)."""

    theta: float = 10000.0
    """Base frequency."""
    rope_type: str = "default"
    """One of default, linear, dynamic, llama3, yarn, longrope, proportional (Gemma 4)."""
    factor: float = 1.0
    """Scaling factor for the scaled variants."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are scaled by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3/yarn/dynamic: the context length the model was trained at."""
    beta_fast: float = 32.0
    """yarn: rotations above which dimensions are kept (extrapolation)."""
    beta_slow: float = 1.0
    """yarn: rotations below which dimensions are interpolated."""
    truncate: bool = True
    """yarn: the ramp's ends are rounded to whole dimensions (floor, ceil); False keeps
    them fractional (gpt-oss's ``truncate: false``)."""
    attention_factor: float | None = None
    """yarn, longrope: scale of cos/sin; None derives 0.1 * ln(factor) + 1 (yarn) or
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (longrope)."""
    short_factor: tuple[float, ...] | None = None
    """longrope: per-frequency divisors (``rot_dim / 2`` values) used when the engine's
    context fits in ``original_max_position_embeddings`` (`layers.rope`)."""
    long_factor: tuple[float, ...] | None = None
    """longrope: the divisors used when the context is longer than that."""
    longrope_long: bool = False
    """longrope: every position rotates with ``long_factor`` (the engine's context
    length exceeds ``original_max_position_embeddings``), else with ``short_factor``
    (`layers.rope`'s module docstring; `with_context_length`)."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that rotates."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): how the ``head_dim / 2`` frequencies split over the
    (temporal, height, width) position rows (`rope.apply_mrope`); None: 1-D positions."""
    mrope_interleaved: bool = False
    """M-RoPE with the rows interleaved (Qwen3-VL, Qwen3.5): frequency ``j`` takes row
    ``j % 3`` while ``j < 3 * mrope_section[j % 3]``, else the temporal row; False: the
    sections are contiguous runs (Qwen2.5-VL)."""
    interleaved: bool = False
    """Features ``2i`` and ``2i + 1`` rotate together (Llama 4's complex-number form);
    False: the rotate-half form, feature ``i`` with ``i + rot_dim / 2``."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What differs between decoder layers of one model."""

    rope: RopeSpec
    """Rotary embedding of this layer."""
    sliding_window: int | None = None
    """Local attention window, or None for full attention."""
    moe: bool = False
    """Whether the MLP of this layer is a sparse mixture of experts."""
    attention_chunk_size: int | None = None
    """Chunked local attention (Llama 4): a token at position p sees only the keys in
    ``[p - p % C, p]``; None: no chunking."""
    use_rope: bool = True
    """False: queries and keys are not rotated (Llama 4's global NoPE layers)."""
    qk_l2_norm: bool = False
    """Queries and keys normalized to unit RMS over head_dim, without a weight, after
    rope (Llama 4's ``use_qk_norm`` on its rope layers)."""
    attn_temperature: tuple[float, float] | None = None
    """``(floor_scale, attn_scale)``: queries multiplied by
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` at position p (Llama 4's
    ``attn_temperature_tuning`` on its NoPE layers); None: no scaling."""
    unquantized: tuple[str, ...] = ()
    """Modules of this layer that a quantized checkpoint keeps in the model dtype,
    named from the layer (``mlp``, ``mlp.experts``, ``self_attn.o_proj``; ``""`` the
    whole layer): `layers.quant.layer_unquantized` of the checkpoint's list. The layer
    gives its modules a scheme with these (`layers.decoder.DecoderLayer`); layers that
    differ here hold different parameters, so they trace apart (`layer_kind`)."""


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, `layers.mla`): queries and keys of
    ``qk_nope_head_dim + qk_rope_head_dim`` per head, values of ``v_head_dim``, all
    heads' keys and values expanded from one latent of ``kv_lora_rank`` per token. The
    KV cache holds that latent and the shared rope key, ``kv_lora_rank +
    qk_rope_head_dim`` values a token (`TransformerConfig.head_dim`)."""

    kv_lora_rank: int
    """Width of the normalized latent ``kv_a_layernorm(kv_a_proj_with_mqa(x)[:L])``."""
    qk_nope_head_dim: int
    """Per-head query/key features without rope (from ``kv_b_proj``'s key rows)."""
    qk_rope_head_dim: int
    """Per-head rotated query features; the rotated key is one vector shared by heads."""
    v_head_dim: int
    """Per-head value width (``kv_b_proj``'s value rows; ``o_proj``'s input per head)."""
    q_lora_rank: int | None = None
    """Queries through ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; None: one
    ``q_proj``."""

    def __post_init__(self) -> None:
        widths = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim)
        if min(widths) <= 0 or self.v_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"invalid MLA dimensions: {self}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A transformer as the shared layers need it: a decoder, or an encoder (BERT)."""

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual width H."""
    intermediate_size: int
    """Dense MLP width."""
    num_heads: int
    """Query heads Hq."""
    num_kv_heads: int
    """Key/value heads Hkv (divides Hq)."""
    head_dim: int
    """Per-head width D."""
    layers: tuple[LayerSpec, ...]
    """One spec per decoder layer."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    norm_offset: float = 0.0
    """RMSNorm multiplies by (offset + weight): 1.0 for Gemma, 0.0 elsewhere."""
    hidden_act: str = "silu"
    """Activation of the gated MLP."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """q/k/v projections have a bias."""
    o_bias: bool = False
    """o_proj has a bias."""
    mlp_bias: bool = False
    """MLP projections have a bias."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys (Qwen3, Gemma3)."""
    sm_scale: float | None = None
    """Softmax scale; None means head_dim ** -0.5."""
    attn_logit_softcap: float | None = None
    """Soft cap of attention scores."""
    attention_sinks: bool = False
    """Each attention layer holds ``sinks [Hq]`` (float32, gpt-oss's
    ``self_attn.sinks``): a learned logit per query head that joins the softmax
    denominator and carries no value (`ragged_paged_attention.reference`)."""
    final_logit_softcap: float | None = None
    """Soft cap of the output logits."""
    embed_scale: float | None = None
    """Multiply embeddings by this (Gemma: sqrt(H))."""
    num_experts: int = 0
    """MoE: experts per MoE layer."""
    num_experts_per_tok: int = 0
    """MoE: experts each token is routed to."""
    moe_intermediate_size: int = 0
    """MoE: width of one expert."""
    norm_topk_prob: bool = False
    """MoE: renormalize the top-k routing weights to sum to one."""
    routing: RoutingSpec = RoutingSpec()
    """MoE: how router logits become routes (`layers.routing`): softmax top-k by
    default; sigmoid scores with a correction bias, expert groups and a scaling
    factor for GLM-4.5 and DeepSeek-V3."""
    shared_expert_intermediate_size: int = 0
    """MoE: width of a dense gated MLP ``shared_experts`` that every token of a MoE
    layer runs besides its routed experts (GLM-4.5 and DeepSeek-V3:
    ``moe_intermediate_size * n_shared_experts``); 0: none."""
    router_bias: bool = False
    """MoE: the router ``gate`` has a bias (gpt-oss)."""
    expert_bias: bool = False
    """MoE: each expert's gate, up and down projections have a bias, stacked as
    ``experts_{gate,up,down}_proj_bias [E, out]`` (gpt-oss)."""
    swiglu_clamp: tuple[float, float] | None = None
    """MoE: ``(alpha, limit)`` of gpt-oss's clamped SwiGLU experts,
    ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
    limit)`` (`layers.mlp.clamped_swiglu`); None: ``act(gate) * up``."""
    dtype: Any = jnp.float32
    """Parameter and activation dtype."""
    matmul_dtype: Any = None
    """The dtype the unquantized attention and MLP projections' weights are stored in
    and their dots run in, accumulated in ``dtype`` (`layers.basic.Linear`); None:
    ``dtype``. Embeddings, the LM head, classifier heads and MoE experts keep ``dtype``.
    `jaxengine.loader.load_model` sets bfloat16 beside float32 activations for
    ``--dtype bfloat16`` on CPU (`loader.cpu_dtypes`)."""
    quantization: Any = None
    """How the attention and MLP projections and the MoE experts are stored
    (a `layers.quant.QuantScheme`: int8, fp8 or int4, per row or grouped), None for
    ``dtype``; embeddings, the LM head and the MoE router keep ``dtype``."""
    kv_cache_scales: bool = False
    """Attention layers hold per-tensor ``k_scale`` and ``v_scale`` (an fp8 KV cache):
    the cache stores ``k / k_scale`` and ``v / v_scale``."""
    lora: Any = None
    """Adapter slots on every attention and dense-MLP projection (a
    `layers.lora.LoRASpec`), None without LoRA."""
    fused_projections: bool = False
    """q/k/v run as one matmul over ``self_attn.qkv_proj`` and the dense MLP's gate/up
    as one over ``mlp.gate_up_proj``, weights concatenated along their output rows
    once at load time from the checkpoint's separate tensors (fewer, larger ops: the
    CPU win). Only valid where those parameters are not split by tensor parallelism,
    so `jaxengine.loader.load_model` sets it for tensor size 1 only."""
    bidirectional: bool = False
    """An encoder (`models.bert`): every token attends to all tokens of its own request,
    the whole prompt in one step, with no KV cache read or written."""
    max_position_embeddings: int = 0
    """Rows of a learned absolute position table (BERT); 0: positions are rotary."""
    type_vocab_size: int = 0
    """Rows of the token-type (segment) embedding (BERT); 0: none."""
    layer_norm_eps: float = 1e-12
    """Epsilon of every LayerNorm (BERT); the RMSNorm families read ``rms_norm_eps``."""
    num_labels: int = 0
    """Outputs of a sequence-classification head (`BertForSequenceClassification`);
    0: the model has none."""
    mla: MLASpec | None = None
    """Multi-head latent attention (DeepSeek-V3, `layers.mla`): then ``num_kv_heads``
    is 1 and ``head_dim`` the cache row's width, ``kv_lora_rank + qk_rope_head_dim``
    (`layers.attention.kv_cache_shape`); None: the q/k/v attention."""

    family_spec: Any = None
    """A family's own settings beyond these fields, which the shared layers never read
    (a hashable frozen dataclass of the family file: Gemma 4's per-layer attention
    shapes and per-layer inputs, `models.gemma4.Gemma4Spec`); None for most."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else self.head_dim**-0.5


def rope_from_hf(hf_config: Any, layer_type: str | None = None) -> RopeSpec:
    """Reads rotary parameters from an HF config (new `rope_parameters` or legacy)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    known = {f.name for f in dataclasses.fields(RopeSpec)}
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    for key in ("mrope_section", "short_factor", "long_factor"):  # lists; the spec is hashable
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    kwargs["theta"] = float(params.get("rope_theta", 10000.0))
    kwargs["rope_type"] = rope_type
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        kwargs["partial_rotary_factor"] = float(partial)
    if rope_type in ("dynamic", "yarn") and "original_max_position_embeddings" not in kwargs:
        kwargs["original_max_position_embeddings"] = getattr(
            hf_config, "max_position_embeddings", None
        )
    if rope_type == "longrope":
        _longrope_lengths(hf_config, kwargs)
    return RopeSpec(**kwargs)


def _longrope_lengths(hf_config: Any, kwargs: dict) -> None:
    """longrope's original length (rope parameters, else the config's field, else
    ``max_position_embeddings``), its ``factor`` when absent: the ratio of
    ``max_position_embeddings`` to it (transformers' ``_compute_longrope_parameters``),
    and the factors of an engine of the checkpoint's full context."""
    longest = hf_config.max_position_embeddings
    original = kwargs.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    kwargs["original_max_position_embeddings"] = original or longest
    kwargs.setdefault("factor", longest / kwargs["original_max_position_embeddings"])
    kwargs["longrope_long"] = longest > kwargs["original_max_position_embeddings"]


def with_context_length(config: TransformerConfig, max_model_len: int | None) -> TransformerConfig:
    """``config`` for an engine of context ``max_model_len`` (None: the checkpoint's
    ``max_position_embeddings``, what `rope_from_hf` assumed): longrope layers take the
    long factors exactly when it exceeds their original length (vLLM's rule)."""
    if not max_model_len:
        return config

    def fit(spec: LayerSpec) -> LayerSpec:
        rope = spec.rope
        if rope.rope_type != "longrope":
            return spec
        long = max_model_len > rope.original_max_position_embeddings
        return dataclasses.replace(spec, rope=dataclasses.replace(rope, longrope_long=long))

    return dataclasses.replace(config, layers=tuple(fit(s) for s in config.layers))


def head_dim_of(hf_config: Any) -> int:
    """head_dim from the config, else hidden_size // num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads
