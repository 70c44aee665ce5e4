"""Loading one replica's model and building its stage program: the parts of
`build_worker` that a draft model (speculative decoding) goes through too."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxengine.config import EngineConfig, ModelConfig
from jaxengine.config.cache import FP8_CACHE_DTYPES
from jaxengine.extras import require_torch
from jaxengine.loader import LoadedModel, is_torch, load_model
from jaxengine.loader.sources import ModelSource
from jaxengine.models import UnsupportedArchitectureError
from jaxengine.models.layers.lora import LoRASpec
from jaxengine.multimodal.processor import images_both_ways
from jaxengine.runner.attention_backend import AttentionBackend, select_attention_backend
from jaxengine.runner.executables import ExecutableStore, setup_compilation_cache
from jaxengine.runner.piecewise import program_class
from jaxengine.runner.program import StageProgram, single_stage
from sharding.placement import Placement

logger = logging.getLogger("jaxengine.executor.build")  # the start-up lines' logger


def load_replica(config: EngineConfig, devices: Sequence[Any] | None, abstract: bool = False):
    """(placement, loaded model, attention backend) on this replica's devices;
    ``abstract``: the parameters as placed shapes (a compile-only engine)."""
    from sharding.mesh import replica_devices

    setup_compilation_cache(config)
    parallel = config.parallel_config
    if devices is None:
        devices = replica_devices(parallel)[0]
    placement = Placement(parallel, devices)
    loaded = load_jax_or_torch(config, placement, abstract)
    requested = config.attention_config.attention_backend
    both_ways = images_both_ways(loaded.hf_config)
    family_spec = getattr(loaded.config, "family_spec", None)
    backend = select_attention_backend(
        requested,
        placement.platform,
        both_ways,
        placement.device_kind,
        mla=getattr(loaded.config, "mla", None) is not None,  # DeepSeek-V3's latent cache
        gated_delta=getattr(family_spec, "gated_delta", None) is not None,  # Qwen3-Next, 3.5
    )
    logger.info(
        "attention backend: %s (--attention-backend %s, platform %s)",
        backend.name,
        requested,
        placement.platform,
    )
    logger.info(
        "devices: %d (tensor %d x pipeline %d): %s",
        len(placement.devices),
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        ", ".join(str(d) for d in placement.devices),
    )
    return placement, loaded, backend


def load_jax_or_torch(
    config: EngineConfig, placement: Placement, abstract: bool = False
) -> LoadedModel:
    """The JAX model, or transformers' PyTorch one (`torch_fallback`) as
    ``--model-impl`` asks: ``auto`` falls back when the architecture has no JAX port
    (never for a compile-only engine, ``abstract``: the fallback has no JAX program)."""
    impl = config.model_config.model_impl
    if impl != "transformers":
        try:
            return load_model(
                config.model_config,
                config.load_config,
                placement,
                max_parallel_loading_workers=config.parallel_config.max_parallel_loading_workers,
                kv_cache_scales=config.cache_config.kv_cache_dtype in FP8_CACHE_DTYPES,
                lora=lora_spec(config),
                token_ids=functools.partial(token_ids, config.model_config),
                abstract=abstract,
            )
        except UnsupportedArchitectureError as e:
            if impl != "auto" or abstract:
                raise
            require_torch(f"{e}; the torch fallback (--model-impl transformers) that runs it")
            logger.info("--model-impl auto: using transformers' PyTorch model (%s)", e)
    require_torch("--model-impl transformers (the torch fallback)")
    from torch_fallback.loader import load_torch_model

    loaded = load_torch_model(config)
    placement(loaded.config, {}, {})  # stage and tensor plans for the cache sizing
    return loaded


def token_ids(model_config: ModelConfig, source: ModelSource, tokens: list[str]) -> list:
    """Each token's id in the model's tokenizer, None for one it does not know (a
    classifier made from LM-head rows: `loader.load_model`'s ``token_ids``)."""
    from jaxengine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(
        source,
        tokenizer=model_config.tokenizer,
        tokenizer_mode=model_config.tokenizer_mode,
        revision=model_config.tokenizer_revision or model_config.revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    unknown = tokenizer.unk_token_id
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    return [None if i is None or (i == unknown and t != tokenizer.unk_token) else i
            for t, i in zip(tokens, ids, strict=True)]  # fmt: skip


def lora_spec(config: EngineConfig) -> LoRASpec | None:
    """The adapter slots ``--enable-lora`` asks for (dtype None: the model's)."""
    lc = config.lora_config
    if not lc.enable_lora:
        return None
    dtype = None if lc.lora_dtype == "auto" else jnp.dtype(lc.lora_dtype)
    return LoRASpec(lc.max_loras, lc.max_lora_rank, dtype, lc.fully_sharded_loras)


def stage_program(
    loaded: LoadedModel,
    placement: Placement,
    backend: AttentionBackend,
    k: int,
    store: ExecutableStore | None = None,
    pooling: bool = False,
    cudagraph_mode: str | None = None,
) -> StageProgram:
    """One tensor group's program, or the pipeline's stages (or the PyTorch model's);
    ``pooling``: a pooling model's (hidden states only, one tensor group);
    ``cudagraph_mode``: a single stage's FULL or PIECEWISE step (`runner.piecewise`)."""
    if is_torch(loaded):
        from torch_fallback.loader import torch_device
        from torch_fallback.program import TorchProgram

        return TorchProgram(loaded.module, k, torch_device())
    if placement.num_stages > 1:
        from jaxengine.runner.pipeline import PipelineStages

        return PipelineStages(
            loaded.module,
            placement,
            backend,
            k,
            loaded.logical_axes,
            loaded.config.tie_word_embeddings,
        )
    plan = placement.plans[0]
    program = program_class(loaded.module, cudagraph_mode, plan)
    layers = len(loaded.config.layers)
    return single_stage(
        loaded.module, layers, plan, backend.module_kwargs(), k, store, pooling, program
    )
