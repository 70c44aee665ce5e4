"""Tests of the config dataclasses: defaults, docs, validation, unsupported features."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jaxengine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    check_supported,
)
from jaxengine.config.unsupported import unsupported_features
from jaxengine.config.utils import field_docs

ALL_CLASSES = [
    ModelConfig,
    LoadConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    CompilationConfig,
    EngineConfig,
]


def test_import_config_does_not_import_jax():
    code = "import sys, jaxengine.config; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_configs_are_frozen(cls):
    config = cls()
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, getattr(config, name))


def test_defaults_follow_vllm():
    m = ModelConfig()
    assert m.model == "SmolLM2-135M-Instruct"
    assert (m.tokenizer, m.tokenizer_mode, m.trust_remote_code) == (None, "auto", False)
    assert (m.dtype, m.max_model_len, m.seed, m.quantization) == ("auto", None, 0, None)
    assert (m.hf_overrides, m.override_generation_config) == ({}, {})
    assert (m.generation_config, m.max_logprobs, m.logprobs_mode) == ("auto", 20, "raw_logprobs")
    assert not (m.enforce_eager or m.skip_tokenizer_init or m.disable_sliding_window)
    c = CacheConfig()
    assert (c.block_size, c.gpu_memory_utilization, c.swap_space) == (None, 0.9, 4)
    assert (c.kv_cache_dtype, c.enable_prefix_caching, c.cpu_offload_gb) == ("auto", None, 0)
    assert c.prefix_caching_hash_algo == "sha256" and c.prefix_caching
    s = SchedulerConfig()
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill) == (None,) * 3
    assert (s.max_num_partial_prefills, s.max_long_partial_prefills) == (1, 1)
    assert (s.long_prefill_token_threshold, s.num_lookahead_slots) == (0, 0)
    assert s.scheduling_policy == "fcfs" and s.chunked_prefill
    p = ParallelConfig()
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (1, 1, 1)
    assert p.distributed_executor_backend is None and not p.enable_expert_parallel
    assert LoadConfig().load_format == "auto"
    x = CompilationConfig()
    assert x.compile_token_buckets == []
    assert x.enable_compilation_cache and x.compilation_cache_dir == "~/.cache/jaxengine/xla"


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (CacheConfig, {"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        (CacheConfig, {"gpu_memory_utilization": 1.01}, "gpu_memory_utilization"),
        (CacheConfig, {"block_size": 12}, "block_size"),
        (CacheConfig, {"swap_space": -1}, "swap_space"),
        (CacheConfig, {"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        (CacheConfig, {"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        (ModelConfig, {"dtype": "float64"}, "dtype"),
        (ModelConfig, {"max_model_len": 0}, "max_model_len"),
        (ModelConfig, {"max_model_len": "4k"}, "max_model_len"),
        (ModelConfig, {"seed": 1.5}, "seed"),
        (ModelConfig, {"max_logprobs": -2}, "max_logprobs"),
        (ModelConfig, {"quantization": "nonsense"}, "quantization"),
        (ModelConfig, {"served_model_name": []}, "served_model_name"),
        (ModelConfig, {"trust_remote_code": 1}, "trust_remote_code"),
        (ModelConfig, {"model": ""}, "model"),
        (LoadConfig, {"load_format": "zip"}, "load_format"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"scheduling_policy": "lifo"}, "scheduling_policy"),
        (SchedulerConfig, {"max_long_partial_prefills": 2}, "max_long_partial_prefills"),
        (SchedulerConfig, {"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batch"),
        (
            SchedulerConfig,
            {"max_num_partial_prefills": 2, "enable_chunked_prefill": False},
            "max_num_partial_prefills",
        ),
        (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size"),
        (ParallelConfig, {"data_parallel_rpc_port": 70000}, "data_parallel_rpc_port"),
        (ParallelConfig, {"data_parallel_size_local": 0}, "data_parallel_size_local"),
        (ParallelConfig, {"data_parallel_size_local": 2}, "data_parallel_size_local"),
        (
            ParallelConfig,
            {
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
                "data_parallel_start_rank": 3,
                "data_parallel_address": "h",
            },
            "data_parallel_start_rank",
        ),
        (
            ParallelConfig,
            {"data_parallel_size": 2, "data_parallel_start_rank": 1},
            "data_parallel_start_rank",
        ),
        (
            ParallelConfig,
            {"data_parallel_size": 2, "data_parallel_size_local": 1},
            "data_parallel_address",
        ),
        (CompilationConfig, {"compile_token_buckets": [16, 8]}, "compile_token_buckets"),
        (CompilationConfig, {"compile_token_buckets": [0, 8]}, "compile_token_buckets"),
        (EngineConfig, {"cache_config": LoadConfig()}, "cache_config"),
    ],
)
def test_invalid_values_raise_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_engine_config_cross_check_without_chunked_prefill():
    sched = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model_config=ModelConfig(max_model_len=4096), scheduler_config=sched)


def test_with_max_model_len_resolves_the_budget():
    sched = SchedulerConfig(enable_chunked_prefill=False)
    config = EngineConfig(scheduler_config=sched).with_max_model_len(4096)
    assert config.model_config.max_model_len == 4096
    assert config.scheduler_config.max_num_batched_tokens == 4096
    short = EngineConfig(scheduler_config=sched).with_max_model_len(512)
    assert short.scheduler_config.max_num_batched_tokens == 2048


def test_served_model_names():
    assert ModelConfig().served_model_names == ["SmolLM2-135M-Instruct"]
    assert ModelConfig(served_model_name="a").served_model_names == ["a"]
    assert ModelConfig(served_model_name=["a", "b"]).served_model_names == ["a", "b"]


def test_default_engine_config_is_supported():
    check_supported(EngineConfig())
    assert unsupported_features(EngineConfig()) == []


@pytest.mark.parametrize(
    "part, kwargs, message",
    [
        (
            "parallel_config",
            {"distributed_executor_backend": "external_launcher"},
            "backend external_launcher",
        ),
        ("cache_config", {"kv_cache_dtype": "fp8_inc"}, "--kv-cache-dtype fp8_inc"),
        ("cache_config", {"cpu_offload_gb": 2}, "--cpu-offload-gb 2"),
        ("model_config", {"quantization": "hqq"}, "--quantization hqq"),
        ("model_config", {"tokenizer_mode": "mistral"}, "--tokenizer-mode mistral"),
        ("load_config", {"load_format": "pt"}, "--load-format pt"),
    ],
)
def test_unsupported_features_raise_not_implemented(part, kwargs, message):
    cls = {f.name: f.default_factory for f in dataclasses.fields(EngineConfig)}[part]
    config = EngineConfig(**{part: cls(**kwargs)})
    with pytest.raises(NotImplementedError, match=f"{message}.* is not supported yet"):
        check_supported(config)


def test_supported_values_pass():
    config = EngineConfig(
        model_config=ModelConfig(quantization="gguf", tokenizer_mode="slow"),
        load_config=LoadConfig(load_format="dummy"),
        cache_config=CacheConfig(kv_cache_dtype="bfloat16"),
        parallel_config=ParallelConfig(distributed_executor_backend="uni"),
    )
    check_supported(config)
    for backend in ("mp", "ray"):
        check_supported(
            EngineConfig(parallel_config=ParallelConfig(distributed_executor_backend=backend))
        )


def test_data_parallel_over_nodes():
    single = ParallelConfig(data_parallel_size=2)
    assert (single.local_data_parallel_size, single.data_parallel_rank_start) == (2, 0)
    assert not single.has_remote_replicas
    head = ParallelConfig(
        data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="10.0.0.1"
    )
    assert head.has_remote_replicas and head.data_parallel_rank_start == 0
    assert head.data_parallel_rpc_address == ("10.0.0.1", 29550)  # vLLM's default port
    node = dataclasses.replace(head, data_parallel_start_rank=2, data_parallel_rpc_port=13345)
    assert (node.local_data_parallel_size, node.data_parallel_rank_start) == (2, 2)
    assert node.data_parallel_rpc_address == ("10.0.0.1", 13345)
    check_supported(EngineConfig(parallel_config=node))


def test_replace_revalidates():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        dataclasses.replace(CacheConfig(), gpu_memory_utilization=2.0)


@pytest.mark.parametrize(
    "kv_cache_dtype, model_dtype, expected",
    [
        ("auto", "bfloat16", "bfloat16"),
        ("auto", "float32", "float32"),
        ("float16", "bfloat16", "float16"),
        ("float32", "bfloat16", "float32"),
        ("bfloat16", "float32", "bfloat16"),
    ],
)
def test_cache_dtype_is_the_model_dtype_unless_set(kv_cache_dtype, model_dtype, expected):
    assert CacheConfig(kv_cache_dtype=kv_cache_dtype).cache_dtype(model_dtype) == expected
