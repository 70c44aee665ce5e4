"""Model families and the lazy architecture registry.

`get_model(hf_config, dtype)` returns ``(module, TransformerConfig)`` for the config's
``architectures`` entry, importing only that family's file. Every decoder module is a
`layers.decoder.CausalLM`; the encoders (`bert`) share its forward contract. Apply
either as a pure function of its parameter tree.

Every decoder family also serves ``<Family>ForSequenceClassification`` (its
``ForCausalLM`` name with that suffix): the family's decoder layers under a ``score``
head (`layers.decoder.SequenceClassifier`), as transformers' classes of that name
and vLLM's ``--convert classify`` build it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

# HF architecture name -> family module in this package (class of the same name).
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_next",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Idefics3ForConditionalGeneration": "idefics3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_vl",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
}

# Configs without `architectures` (e.g. built in code) fall back on model_type.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "bert": "BertModel",
    "idefics3": "Idefics3ForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no JAX implementation here."""


_CLASSIFIER = "ForSequenceClassification"


def _causal_name(name: str) -> str | None:
    """The decoder family's ``*ForCausalLM`` name of ``*ForSequenceClassification``."""
    if not name.endswith(_CLASSIFIER):
        return None
    causal = name.removesuffix(_CLASSIFIER) + "ForCausalLM"
    return causal if causal in _ARCHITECTURES else None


def is_decoder_classifier(hf_config: Any) -> bool:
    """Whether the config names a decoder family's ``*ForSequenceClassification``."""
    return any(_causal_name(n) for n in getattr(hf_config, "architectures", None) or [])


def supported_architectures() -> list[str]:
    causal = [n for n in _ARCHITECTURES if n.endswith("ForCausalLM")]
    return sorted([*_ARCHITECTURES, *(n.removesuffix("ForCausalLM") + _CLASSIFIER for n in causal)])


def architecture_of(hf_config: Any) -> str:
    """The supported architecture name of an HF config, or a clear error."""
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        names.append(_MODEL_TYPES[model_type])
    for name in names:
        if name in _ARCHITECTURES or _causal_name(name):
            return name
    raise UnsupportedArchitectureError(
        f"model architecture {names or model_type!r} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def get_model(hf_config: Any, dtype: Any, attention_kwargs: dict | None = None):
    """``(module, TransformerConfig)`` for ``hf_config`` with parameters in ``dtype``."""
    arch, family = _family(hf_config)
    config = family.from_hf(hf_config, dtype)
    causal = _causal_name(arch)
    if causal is None:
        return getattr(family, arch)(config, attention_kwargs=attention_kwargs), config
    from jaxengine.models.layers.decoder import SequenceClassifier

    if not config.num_labels:
        config = dataclasses.replace(config, num_labels=hf_config.num_labels)
    causal_cls = getattr(family, causal)
    classifier = _with_checkpoint_hooks(SequenceClassifier, causal_cls, arch)
    return classifier(config, causal_cls.layer_cls, attention_kwargs=attention_kwargs), config


_CHECKPOINT_HOOKS = ("hf_param_path", "split_tensors")
"""A family class's static methods that read its checkpoint (`loader.params`)."""


def _with_checkpoint_hooks(base: type, family_cls: type, name: str) -> type:
    """``base`` itself, or a subclass named ``name`` carrying ``family_cls``'s own
    checkpoint hooks (Mixtral's names, Phi-3's fused tensors): a classifier reads the
    same checkpoint layout as its family's causal LM."""
    hooks = {k: v for k, v in vars(family_cls).items() if k in _CHECKPOINT_HOOKS}
    return type(name, (base,), hooks) if hooks else base


def mtp_head(hf_config: Any, config: Any) -> tuple[Any, Any] | None:
    """``(module, TransformerConfig)`` of the multi-token-prediction layer of
    ``hf_config``'s family as a draft head (`models.mtp.MTPHead`: the family's decoder
    layer and checkpoint hooks; the config is ``config``, the target's, with that one
    layer, as the family file's ``mtp_layer`` gives it); None for a family without one."""
    arch, family = _family(hf_config)
    layer = getattr(family, "mtp_layer", None)
    if layer is None:
        return None
    from jaxengine.models.mtp import MTPHead

    causal = _causal_name(arch) or arch
    causal_cls = getattr(family, causal)
    head_cls = _with_checkpoint_hooks(MTPHead, causal_cls, causal.replace("ForCausalLM", "MTP"))
    head_config = dataclasses.replace(config, layers=(layer(hf_config, config),))
    return head_cls(head_config, causal_cls.layer_cls), head_config


def mtp_families() -> list[str]:
    """The architectures whose checkpoints' multi-token-prediction layer drafts (the
    ``mtp`` method), for error messages."""
    names = sorted(n for n in _ARCHITECTURES if n.endswith("ForCausalLM"))
    return [n for n in names if hasattr(_family_module(n), "mtp_layer")]


def image_encoder(hf_config: Any, dtype: Any) -> Any:
    """The image encoder of a vision-language checkpoint (its family's
    ``image_encoder``: the runner's encoder step), None for a text-only one."""
    factory = getattr(_family(hf_config)[1], "image_encoder", None)
    return None if factory is None else factory(hf_config, dtype)


def family_config(hf_config: Any, dtype: Any):
    """The `TransformerConfig` of ``hf_config``'s family (no module built)."""
    return _family(hf_config)[1].from_hf(hf_config, dtype)


def _family(hf_config: Any):
    arch = architecture_of(hf_config)
    return arch, _family_module(arch)


def _family_module(arch: str):
    family = _ARCHITECTURES.get(arch) or _ARCHITECTURES[_causal_name(arch)]
    return importlib.import_module(f"jaxengine.models.{family}")
