"""Building one process's share of an engine: the model runner and the host parts.

`build_worker(config, devices)` loads the model onto ``devices`` (placed by the
parallel layout), resolves what only the model can tell (``max_model_len``, the EOS
token, the generation config), sizes the KV cache, and builds the `ModelRunner`
from its parts: a stage program (one tensor group, or pipeline stages), the sampler
and the runner's settings. Every executor builds its runners here: locally, on each
host of a multi-host engine, in each Ray worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxengine.config import EngineConfig
from jaxengine.core.limits import SchedulerLimits
from jaxengine.loader import LoadedModel, is_torch
from jaxengine.loader.hf_config import load_generation_config
from jaxengine.logits_processor import resolve_logits_processors
from jaxengine.lora.store import AdapterStore
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.models.layers.config import TransformerConfig
from jaxengine.models.layers.gated_delta import layer_state_shapes
from jaxengine.models.layers.lora import target_shapes
from jaxengine.reasoning.budget import budget_support
from jaxengine.reasoning.budget_processor import ThinkingTokenBudgetProcessor
from jaxengine.runner.attention_backend import AttentionBackend
from jaxengine.runner.buckets import default_token_buckets
from jaxengine.runner.executables import ExecutableStore
from jaxengine.runner.kv_sizing import (
    KVCacheSize,
    bytes_per_block,
    cache_dtype,
    device_memory,
    plan_kv_cache,
)
from jaxengine.runner.logits_processors import ProcessorBatch
from jaxengine.runner.lora_slots import LoRASlots
from jaxengine.runner.model_runner import ModelRunner, RunnerSettings
from jaxengine.runner.pooler import PoolerSettings
from jaxengine.runner.sampler_functions import SamplerFunctions
from jaxengine.runner.sampling_metadata import logprobs_bucket
from jaxengine.runner.states import hybrid_limits, pool_rows, reserve_states
from jaxengine.runner.step import make_classifier
from jaxengine.runner.weights import WeightLayout
from jaxengine.speculative.device.build import (
    draft_bytes_per_block,
    lookahead_tokens,
    make_proposer,
    num_speculative_tokens,
)
from jaxengine.speculative.device.loading import load_draft
from jaxengine.worker.images import encoder_bytes, encoder_runner, load_images
from jaxengine.worker.loading import load_replica, stage_program
from jaxengine.worker.pooling import resolve_pooler
from jaxengine.worker.target import CompileTarget, device_bytes
from sharding.placement import Placement

# the name it logged under before the worker had its own package (users filter on it)
logger = logging.getLogger("jaxengine.executor.build")

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""Set to 1: ``--max-model-len`` may exceed the model's context (vLLM's variable)."""


@dataclasses.dataclass(frozen=True)
class HostParts:
    """What the engine's host side needs of a built model: no device buffers."""

    config: EngineConfig  # max_model_len resolved
    model: TransformerConfig
    hf_config: Any  # transformers' PretrainedConfig of the checkpoint
    tokenizer: Any  # a transformers tokenizer, or None with --skip-tokenizer-init
    generation_config: dict
    eos_token_id: int | None
    kv_size: KVCacheSize
    limits: SchedulerLimits
    pooler: PoolerSettings | None = None  # a pooling model's (`--runner pooling`)
    images: Any = None  # a vision-language model's `multimodal.processor.ImageProcessor`

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


def model_max_len(hf_config: Any) -> int:
    """The longest context the checkpoint supports (a vision-language checkpoint's
    decoder's: its ``text_config``)."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
            value = getattr(config, name, None)
            if value:
                return int(value)
    return 2048


def sliding_window(model: TransformerConfig) -> int | None:
    """The smallest sliding window of the model's layers, or None if none slides."""
    windows = [layer.sliding_window for layer in model.layers if layer.sliding_window]
    return min(windows) if windows else None


def resolve_max_model_len(
    requested: int | None,
    hf_config: Any,
    model: TransformerConfig | None = None,
    disable_sliding_window: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """``--max-model-len``, or the model's context; with ``--disable-sliding-window``
    at most the model's sliding window (so no layer's window ever binds).

    ``$VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` (vLLM's variable) lets ``--max-model-len``
    exceed the model's context, with a warning: positions past it were never trained.
    """
    limit, what = model_max_len(hf_config), "the model's maximum context length"
    window = sliding_window(model) if disable_sliding_window and model is not None else None
    if window is not None and window < limit:
        limit, what = window, "the sliding window (--disable-sliding-window)"
    if requested is None or requested <= limit:
        return limit if requested is None else requested
    if window is None and environ.get(ALLOW_LONG_ENV, "0").strip().lower() in ("1", "true"):
        logger.warning(
            "--max-model-len %d exceeds %s %d: allowed by $%s; outputs past %d positions "
            "may be wrong",
            *(requested, what, limit, ALLOW_LONG_ENV, limit),
        )
        return requested
    raise ValueError(
        f"--max-model-len {requested} exceeds {what} {limit}"
        + (f" (set ${ALLOW_LONG_ENV}=1 to allow it)" if window is None else "")
    )


def _eos(generation_config: dict, tokenizer: Any, hf_config: Any) -> int | None:
    eos = generation_config.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


def lora_slots(config: EngineConfig, loaded: LoadedModel) -> LoRASlots | None:
    """The runner's adapter slots and host store (None without ``--enable-lora``)."""
    lc = config.lora_config
    if not lc.enable_lora:
        return None
    targets = target_shapes(loaded.config)
    store = AdapterStore(targets, lc.max_lora_rank, lc.max_loras, lc.cpu_loras)
    return LoRASlots(store, loaded.params)


def _host_side(config: EngineConfig, loaded: LoadedModel) -> tuple[EngineConfig, Any, dict]:
    """(config with max_model_len resolved, tokenizer or None, generation config)."""
    from jaxengine.tokenizer import get_tokenizer

    mc = config.model_config
    max_model_len = resolve_max_model_len(
        mc.max_model_len, loaded.hf_config, loaded.config, mc.disable_sliding_window
    )
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
    return config, tokenizer, generation_config


def _size_cache(
    config: EngineConfig,
    placement: Placement,
    model: TransformerConfig,
    extra: int = 0,
    memory: tuple[int, int] | None = None,
    reserved: int = 0,
):
    """(KV-cache size, scheduler limits, cache dtype name) for this replica; ``extra``:
    bytes each page also takes in another cache (a draft model's); ``memory``: (limit,
    in use) bytes of a device (None: measured on an accelerator, unknown on CPU);
    ``reserved``: bytes a device will hold besides (the image encoder's)."""
    cc, sc = config.cache_config, config.scheduler_config
    dtype = cache_dtype(config, model)
    states = layer_state_shapes(model, sum(pool_rows(config)))  # a hybrid's (`runner.states`)
    layers = max(len(r) for r in placement.layer_ranges)
    per_block = bytes_per_block(  # on one device: its stage's layers, its KV heads
        layers if states is None else sum(s is None for s in states),
        cc.block_size,
        1,  # kv_parts: a device's rows of every head
        kv_cache_shape(model, 1, 1, 1, placement.platform)[3],  # a row's (padded) width
        dtype.itemsize,
        kv_parts=_rows_per_device(model, placement),  # K and V (padded), or MLA latent rows
    )
    max_model_len = config.model_config.max_model_len
    memory = memory or _measured(placement)
    if memory is not None:
        memory = (memory[0], memory[1] + reserved)
    kv_bytes, memory = reserve_states(states, cc.kv_cache_memory_bytes, memory)
    kv_size = plan_kv_cache(
        per_block=per_block + extra,
        block_size=cc.block_size,
        max_model_len=max_model_len,
        max_num_seqs=sc.max_num_seqs,
        num_gpu_blocks_override=cc.num_gpu_blocks_override,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=cc.gpu_memory_utilization,
        memory=memory,
    )
    logger.info("%s, %s", kv_size.describe(max_model_len), dtype.name)
    limits = SchedulerLimits.from_configs(
        sc, cc, kv_size.num_blocks, max_model_len, bytes_per_block=per_block
    )
    return kv_size, hybrid_limits(config, limits, states), dtype


def _rows_per_device(model: TransformerConfig, placement: Placement) -> int:
    """A device's rows of one layer's cache page slot: its heads' K and V (on TPU
    padded, `layers.attention.tpu_cache_rows`), or its MLA latent row."""
    heads = placement.plans[0].kv_heads_per_device
    return kv_cache_shape(model, 1, 1, heads, placement.platform)[2]


def _measured(placement: Placement) -> tuple[int, int] | None:
    """(limit, in use) bytes of the replica's first device; None on CPU."""
    return device_memory(placement.devices[0]) if placement.platform != "cpu" else None


def token_buckets(config: EngineConfig) -> tuple[int, ...]:
    """The step sizes to compile: ``--compile-token-buckets`` or the defaults."""
    budget = config.scheduler_config.max_num_batched_tokens
    buckets = config.compilation_config.compile_token_buckets or default_token_buckets(budget)
    if buckets[-1] < budget:
        raise ValueError(
            f"--compile-token-buckets: the largest bucket {buckets[-1]} is smaller than "
            f"--max-num-batched-tokens {budget}"
        )
    return tuple(buckets)


def executable_store(
    config: EngineConfig, loaded: LoadedModel, backend: AttentionBackend, encoder: Any = None
) -> ExecutableStore | None:
    """Where compiled steps persist across restarts: beside the compilation cache,
    keyed by everything that shapes the program (None when the cache is off, and
    on multi-host engines)."""
    comp = config.compilation_config
    if not comp.enable_compilation_cache or jax.process_count() > 1 or is_torch(loaded):
        return None  # across hosts every process must compile the same program
    import os

    # the devices too: a data-parallel replica's executables run on its own devices
    shapes = jax.tree_util.tree_map(
        lambda x: (x.shape, str(x.dtype), str(x.sharding), sorted(d.id for d in x.devices())),
        loaded.params,
    )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    del fields["compilation_config"]  # where and when to compile, not what
    program = repr((fields, loaded.config, encoder))  # (encoder: an image encoder's config)
    program += f"\n{backend.name}\n{shapes}"
    directory = os.path.join(os.path.expanduser(comp.compilation_cache_dir), "executables")
    return ExecutableStore(directory, program)


def _runner_settings(config, model, kv_size, limits, dtype, page, eos, pooler) -> RunnerSettings:
    mc = config.model_config
    return RunnerSettings(
        block_size=kv_size.block_size,
        num_blocks=kv_size.num_blocks,
        max_model_len=mc.max_model_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        token_buckets=token_buckets(config),
        vocab_size=model.vocab_size,
        cache_page_shape=page,
        cache_dtype=dtype,
        num_layers=len(model.layers),
        num_host_blocks=limits.num_host_blocks,
        max_logprobs=mc.max_logprobs,
        logprobs_mode=mc.logprobs_mode,
        seed=mc.seed,
        eos_token_id=eos,
        calculate_kv_scales=config.cache_config.calculate_kv_scales and model.kv_cache_scales,
        num_speculative_tokens=num_speculative_tokens(config),
        pooler=pooler,
        hidden_size=model.hidden_size,
        state_shapes=layer_state_shapes(model, sum(pool_rows(config))),
    )


def logits_processors(
    config: EngineConfig, pooler: PoolerSettings | None, sharding: Any, tokenizer: Any = None
) -> ProcessorBatch | None:
    """The custom logits processors (``--logits-processors``), each class imported by
    its name in this process and instantiated once, then the built-in thinking-budget
    processor where the reasoning parser has one end token (`reasoning.budget`); None
    without any."""
    classes = resolve_logits_processors(config.model_config.logits_processors)
    if classes and pooler is not None:
        raise ValueError("Pooling models do not support custom logits processors.")
    processors = [cls(config, sharding, False) for cls in classes]
    markers = budget_support(config, tokenizer, pooling=pooler is not None).markers
    if markers is not None:
        processors.append(ThinkingTokenBudgetProcessor(config, sharding, False, markers))
    return ProcessorBatch(processors) if processors else None


def _runner_limits(config: EngineConfig, limits: SchedulerLimits, encoder: Any):
    """The scheduler's limits with what the runner's parts add (adapters, proposals,
    the image encoder's rows)."""
    return dataclasses.replace(
        limits,
        max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else 0,
        num_speculative_tokens=num_speculative_tokens(config),
        num_lookahead_tokens=lookahead_tokens(config),
        encoder_cache_rows=0 if encoder is None else encoder.num_rows,
        whole_images=encoder is not None and encoder.both_ways,
    )


def build_worker(
    config: EngineConfig,
    devices: Sequence[Any] | None = None,
    target: CompileTarget | None = None,
) -> tuple[ModelRunner, HostParts]:
    """This process's runner on ``devices`` (one replica's: pipeline x tensor of them;
    the first ones by default), and the host parts. ``target``: a compile-only runner
    (`worker.target`), whose `warmup` compiles every start-up program through the
    target's store."""
    placement, loaded, backend = load_replica(config, devices, abstract=target is not None)
    config, tokenizer, generation_config = _host_side(config, loaded)
    eos = _eos(generation_config, tokenizer, loaded.hf_config)
    model, mc, pooler = loaded.config, config.model_config, resolve_pooler(config, loaded)
    images = load_images(config, loaded, abstract=target is not None)
    draft = load_draft(config, devices, loaded, load_replica)
    memory = None if target is None else (target.hbm_bytes, device_bytes(loaded.params))
    reserved = encoder_bytes(config, images, model.dtype)  # placed after the cache
    extra = draft_bytes_per_block(config, draft)  # a draft's pages beside each page
    kv_size, limits, dtype = _size_cache(config, placement, model, extra, memory, reserved)
    plan = placement.plans[0]
    heads, tp = plan.kv_cache_heads, plan.tensor_size
    page_shape = kv_cache_shape(model, 1, kv_size.block_size, heads, placement.platform, tp)[1:]
    settings = _runner_settings(config, model, kv_size, limits, dtype, page_shape, eos, pooler)
    k = logprobs_bucket(mc.max_logprobs, model.vocab_size) or 0
    store = executable_store(config, loaded, backend, images and images.encoder.config)
    store = store if target is None else target.store
    mode = config.compilation_config.cudagraph_mode
    program = stage_program(loaded, placement, backend, k, store, pooler is not None, mode)
    sampler = SamplerFunctions(
        model.vocab_size,
        max_logprobs=mc.max_logprobs,
        logprobs_mode=mc.logprobs_mode,
        max_model_len=mc.max_model_len,
        max_num_seqs=settings.num_sample_slots,
        logits_sharding=program.logits_sharding,
        store=store,
        processors=logits_processors(config, pooler, program.logits_sharding, tokenizer),
    )
    proposer = make_proposer(config, draft, settings, loaded)
    encoder = None
    if images is not None:
        encoder = encoder_runner(config, loaded, images, plan, store, target is not None)
    runner = ModelRunner(
        program,
        loaded.params,
        settings,
        sampler,
        lora_slots(config, loaded),
        proposer,
        make_classifier(loaded.module) if pooler and pooler.num_labels else None,
        None if is_torch(loaded) else WeightLayout.of(loaded),
        encoder,
        abstract=target is not None,
    )
    limits = _runner_limits(config, limits, encoder)
    host = HostParts(
        config, model, loaded.hf_config, tokenizer, generation_config, eos, kv_size, limits,
        pooler, None if images is None else images.processor,
    )  # fmt: skip
    return runner, host
