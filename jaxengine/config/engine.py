"""EngineConfig: the root of the config tree, one field per config class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxengine.config.attention import AttentionConfig
from jaxengine.config.cache import FP8_CACHE_DTYPES, CacheConfig
from jaxengine.config.compilation import CompilationConfig
from jaxengine.config.load import LoadConfig
from jaxengine.config.lora import LoRAConfig
from jaxengine.config.model import ModelConfig
from jaxengine.config.multimodal import MultiModalConfig
from jaxengine.config.observability import ObservabilityConfig
from jaxengine.config.parallel import ParallelConfig
from jaxengine.config.scheduler import MIN_UNCHUNKED_BATCHED_TOKENS, SchedulerConfig
from jaxengine.config.speculative import SpeculativeConfig
from jaxengine.config.structured_outputs import StructuredOutputsConfig
from jaxengine.config.utils import require


@dataclass(frozen=True)
class EngineConfig:
    """All the configuration of one engine; built by EngineArgs.create_engine_config.

    Composed, not inherited: each part is its own frozen dataclass. Change it only
    through `dataclasses.replace` (or `with_max_model_len`).
    """

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Which model, its tokenizer, dtype and context length."""
    load_config: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    """How the weights are loaded."""
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    """The paged KV cache."""
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    """Token budget, request cap and policy of the scheduler."""
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Distribution over devices and hosts."""
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    """Compiled shape buckets and the XLA compilation cache."""
    attention_config: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    """Which attention kernels run."""
    structured_outputs_config: StructuredOutputsConfig = dataclasses.field(
        default_factory=StructuredOutputsConfig
    )
    """Constrained decoding and reasoning."""
    lora_config: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    """LoRA adapters (`--enable-lora`)."""
    speculative_config: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    """Speculative decoding (`--speculative-config`)."""
    multimodal_config: MultiModalConfig = dataclasses.field(default_factory=MultiModalConfig)
    """Images in (`--limit-mm-per-prompt`, `--mm-processor-kwargs`, media paths)."""
    observability_config: ObservabilityConfig = dataclasses.field(
        default_factory=ObservabilityConfig
    )
    """Deprecated metrics kept behind a version (`--show-hidden-metrics-for-version`)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            require(
                isinstance(value, _CLASSES[f.name]),
                f.name,
                f"must be a {_CLASSES[f.name].__name__}, got {type(value).__name__}",
            )
        max_len = self.model_config.max_model_len
        sched = self.scheduler_config
        if max_len is not None and sched.max_num_batched_tokens is not None:
            require(
                sched.chunked_prefill or sched.max_num_batched_tokens >= max_len,
                "max_num_batched_tokens",
                f"({sched.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_len}): a whole prompt must fit in one step when chunked prefill "
                "is disabled; raise --max-num-batched-tokens, lower --max-model-len or "
                "enable chunked prefill",
            )

        if sched.async_scheduling:
            self._check_async_scheduling()
        if self.cache_config.calculate_kv_scales:
            self._check_calculate_kv_scales()
        if self.lora_config.enable_lora:
            self._check_lora()
        if self.speculative_config.enabled:
            self._check_speculative()

    def _check_speculative(self) -> None:
        sched, parallel = self.scheduler_config, self.parallel_config
        require(
            not sched.async_scheduling,
            "speculative_config",
            "speculative decoding is not supported with --async-scheduling yet",
        )
        require(
            parallel.pipeline_parallel_size == 1,
            "speculative_config",
            "speculative decoding is not supported with pipeline parallelism yet "
            f"(--pipeline-parallel-size {parallel.pipeline_parallel_size})",
        )
        require(
            not self.model_config.logits_processors,
            "logits_processors",
            "custom logits processors are not supported with speculative decoding "
            "(--speculative-config), as in vLLM",
        )
        k = self.speculative_config.num_speculative_tokens
        require(
            sched.num_lookahead_slots in (0, k),
            "num_lookahead_slots",
            f"({sched.num_lookahead_slots}) must be 0 or num_speculative_tokens ({k}): "
            "the lookahead slots hold the proposed tokens",
        )

    def _check_lora(self) -> None:
        require(
            self.parallel_config.pipeline_parallel_size == 1,
            "enable_lora",
            "LoRA adapters are not supported with pipeline parallelism yet "
            f"(--pipeline-parallel-size {self.parallel_config.pipeline_parallel_size})",
        )
        require(
            self.model_config.model_impl in ("auto", "jax"),
            "enable_lora",
            f"LoRA adapters need the JAX model (--model-impl {self.model_config.model_impl} "
            "runs PyTorch modules, which hold no adapter slots)",
        )

    def _check_async_scheduling(self) -> None:
        parallel = self.parallel_config
        require(
            parallel.pipeline_parallel_size == 1,
            "async_scheduling",
            "is not supported with pipeline parallelism (--pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size})",
        )
        require(
            parallel.nnodes == 1 and parallel.distributed_executor_backend != "ray",
            "async_scheduling",
            "is not supported across hosts (--nnodes > 1 or the ray backend)",
        )

    def _check_calculate_kv_scales(self) -> None:
        cache = self.cache_config
        require(
            cache.kv_cache_dtype in FP8_CACHE_DTYPES,
            "calculate_kv_scales",
            f"needs an fp8 KV cache (--kv-cache-dtype fp8), not {cache.kv_cache_dtype!r}",
        )
        require(
            self.parallel_config.pipeline_parallel_size == 1,
            "calculate_kv_scales",
            "is not supported with pipeline parallelism yet",
        )

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """A copy with `max_model_len` set (once the model's length is known).

        Also resolves a still-unset `max_num_batched_tokens` (chunked prefill off)
        to max(max_model_len, 2048), so the scheduler always sees an int.
        """
        model = dataclasses.replace(self.model_config, max_model_len=max_model_len)
        sched = self.scheduler_config
        if sched.max_num_batched_tokens is None:
            budget = max(max_model_len, MIN_UNCHUNKED_BATCHED_TOKENS)
            sched = dataclasses.replace(sched, max_num_batched_tokens=budget)
        return dataclasses.replace(self, model_config=model, scheduler_config=sched)


_CLASSES = {
    "model_config": ModelConfig,
    "load_config": LoadConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "compilation_config": CompilationConfig,
    "attention_config": AttentionConfig,
    "structured_outputs_config": StructuredOutputsConfig,
    "lora_config": LoRAConfig,
    "speculative_config": SpeculativeConfig,
    "multimodal_config": MultiModalConfig,
    "observability_config": ObservabilityConfig,
}
