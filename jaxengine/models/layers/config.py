"""`TransformerConfig`: the frozen, hashable architecture description the layers read.

Built from a Hugging Face config by each family file (`from_hf`); layers never read the
HF config directly, so the module tree is pure data and the jitted forward is keyed by
a hashable value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one attention kind (see `layers.rope`)."""

    theta: float = 10000.0
    """Base frequency."""
    rope_type: str = "default"
    """One of default, linear, dynamic, llama3, yarn."""
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
    attention_factor: float | None = None
    """yarn: scale of cos/sin; None derives 0.1 * ln(factor) + 1."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that rotates."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): how the ``head_dim / 2`` frequencies split over the
    (temporal, height, width) position rows (`rope.apply_mrope`); None: 1-D positions."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What differs between decoder layers of one model."""

    rope: RopeSpec
    """Rotary embedding of this layer."""
    sliding_window: int | None = None
    """Local attention window, or None for full attention."""
    moe: bool = False
    """Whether the MLP of this layer is a sparse mixture of experts."""


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
    if "mrope_section" in kwargs:  # a list in the config; the spec is hashable
        kwargs["mrope_section"] = tuple(kwargs["mrope_section"])
    kwargs["theta"] = float(params.get("rope_theta", 10000.0))
    kwargs["rope_type"] = rope_type
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        kwargs["partial_rotary_factor"] = float(partial)
    if rope_type in ("dynamic", "yarn") and "original_max_position_embeddings" not in kwargs:
        kwargs["original_max_position_embeddings"] = getattr(
            hf_config, "max_position_embeddings", None
        )
    return RopeSpec(**kwargs)


def head_dim_of(hf_config: Any) -> int:
    """head_dim from the config, else hidden_size // num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads
