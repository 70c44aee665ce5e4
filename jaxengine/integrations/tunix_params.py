"""Tunix model families as Hugging Face checkpoints: tensor names, layouts, configs.

A Tunix model (`tunix.models.<family>.model`) keeps its parameters under its own
paths and in its own layouts: attention projections as einsum weights, ``[D, N, H]``
for q/k/v and ``[N, H, D]`` for o; MLP kernels as flax ``nnx.Linear`` kernels,
``[in, out]``; MoE experts stacked, ``[E, in, out]``. `LLM.update_weights` takes
Hugging Face names in the checkpoint's ``[out, in]`` layout. `hf_weights` turns the
first into the second with jax ops on the arrays' own devices (a reshape and a
transpose each: no host round trip), and `hf_config` is the ``config.json`` of an
engine for the same model.

No Tunix import: the rules read dotted parameter paths (``layers.0.attn.q_proj.w``)
and the fields of a family's ``ModelConfig``.

Tunix 0.1.7's Llama3 and Qwen3 apply RoPE with theta 1e6 whatever
``ModelConfig.rope_theta`` says (its ``apply_rope`` default; Qwen2 passes the field).
`hf_config` writes the field, so a Llama3 config with another theta samples
differently from Tunix's own forward pass.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

LAYOUTS = ("copy", "linear", "heads_in", "heads_out", "experts")
"""How a Tunix array becomes its Hugging Face tensor(s):

- ``copy``: as it is (embeddings, norms, biases);
- ``linear``: ``[in, out] -> [out, in]`` (an ``nnx.Linear`` kernel, Tunix's lm_head);
- ``heads_in``: ``[D, N, H] -> [N*H, D]`` (q/k/v einsum weights);
- ``heads_out``: ``[N, H, D] -> [D, N*H]`` (the o einsum weight);
- ``experts``: ``[E, in, out] -> E tensors [out, in]``, the name's ``{expert}`` each
  expert's index.
"""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Tunix parameters whose dotted path matches ``pattern`` (whole) are the tensor
    ``name`` (groups as ``\\1``) in ``layout`` (`LAYOUTS`)."""

    pattern: str
    name: str
    layout: str = "copy"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: expected one of {LAYOUTS}")


_LAYER = r"layers\.(\d+)\."
_HF_LAYER = r"model.layers.\1."
LLAMA_RULES = (
    Rule(r"embedder\.input_embedding", "model.embed_tokens.weight"),
    Rule(r"final_norm\.w", "model.norm.weight"),
    Rule(r"lm_head\.w", "lm_head.weight", "linear"),
    Rule(_LAYER + r"input_layernorm\.w", _HF_LAYER + "input_layernorm.weight"),
    Rule(_LAYER + r"post_attention_layernorm\.w", _HF_LAYER + "post_attention_layernorm.weight"),
    Rule(_LAYER + r"attn\.([qkv])_proj\.w", _HF_LAYER + r"self_attn.\2_proj.weight", "heads_in"),
    Rule(_LAYER + r"attn\.o_proj\.w", _HF_LAYER + "self_attn.o_proj.weight", "heads_out"),
    Rule(_LAYER + r"mlp\.(gate|up|down)_proj\.kernel", _HF_LAYER + r"mlp.\2_proj.weight", "linear"),
)
QWEN2_RULES = (
    *LLAMA_RULES,
    Rule(_LAYER + r"attn\.([qkv])_bias", _HF_LAYER + r"self_attn.\2_proj.bias"),
)
QWEN3_RULES = (
    *LLAMA_RULES,
    Rule(_LAYER + r"attn\.([qk])_norm\.w", _HF_LAYER + r"self_attn.\2_norm.weight"),
    # mixture of experts: the router, and the experts stacked on a leading axis
    Rule(_LAYER + r"mlp\.router\.kernel", _HF_LAYER + "mlp.gate.weight", "linear"),
    Rule(
        _LAYER + r"mlp\.(gate|up|down)_proj",
        _HF_LAYER + r"mlp.experts.{expert}.\2_proj.weight",
        "experts",
    ),
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One Tunix model family: its rules and the Hugging Face config it matches."""

    name: str
    """Tunix's model class (``Llama3``)."""
    model_type: str
    """transformers' ``model_type`` of the dense model."""
    architecture: str
    rules: tuple[Rule, ...]
    tie_field: str
    """The ``ModelConfig`` field that says the lm_head is the embedding."""


FAMILIES = {
    f.name: f
    for f in (
        Family("Llama3", "llama", "LlamaForCausalLM", LLAMA_RULES, "weight_tying"),
        Family("Qwen2", "qwen2", "Qwen2ForCausalLM", QWEN2_RULES, "use_tied_embedding"),
        Family("Qwen3", "qwen3", "Qwen3ForCausalLM", QWEN3_RULES, "use_tied_embedding"),
    )
}
"""Tunix model class name -> `Family`."""


def family_of(model: Any) -> Family:
    """The `Family` of a Tunix model (``tunix.models.<family>.model.<Class>``)."""
    cls = type(model)
    family = FAMILIES.get(cls.__name__)
    if family is None or not cls.__module__.startswith("tunix.models."):
        raise ValueError(
            f"{cls.__module__}.{cls.__name__}: no Hugging Face mapping for this model; "
            f"supported Tunix families: {', '.join(FAMILIES)}"
        )
    return family


def _converted(layout: str, array: jax.Array) -> jax.Array:
    if layout == "linear":
        return array.T
    if layout == "heads_in":  # [D, N, H] -> [N*H, D]
        return jnp.reshape(array, (array.shape[0], -1)).T
    if layout == "heads_out":  # [N, H, D] -> [D, N*H]
        return jnp.reshape(array, (-1, array.shape[-1])).T
    return array


def hf_weights(family: Family, params: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(hf_name, array)`` for each ``(dotted Tunix path, array)``; raises
    `ValueError` naming a parameter that no rule of the family matches."""
    rules = [(re.compile(rule.pattern), rule) for rule in family.rules]
    for path, array in params:
        found = next(((m, r) for p, r in rules if (m := p.fullmatch(path))), None)
        if found is None:
            raise ValueError(f"{family.name} parameter {path!r} has no Hugging Face name")
        match, rule = found
        name = match.expand(rule.name)
        if rule.layout != "experts":
            yield name, _converted(rule.layout, array)
            continue
        for expert in range(array.shape[0]):  # [E, in, out]
            yield name.format(expert=expert), array[expert].T


def hf_config(family: Family, config: Any, **fields: Any) -> dict[str, Any]:
    """The transformers config fields of a Tunix ``ModelConfig`` (plus ``fields``:
    ``max_position_embeddings``, token ids, ``dtype``), with its ``model_type``."""
    out = dict(
        model_type=family.model_type,
        architectures=[family.architecture],
        vocab_size=config.vocab_size,
        hidden_size=config.embed_dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        rope_theta=float(config.rope_theta),
        tie_word_embeddings=bool(getattr(config, family.tie_field)),
    )
    if getattr(config, "num_experts", None):  # Qwen3's mixture of experts, every layer
        out.update(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            moe_intermediate_size=config.hidden_dim,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            norm_topk_prob=True,  # Tunix renormalizes the top-k routing weights
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return {**out, **fields}
