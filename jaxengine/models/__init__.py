"""Model families and the lazy architecture registry.

`get_model(hf_config, dtype)` returns ``(module, TransformerConfig)`` for the config's
``architectures`` entry, importing only that family's file. Every decoder module is a
`layers.decoder.CausalLM`; the encoders (`bert`) share its forward contract. Apply
either as a pure function of its parameter tree.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

# HF architecture name -> family module in this package (class of the same name).
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
}

# Configs without `architectures` (e.g. built in code) fall back on model_type.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "bert": "BertModel",
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no JAX implementation here."""


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture_of(hf_config: Any) -> str:
    """The supported architecture name of an HF config, or a clear error."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        names.append(_MODEL_TYPES[model_type])
    for name in names:
        if name in _ARCHITECTURES:
            return name
    raise UnsupportedArchitectureError(
        f"model architecture {names or model_type!r} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def get_model(hf_config: Any, dtype: Any, attention_kwargs: dict | None = None):
    """``(module, TransformerConfig)`` for ``hf_config`` with parameters in ``dtype``."""
    arch, family = _family(hf_config)
    config = family.from_hf(hf_config, dtype)
    if arch.endswith("ForSequenceClassification") and not config.num_labels:
        config = dataclasses.replace(config, num_labels=hf_config.num_labels)
    module = getattr(family, arch)(config, attention_kwargs=attention_kwargs)
    return module, config


def family_config(hf_config: Any, dtype: Any):
    """The `TransformerConfig` of ``hf_config``'s family (no module built)."""
    return _family(hf_config)[1].from_hf(hf_config, dtype)


def _family(hf_config: Any):
    arch = architecture_of(hf_config)
    return arch, importlib.import_module(f"jaxengine.models.{_ARCHITECTURES[arch]}")
