"""Loading what a device-side proposer runs: a draft model (through the same path
as the target's, which the worker hands in as ``load_replica``), an EAGLE head
(``--speculative-config '{"method": "eagle", "model": PATH}'``, `models.eagle`) or
the target checkpoint's multi-token-prediction layer (``"method": "mtp"``,
`models.mtp`), on the target's devices, checked against the target."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import numpy as np

from jaxengine.config import EngineConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from jaxengine.loader import LoadedModel, is_torch, resolve_source
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import abstract_params, dummy_params, logical_axes, params_from_tensors
from jaxengine.models import architecture_of, family_config, mtp_families, mtp_head
from jaxengine.models.eagle import EagleHead, eagle_tensor_name
from jaxengine.models.mtp import mtp_tensor_name
from jaxengine.runner.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.runner.executables import setup_compilation_cache
from sharding.placement import Placement

ON_DEVICE = ("draft_model", "eagle", "mtp")  # methods that run a model of their own
HEADS = ("eagle", "mtp")  # heads on the target's hidden states (`device.eagle`)
_EMBED = "model.embed_tokens.weight"

ReplicaLoader = Callable[[EngineConfig, Sequence[Any] | None], tuple]
"""The worker's `load_replica`: (config, devices) -> (placement, model, backend)."""


@dataclasses.dataclass(frozen=True)
class LoadedDraft:
    """The draft model or EAGLE head, loaded on the target's devices."""

    placement: Placement
    loaded: LoadedModel
    backend: AttentionBackend
    shared_embedding: bool = False  # a head that reads the target's embedding


def load_draft(
    config: EngineConfig,
    devices: Sequence[Any] | None,
    target: LoadedModel,
    load_replica: ReplicaLoader,
) -> LoadedDraft | None:
    """The draft model, EAGLE head or MTP layer of ``config`` (None for the other
    methods), checked against the target: JAX models, same vocabulary (and hidden
    size for a head). A draft model loads through ``load_replica``, the target's own
    path; the MTP layer from the target's checkpoint (`load_mtp`)."""
    method = config.speculative_config.method
    if method not in ON_DEVICE:
        return None
    if is_torch(target):
        raise ValueError(
            f"speculative_config: the {method} method needs the target's JAX model "
            "(--model-impl jax)"
        )
    if method == "mtp":
        return load_mtp(config, devices, target)
    draft_config = dataclasses.replace(
        config,
        model_config=_draft_model_config(config),
        lora_config=LoRAConfig(),
        speculative_config=SpeculativeConfig(),
    )
    if method == "eagle":
        return load_eagle(draft_config, devices, target)
    placement, loaded, backend = load_replica(draft_config, devices)
    vocab_size = target.config.vocab_size
    if is_torch(loaded) or loaded.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {draft_config.model_config.model} has a "
            f"vocabulary of {loaded.config.vocab_size} tokens, the target {vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    return LoadedDraft(placement, loaded, backend)


def _draft_model_config(config: EngineConfig) -> ModelConfig:
    sc = config.speculative_config
    return dataclasses.replace(
        config.model_config,
        model=sc.option("model"),
        tokenizer=None,
        revision=sc.option("revision"),
        quantization=sc.option("quantization"),
        hf_overrides={},
        served_model_name=None,
        model_impl="jax",
    )


def load_eagle(config: EngineConfig, devices: Sequence[Any] | None, target: LoadedModel):
    """The head that ``config.model_config`` names (``config`` is the draft's), in the
    target's dtype, on the target's devices; checked against the target's hidden
    size and vocabulary."""
    from sharding.mesh import replica_devices

    setup_compilation_cache(config)
    mc, lc = config.model_config, config.load_config
    source, hf_config = resolve_source(mc, lc)
    head_config = family_config(hf_config, target.config.dtype)
    for name in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(head_config, name), getattr(target.config, name)
        if mine != theirs:
            raise ValueError(
                f"speculative_config: the EAGLE head {mc.model} has {name} {mine}, the "
                f"target {theirs}: a head must be trained for the target"
            )
    tensors = {} if lc.load_format == "dummy" else _head_tensors(source.path)
    shared = lc.load_format != "dummy" and _EMBED not in tensors
    module = EagleHead(head_config, fc_bias="model.fc.bias" in tensors)
    placement = Placement(
        config.parallel_config, devices or replica_devices(config.parallel_config)[0]
    )
    abstract = abstract_params(module, head_config)
    if shared:  # the step reads the target's embedding (`speculative.device.eagle`)
        abstract = {"model": {k: v for k, v in abstract["model"].items() if k != "embed_tokens"}}
    shardings = placement(head_config, logical_axes(abstract), nn.unbox(abstract))
    if lc.load_format == "dummy":
        params = dummy_params(module, head_config, mc.seed, shardings)
    else:
        where = str(source.path)
        params = params_from_tensors(
            module, head_config, tensors.items(), where, abstract, shardings
        )
    loaded = LoadedModel(module, head_config, params, hf_config, source, logical_axes(abstract))
    backend = select_attention_backend(config.attention_config.attention_backend)
    return LoadedDraft(placement, loaded, backend, shared)


def _head_tensors(path: Any) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the head's names (`eagle_tensor_name`)."""
    from jaxengine.loader.safetensors_io import iter_safetensors

    tensors = {}
    for name, array in iter_safetensors(path):
        mapped = eagle_tensor_name(name)
        if mapped is not None:
            tensors[mapped] = array
    if "model.fc.weight" not in tensors:
        raise CheckpointError(f"{path}: no fc.weight: not a checkpoint in the EAGLE layout")
    if "model.lm_head.weight" in tensors:
        raise CheckpointError(
            f"{path}: an EAGLE head with its own lm_head is not supported yet (heads "
            "use the target's LM head)"
        )
    return tensors


def load_mtp(config: EngineConfig, devices: Sequence[Any] | None, target: LoadedModel):
    """The multi-token-prediction layer of the target's checkpoint (``config`` is the
    engine's), ``model.layers.{num_hidden_layers}.*``, as a head on the target's
    devices (`models.mtp`): the target's config (dtype, quantization) with that one
    layer, the target's embedding and LM head shared. A family without such a layer,
    and a checkpoint without its tensors, are refused naming it."""
    from sharding.mesh import replica_devices

    hf, lc = target.hf_config, config.load_config
    head_config = dataclasses.replace(target.config, lora=None, kv_cache_scales=False)
    built = mtp_head(hf, head_config)
    if built is None:
        raise ValueError(
            f"speculative_config: the mtp method drafts with the model's multi-token-"
            f"prediction layer; {architecture_of(hf)} has none (families with one: "
            f"{', '.join(mtp_families())})"
        )
    module, head_config = built
    layer, count = hf.num_hidden_layers, getattr(hf, "num_nextn_predict_layers", 0) or 0
    if count < 1:
        raise ValueError(
            f"speculative_config: the mtp method reads the multi-token-prediction layer "
            f"model.layers.{layer}.*, and {config.model_config.model} has none "
            "(config.json's num_nextn_predict_layers is 0 or absent)"
        )
    placement = Placement(
        config.parallel_config, devices or replica_devices(config.parallel_config)[0]
    )
    full = abstract_params(module, head_config)
    shardings = placement(head_config, logical_axes(full), nn.unbox(full))
    abstract = _without_embedding(full)  # the step reads the target's (`device.eagle`)
    if lc.load_format == "dummy":
        params = dummy_params(module, head_config, config.model_config.seed, shardings)
    else:
        where = str(target.source.path)
        tensors = _mtp_tensors(config, target, layer, where)
        shardings = _without_embedding(shardings)
        params = params_from_tensors(module, head_config, tensors, where, abstract, shardings)
    params = _without_embedding(params)
    loaded = LoadedModel(module, head_config, params, hf, target.source, logical_axes(abstract))
    backend = select_attention_backend(
        config.attention_config.attention_backend,
        placement.platform,
        device_kind=placement.device_kind,
        mla=head_config.mla is not None,
    )
    return LoadedDraft(placement, loaded, backend, shared_embedding=True)


def _mtp_tensors(config: EngineConfig, target: LoadedModel, layer: int, where: str) -> list:
    """The ``(name, array)`` pairs of the target checkpoint's layer ``layer`` under the
    head's names (`mtp_tensor_name`), in its quantization format's canonical form;
    only that layer's tensors are read (the others' are memory-mapped, never
    touched). None there is a `CheckpointError` naming the layer."""
    from jaxengine.loader import checkpoint_format
    from jaxengine.loader.quantized import canonical_tensors, regrouped_tensors
    from jaxengine.loader.safetensors_io import iter_safetensors

    source, prefix = target.source, f"model.layers.{layer}."
    if source.gguf_file is not None:
        raise CheckpointError(f"{where}: the mtp method reads a safetensors checkpoint")
    found: Any = iter_safetensors(source.path, ignore_patterns=config.load_config.ignore_patterns)
    found = ((name, array) for name, array in found if name.startswith(prefix))
    stored = checkpoint_format(config.model_config.quantization, source, target.hf_config)
    if stored is not None:
        found = canonical_tensors(found, stored, where)
        group = target.config.quantization.group_size  # the target's, regrouped under TP
        if group != stored.scheme.group_size:
            found = regrouped_tensors(found, stored.scheme.group_size, group)
    tensors = [(mtp_tensor_name(name, layer), array) for name, array in found]
    tensors = [(name, array) for name, array in tensors if name is not None]
    if not any(name.startswith("model.eh_proj.") for name, _ in tensors):
        raise CheckpointError(
            f"{where}: the mtp method reads the multi-token-prediction layer "
            f"{prefix}* (num_nextn_predict_layers), which the checkpoint does not have"
        )
    return tensors


def _without_embedding(tree: Any) -> Any:
    """A head's parameter tree (or one of the same shape) without ``embed_tokens``."""
    return {"model": {k: v for k, v in tree["model"].items() if k != "embed_tokens"}}
