"""Loading an EAGLE head (``--speculative-config '{"method": "eagle", "model": PATH}'``)
and building its proposer (`models.eagle`, `runner.eagle`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.executor.loading import LoadedDraft, setup_compilation_cache
from jaxengine.loader import LoadedModel, resolve_source
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.params import abstract_params, dummy_params, logical_axes, params_from_tensors
from jaxengine.models import family_config
from jaxengine.models.eagle import EagleHead, eagle_tensor_name
from jaxengine.runner.attention_backend import select_attention_backend
from jaxengine.runner.draft import DraftSettings
from jaxengine.runner.eagle import EagleProposer, make_eagle_step
from jaxengine.runner.program import abstract_like
from sharding.placement import Placement

_EMBED = "model.embed_tokens.weight"


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
    if shared:  # the step reads the target's embedding (`runner.eagle`)
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


def eagle_proposer(draft: LoadedDraft, settings: DraftSettings, target: LoadedModel):
    """The EAGLE proposer of ``draft`` (`load_eagle`'s) for ``target``'s runner."""
    plan = draft.placement.plans[0]
    head = draft.loaded.module.clone(
        attention_kwargs=plan.attention_kwargs(draft.backend.module_kwargs())
    )
    step = make_eagle_step(head, target.module, settings.max_num_seqs, draft.shared_embedding)
    multi = len(draft.placement.devices) > 1
    source = jax.ShapeDtypeStruct(
        (1, target.config.hidden_size),
        target.config.dtype,
        sharding=plan.replicated if multi else None,
    )
    return EagleProposer(
        step,
        draft.loaded.params,
        settings,
        len(draft.loaded.config.layers),
        source,
        abstract_like(target.params),
        plan.kv_cache_sharding if multi else None,
    )
