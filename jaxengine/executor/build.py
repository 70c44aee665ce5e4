"""Building an engine's parts from its config: model, tokenizer, KV cache, runner.

Resolves what only the model can tell: ``max_model_len`` (the model's context unless
the user asks for less), the EOS token, the generation config, and the KV cache size.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.core.limits import SchedulerLimits
from jaxengine.loader import LoadedModel, load_model
from jaxengine.loader.hf_config import load_generation_config
from jaxengine.runner.attention_backend import select_attention_backend
from jaxengine.runner.buckets import default_token_buckets
from jaxengine.runner.kv_sizing import KVCacheSize, bytes_per_block, plan_kv_cache
from jaxengine.runner.model_runner import ModelRunner, RunnerSettings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    loaded: LoadedModel
    tokenizer: Any
    generation_config: dict
    eos_token_id: int | None
    kv_size: KVCacheSize
    limits: SchedulerLimits
    runner: ModelRunner  # or, across hosts, DriverRunner / RayExecutor (same calls)


def model_max_len(hf_config: Any) -> int:
    """The longest context the checkpoint supports."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 2048


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = model_max_len(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's maximum context length {limit}"
        )
    return requested


def _eos(generation_config: dict, tokenizer: Any, hf_config: Any) -> int | None:
    eos = generation_config.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


def setup_compilation_cache(config: EngineConfig) -> None:
    """Turns on JAX's persistent compilation cache unless disabled."""
    comp = config.compilation_config
    if not comp.enable_compilation_cache:
        return
    import os

    path = os.path.expanduser(comp.compilation_cache_dir)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_components(config: EngineConfig, devices: Sequence[Any] | None = None) -> EngineParts:
    """Loads and sizes everything an `LLMEngine` needs, on ``devices`` (one replica's:
    pipeline x tensor of them; the first ones by default)."""
    from jaxengine.tokenizer import get_tokenizer
    from sharding.mesh import replica_devices
    from sharding.placement import Placement

    setup_compilation_cache(config)
    mc, parallel = config.model_config, config.parallel_config
    if devices is None:
        devices = replica_devices(parallel)[0]
    placement = Placement(parallel, devices)
    loaded = load_model(mc, config.load_config, placement)
    requested = config.attention_config.attention_backend
    backend = select_attention_backend(requested)
    logger.info(
        "attention backend: %s (--attention-backend %s, platform %s)",
        backend.name,
        requested,
        jax.default_backend(),
    )
    if placement.num_stages == 1:
        plan = placement.plans[0]
        module = loaded.module.clone(
            attention_kwargs=plan.attention_kwargs(backend.module_kwargs()),
            moe_kwargs=plan.moe_kwargs(),
        )
        loaded = dataclasses.replace(loaded, module=module)
    logger.info(
        "devices: %d (tensor %d x pipeline %d): %s",
        len(placement.devices),
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        ", ".join(str(d) for d in placement.devices),
    )
    max_model_len = resolve_max_model_len(mc.max_model_len, loaded.hf_config)
    config = config.with_max_model_len(max_model_len)
    tokenizer = None
    if not mc.skip_tokenizer_init:
        tokenizer = get_tokenizer(
            loaded.source,
            tokenizer=mc.tokenizer,
            tokenizer_mode=mc.tokenizer_mode,
            revision=mc.tokenizer_revision or mc.revision,
            trust_remote_code=mc.trust_remote_code,
        )
    generation_config = {}
    if mc.generation_config == "auto":
        generation_config = load_generation_config(loaded.source)
    elif mc.generation_config != "vllm":
        generation_config = load_generation_config(mc.generation_config)
    generation_config = {**generation_config, **(mc.override_generation_config or {})}
    eos = _eos(generation_config, tokenizer, loaded.hf_config)

    cc, sc, tc = config.cache_config, config.scheduler_config, loaded.config
    block_size = cc.block_size or 16
    per_block = bytes_per_block(  # on one device: its stage's layers, its KV heads
        max(len(r) for r in placement.layer_ranges),
        block_size,
        placement.plans[0].kv_heads_per_device,
        tc.head_dim,
        np.dtype(tc.dtype).itemsize,
    )
    kv_size = plan_kv_cache(
        per_block=per_block,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=sc.max_num_seqs,
        num_gpu_blocks_override=cc.num_gpu_blocks_override,
        kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
        gpu_memory_utilization=cc.gpu_memory_utilization,
        device=placement.devices[0] if jax.default_backend() != "cpu" else None,
    )
    logger.info(kv_size.describe(max_model_len))
    limits = SchedulerLimits.from_configs(
        sc, cc, kv_size.num_blocks, max_model_len, bytes_per_block=per_block
    )

    buckets = config.compilation_config.compile_token_buckets or default_token_buckets(
        sc.max_num_batched_tokens
    )
    if buckets[-1] < sc.max_num_batched_tokens:
        raise ValueError(
            f"--compile-token-buckets: the largest bucket {buckets[-1]} is smaller than "
            f"--max-num-batched-tokens {sc.max_num_batched_tokens}"
        )
    settings = RunnerSettings(
        block_size=block_size,
        num_blocks=kv_size.num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=sc.max_num_seqs,
        token_buckets=tuple(buckets),
        num_host_blocks=limits.num_host_blocks,
        max_logprobs=mc.max_logprobs,
        logprobs_mode=mc.logprobs_mode,
        seed=mc.seed,
        eos_token_id=eos,
    )
    if placement.num_stages == 1:
        runner = ModelRunner(loaded, settings, placement.plans[0])
    else:
        from sharding.pipeline import PipelineRunner

        runner = PipelineRunner(loaded, settings, placement, backend)
    return EngineParts(config, loaded, tokenizer, generation_config, eos, kv_size, limits, runner)


def build_engine_parts(config: EngineConfig, devices: Sequence[Any] | None = None) -> EngineParts:
    """`build_components` here, or across hosts: with ``--nnodes`` > 1 this process is
    the driver of a multi-host engine (`engine.multihost`); with
    ``--distributed-executor-backend ray`` the runner is a set of Ray workers
    (`engine.ray_executor`) and this process loads no parameters."""
    parallel = config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        from jaxengine.engine.ray_executor import start_ray

        return start_ray(config)
    if parallel.nnodes > 1:
        if parallel.node_rank != 0:
            raise ValueError(
                f"--node-rank {parallel.node_rank} is a follower: start it with "
                "`jaxengine serve --headless`"
            )
        from jaxengine.engine.multihost import start_driver

        return start_driver(config)
    return build_components(config, devices)
