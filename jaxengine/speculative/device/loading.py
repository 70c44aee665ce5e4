"""Loading what a device-side proposer runs: a draft model (through the same path
as the target's, which the worker hands in as ``load_replica``) or an EAGLE head
(``--speculative-config '{"method": "eagle", "model": PATH}'``, `models.eagle`),
on the target's devices, checked against the target."""

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
from jaxengine.models import family_config
from jaxengine.models.eagle import EagleHead, eagle_tensor_name
from jaxengine.runner.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.runner.executables import setup_compilation_cache
from sharding.placement import Placement

ON_DEVICE = ("draft_model", "eagle")  # methods that run a model of their own
_EMBED = "model.embed_tokens.weight"

ReplicaLoader = Callable[[EngineConfig, Sequence[Any] | None], tuple]
"""The worker's `load_replica`: (config, devices) -> (placement, model, backend)."""


@dataclasses.dataclass(frozen=True)
class LoadedDraft:
    """The draft model or EAGLE head, loaded on the target's devices."""

    placement: Placement
    loaded: LoadedModel
    backend: AttentionBackend
    shared_embedding: bool = False  # an EAGLE head that reads the target's embedding


def load_draft(
    config: EngineConfig,
    devices: Sequence[Any] | None,
    target: LoadedModel,
    load_replica: ReplicaLoader,
) -> LoadedDraft | None:
    """The draft model or EAGLE head of ``config`` (None for the other methods),
    checked against the target: JAX models, same vocabulary (and hidden size for a
    head). A draft model loads through ``load_replica``, the target's own path."""
    method = config.speculative_config.method
    if method not in ON_DEVICE:
        return None
    if is_torch(target):
        raise ValueError(
            f"speculative_config: the {method} method needs the target's JAX model "
            "(--model-impl jax)"
        )
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
