"""EngineArgs: one flat field per engine flag, turned into argparse flags and an EngineConfig.

The flags are generated from the config dataclasses (`jaxengine.config`): the flag
name is `--` + field name with `_` -> `-`, the help text is the field's docstring,
and the type, choices and nargs follow its annotation. From Python,
`EngineArgs(**kwargs)` takes the same names and validates them the same way.

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

from jaxengine.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_supported,
)
from jaxengine.config import cache as cache_mod
from jaxengine.config import scheduler as sched_mod
from jaxengine.config.arg_utils import (
    FlexibleArgumentParser,
    parse_human_int,
    parse_json_flag,
)
from jaxengine.config.attention import AttentionBackendName
from jaxengine.config.cache import BlockSize, CacheDType, PrefixCachingHashAlgo
from jaxengine.config.compilation import CudagraphMode
from jaxengine.config.guided_decoding import add_guided_decoding_flags, with_guided_decoding
from jaxengine.config.load import LoadFormat
from jaxengine.config.lora import LoRADType
from jaxengine.config.model import (
    ConvertType,
    LogprobsMode,
    ModelDType,
    ModelImpl,
    QuantizationMethod,
    RunnerType,
    TaskOption,
    TokenizerMode,
    auto_dtype,
)
from jaxengine.config.parallel import DistributedExecutorBackend
from jaxengine.config.scheduler import SchedulingPolicy
from jaxengine.config.utils import (
    check_field,
    config_field,
    field_docs,
    field_types,
    literal_choices,
    union_args,
)

# The config classes behind the flags, in --help order (and EngineConfig field name).
CONFIG_CLASSES: dict[str, type] = {
    "model_config": ModelConfig,
    "load_config": LoadConfig,
    "parallel_config": ParallelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "compilation_config": CompilationConfig,
    "attention_config": AttentionConfig,
    "structured_outputs_config": StructuredOutputsConfig,
    "lora_config": LoRAConfig,
    "speculative_config": SpeculativeConfig,
    "multimodal_config": MultiModalConfig,
    "observability_config": ObservabilityConfig,
}


@functools.cache
def _field_owners() -> dict[str, type]:
    """Maps each flag's field name to the config class that defines it."""
    owners = {}
    for cls in CONFIG_CLASSES.values():
        for f in dataclasses.fields(cls):
            assert f.name not in owners, f"field {f.name} defined twice"
            owners[f.name] = cls
    return owners


def _default(name: str) -> Any:
    """An EngineArgs field whose default is the default of config field `name`."""
    f = config_field(_field_owners()[name], name)
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    return dataclasses.field(default=f.default)


@dataclass
class EngineArgs:
    """Arguments for the engine, one per flag; see the config classes for their meaning."""

    # ModelConfig
    model: str = _default("model")
    tokenizer: str | None = _default("tokenizer")
    tokenizer_mode: TokenizerMode = _default("tokenizer_mode")
    model_impl: ModelImpl = _default("model_impl")
    trust_remote_code: bool = _default("trust_remote_code")
    revision: str | None = _default("revision")
    code_revision: str | None = _default("code_revision")
    tokenizer_revision: str | None = _default("tokenizer_revision")
    dtype: ModelDType = _default("dtype")
    max_model_len: int | None = _default("max_model_len")
    seed: int = _default("seed")
    served_model_name: str | list[str] | None = _default("served_model_name")
    hf_overrides: dict = _default("hf_overrides")
    generation_config: str = _default("generation_config")
    override_generation_config: dict = _default("override_generation_config")
    quantization: QuantizationMethod | None = _default("quantization")
    skip_tokenizer_init: bool = _default("skip_tokenizer_init")
    max_logprobs: int = _default("max_logprobs")
    enforce_eager: bool = _default("enforce_eager")
    enable_sleep_mode: bool = _default("enable_sleep_mode")
    chat_template: str | None = _default("chat_template")
    disable_sliding_window: bool = _default("disable_sliding_window")
    logprobs_mode: LogprobsMode = _default("logprobs_mode")
    runner: RunnerType = _default("runner")
    convert: ConvertType = _default("convert")
    task: TaskOption | None = _default("task")
    pooler_config: dict | None = _default("pooler_config")
    logits_processors: list[str | type] | None = _default("logits_processors")
    # LoadConfig
    load_format: LoadFormat = _default("load_format")
    download_dir: str | None = _default("download_dir")
    ignore_patterns: list[str] = _default("ignore_patterns")
    # ParallelConfig
    tensor_parallel_size: int = _default("tensor_parallel_size")
    pipeline_parallel_size: int = _default("pipeline_parallel_size")
    data_parallel_size: int = _default("data_parallel_size")
    enable_expert_parallel: bool = _default("enable_expert_parallel")
    distributed_executor_backend: DistributedExecutorBackend | None = _default(
        "distributed_executor_backend"
    )
    data_parallel_size_local: int | None = _default("data_parallel_size_local")
    data_parallel_start_rank: int | None = _default("data_parallel_start_rank")
    data_parallel_address: str | None = _default("data_parallel_address")
    data_parallel_rpc_port: int | None = _default("data_parallel_rpc_port")
    max_parallel_loading_workers: int | None = _default("max_parallel_loading_workers")
    nnodes: int = _default("nnodes")
    node_rank: int = _default("node_rank")
    master_addr: str = _default("master_addr")
    master_port: int = _default("master_port")
    # CacheConfig
    block_size: BlockSize | None = _default("block_size")
    gpu_memory_utilization: float = _default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = _default("kv_cache_memory_bytes")
    num_gpu_blocks_override: int | None = _default("num_gpu_blocks_override")
    swap_space: float = _default("swap_space")
    kv_cache_dtype: CacheDType = _default("kv_cache_dtype")
    calculate_kv_scales: bool = _default("calculate_kv_scales")
    enable_prefix_caching: bool | None = _default("enable_prefix_caching")
    prefix_caching_hash_algo: PrefixCachingHashAlgo = _default("prefix_caching_hash_algo")
    cpu_offload_gb: float = _default("cpu_offload_gb")
    # SchedulerConfig
    max_num_seqs: int | None = _default("max_num_seqs")
    max_num_batched_tokens: int | None = _default("max_num_batched_tokens")
    max_num_queued_reqs: int | None = _default("max_num_queued_reqs")
    max_num_queued_tokens: int | None = _default("max_num_queued_tokens")
    enable_chunked_prefill: bool | None = _default("enable_chunked_prefill")
    max_num_partial_prefills: int = _default("max_num_partial_prefills")
    max_long_partial_prefills: int = _default("max_long_partial_prefills")
    long_prefill_token_threshold: int = _default("long_prefill_token_threshold")
    scheduling_policy: SchedulingPolicy = _default("scheduling_policy")
    async_scheduling: bool | None = _default("async_scheduling")
    num_lookahead_slots: int = _default("num_lookahead_slots")
    # CompilationConfig
    compile_token_buckets: list[int] = _default("compile_token_buckets")
    compilation_cache_dir: str = _default("compilation_cache_dir")
    enable_compilation_cache: bool = _default("enable_compilation_cache")
    background_compile: bool = _default("background_compile")
    cudagraph_mode: CudagraphMode | None = _default("cudagraph_mode")
    # AttentionConfig
    attention_backend: AttentionBackendName = _default("attention_backend")
    # StructuredOutputsConfig
    structured_outputs_config: dict = _default("structured_outputs_config")
    reasoning_parser: str = _default("reasoning_parser")
    reasoning_parser_plugin: str = _default("reasoning_parser_plugin")
    # LoRAConfig
    enable_lora: bool = _default("enable_lora")
    max_loras: int = _default("max_loras")
    max_lora_rank: int = _default("max_lora_rank")
    max_cpu_loras: int | None = _default("max_cpu_loras")
    lora_dtype: LoRADType = _default("lora_dtype")
    fully_sharded_loras: bool = _default("fully_sharded_loras")
    # SpeculativeConfig
    speculative_config: dict | None = _default("speculative_config")
    # MultiModalConfig
    limit_mm_per_prompt: dict = _default("limit_mm_per_prompt")
    mm_processor_kwargs: dict | None = _default("mm_processor_kwargs")
    allowed_local_media_path: str = _default("allowed_local_media_path")
    allowed_media_domains: list[str] | None = _default("allowed_media_domains")
    # ObservabilityConfig
    show_hidden_metrics_for_version: str | None = _default("show_hidden_metrics_for_version")

    def __post_init__(self) -> None:
        """Validates every value against its config field, then cross-field rules."""
        owners = _field_owners()
        for f in dataclasses.fields(self):
            check_field(owners[f.name], f.name, getattr(self, f.name))
        self._build()

    # --- Python and CLI construction -------------------------------------------------

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from a parsed namespace; attributes it lacks keep their defaults.
        vLLM's deprecated ``--guided-decoding-*`` values join structured_outputs_config."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        if "structured_outputs_config" in values:
            options = values["structured_outputs_config"]
            values["structured_outputs_config"] = with_guided_decoding(options, args)
        return cls(**values)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one flag per field, grouped by config class, plus `--config` and vLLM's
        deprecated ``--guided-decoding-*`` aliases (`config/guided_decoding.py`).

        With a FlexibleArgumentParser, cross-field errors (e.g. max_long_partial_prefills
        > max_num_partial_prefills) are also reported at parse time.
        """
        if "--config" not in parser._option_string_actions:
            parser.add_argument(
                "--config",
                metavar="FILE",
                help="Read flags from a YAML file whose keys are flag names ('-' or '_'). "
                "Flags given on the command line override the file.",
            )
        for cls in CONFIG_CLASSES.values():
            group = _group(parser, cls)
            for f in dataclasses.fields(cls):
                flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
                group.add_argument(*flags, **_flag_kwargs(cls, f.name))
            if cls is StructuredOutputsConfig:
                add_guided_decoding_flags(group)
        if isinstance(parser, FlexibleArgumentParser):
            parser.add_post_parse_check(_check_namespace)
        return parser

    # --- EngineConfig ----------------------------------------------------------------

    def _build(self, **overrides: Any) -> EngineConfig:
        """The config tree from these values (and `overrides`), unresolved."""
        values = {**dataclasses.asdict(self), **overrides}
        parts = {}
        for part, cls in CONFIG_CLASSES.items():
            parts[part] = cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
        return EngineConfig(**parts)

    def create_model_configs(self) -> tuple[ModelConfig, LoadConfig]:
        """The model's and the load's configs alone: what reading the checkpoint's
        config needs (`worker.pooling.is_pooling_model`) before the rest resolves."""
        values = dataclasses.asdict(self)
        parts = []
        for cls in (ModelConfig, LoadConfig):
            parts.append(cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)}))
        return parts[0], parts[1]

    def create_engine_config(
        self, platform: str | None = None, pooling: bool = False
    ) -> EngineConfig:
        """The EngineConfig, with unset defaults resolved; raises on unsupported features.

        Resolves: block_size -> 16, enable_prefix_caching/enable_chunked_prefill ->
        True, max_num_batched_tokens -> 8192 with chunked prefill (else
        max(max_model_len, 2048), or left None until the model length is known, see
        EngineConfig.with_max_model_len), max_num_seqs -> 256 (capped by the budget).
        Raises ValueError for invalid combinations and NotImplementedError naming
        each flag whose value jaxengine cannot run yet. ``platform="cpu"`` uses the
        smaller CPU defaults (`scheduler.CPU_DEFAULTS`): a 2-core host cannot use a
        budget of 8192 tokens per step, and every budget is a compiled bucket.
        ``pooling`` (a pooling model, `worker.pooling.is_pooling_model`; the one caller
        that resolves on a platform is `entrypoints.factory.engine_config`) raises the
        CPU's max_num_seqs to `scheduler.POOLING_CPU_MAX_NUM_SEQS` and may resolve
        ``--dtype auto`` (`model.auto_dtype`).
        """
        chunked = self.enable_chunked_prefill is not False
        budget = self.max_num_batched_tokens
        seqs = self.max_num_seqs
        default_seqs, default_budget = (
            sched_mod.DEFAULT_MAX_NUM_SEQS,
            sched_mod.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        )
        if platform == "cpu":
            default_seqs, default_budget = sched_mod.CPU_DEFAULTS
            if pooling:
                default_seqs = sched_mod.POOLING_CPU_MAX_NUM_SEQS
        if seqs is None:
            seqs = default_seqs
            seqs = seqs if budget is None else min(seqs, budget)
        if budget is None and chunked:
            budget = max(default_budget, seqs)
        elif budget is None and self.max_model_len is not None:
            budget = max(self.max_model_len, sched_mod.MIN_UNCHUNKED_BATCHED_TOKENS, seqs)
        config = self._build(
            dtype=self.dtype if self.dtype != "auto" else auto_dtype(platform, pooling),
            block_size=self.block_size or cache_mod.DEFAULT_BLOCK_SIZE,
            enable_prefix_caching=self.enable_prefix_caching is not False,
            enable_chunked_prefill=chunked,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            async_scheduling=self._async_scheduling(platform, pooling),
        )
        check_supported(config)
        return config

    def _async_scheduling(self, platform: str | None, pooling: bool) -> bool:
        """``--async-scheduling`` as given, else `sched_mod.async_by_default`."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return sched_mod.async_by_default(
            platform,
            pooling=pooling,
            pipeline=self.pipeline_parallel_size > 1,
            multi_host=self.nnodes > 1 or self.distributed_executor_backend == "ray",
            speculative=bool(self.speculative_config),
        )


def _group(parser: argparse.ArgumentParser, cls: type) -> Any:
    """The help group of ``cls``: the one the caller already made under its name
    (the server's ObservabilityConfig holds its tracing flags), else a new one."""
    for group in parser._action_groups:
        if group.title == cls.__name__:
            return group
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    return parser.add_argument_group(cls.__name__, doc)


def _flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _check_namespace(args: argparse.Namespace) -> None:
    """Post-parse check: cross-field errors, rewritten to name the flag."""
    try:
        EngineArgs.from_cli_args(args)
    except ValueError as e:
        message = str(e)
        for name in sorted(_field_owners(), key=len, reverse=True):
            if message.startswith(name):
                raise ValueError(f"argument {_flag_name(name)}: {message}") from None
        raise


def _checked(cls: type, name: str, convert: Any, item: bool) -> Any:
    """argparse `type`: convert the string, then validate it as field `name`."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except (ValueError, TypeError) as e:
            message = str(e)
            if convert in (int, float):
                message = f"invalid {convert.__name__} value: {text!r}"
            raise argparse.ArgumentTypeError(message) from None
        try:
            check_field(cls, name, [value] if item else value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse.__name__ = convert.__name__
    return parse


def _flag_kwargs(cls: type, name: str) -> dict[str, Any]:
    """argparse.add_argument keyword arguments for field `name` of `cls`."""
    tp = field_types(cls)[name]
    f = config_field(cls, name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    shown = "" if default is None else f" (default: {default})"
    help_text = (field_docs(cls).get(name, "") + shown).replace("%", "%%")
    kwargs: dict[str, Any] = {"default": default, "help": help_text}
    members = [a for a in union_args(tp) if a is not type(None)]
    choices = literal_choices(tp)
    if members == [bool]:
        return {**kwargs, "action": argparse.BooleanOptionalAction}
    if choices is not None:
        convert = type(choices[0])
        return {**kwargs, "type": _checked(cls, name, convert, False), "choices": choices}
    list_member = next((a for a in members if typing.get_origin(a) is list), None)
    if list_member is not None:
        (item_type,) = typing.get_args(list_member)
        item_type = union_args(item_type)[0]  # list[str | type]: the flag gives strings
        return {**kwargs, "nargs": "+", "type": _checked(cls, name, item_type, True)}
    if members == [dict] or typing.get_origin(members[0]) is dict:
        return {**kwargs, "type": parse_json_flag, "metavar": "JSON"}
    convert = members[0]
    if f.metadata.get("human_readable"):
        convert = parse_human_int
    return {**kwargs, "type": _checked(cls, name, convert, False)}
