"""Tests of EngineArgs and its generated flags, --config files, JSON flags and the CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from jaxengine.config.arg_utils import FlexibleArgumentParser, parse_human_int
from jaxengine.config.utils import field_default, field_types
from jaxengine.engine_args import CONFIG_CLASSES, EngineArgs


def _parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="jaxengine test")
    EngineArgs.add_cli_args(parser)
    return parser


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(_parser().parse_args(argv))


# (argv, field, expected value); covers every flag of the config classes.
VALID_FLAGS = [
    (["--model", "/m/model.gguf"], "model", "/m/model.gguf"),
    (["--tokenizer", "tok"], "tokenizer", "tok"),
    (["--tokenizer-mode", "slow"], "tokenizer_mode", "slow"),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--revision", "main"], "revision", "main"),
    (["--tokenizer-revision", "v2"], "tokenizer_revision", "v2"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--max-model-len", "2K"], "max_model_len", 2048),
    (["--seed", "7"], "seed", 7),
    (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
    (["--hf-overrides", '{"a": 1}'], "hf_overrides", {"a": 1}),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--override-generation-config.temperature", "0.5"], "override_generation_config",
     {"temperature": 0.5}),
    (["--quantization", "gguf"], "quantization", "gguf"),
    (["-q", "gguf"], "quantization", "gguf"),
    (["--quantization", "int8"], "quantization", "int8"),
    (["-q", "fp8"], "quantization", "fp8"),
    (["--skip-tokenizer-init"], "skip_tokenizer_init", True),
    (["--max-logprobs", "-1"], "max_logprobs", -1),
    (["--enforce-eager"], "enforce_eager", True),
    (["--enable-sleep-mode"], "enable_sleep_mode", True),
    (["--chat-template", "{{ messages }}"], "chat_template", "{{ messages }}"),
    (["--disable-sliding-window"], "disable_sliding_window", True),
    (["--logprobs-mode", "processed_logits"], "logprobs_mode", "processed_logits"),
    (["--logits-processors", "pkg.mod:Cls", "pkg.mod.Other"], "logits_processors",
     ["pkg.mod:Cls", "pkg.mod.Other"]),
    (["--runner", "pooling"], "runner", "pooling"),
    (["--convert", "embed"], "convert", "embed"),
    (["--task", "score"], "task", "score"),
    (["--override-pooler-config", '{"pooling_type": "MEAN"}'], "pooler_config",
     {"pooling_type": "MEAN"}),
    (["--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'], "pooler_config",
     {"pooling_type": "MEAN", "normalize": False}),
    (["--pooler-config.pooling_type", "CLS"], "pooler_config", {"pooling_type": "CLS"}),
    (["--load-format", "dummy"], "load_format", "dummy"),
    (["--download-dir", "/tmp/w"], "download_dir", "/tmp/w"),
    (["--ignore-patterns", "*.bin", "*.pt"], "ignore_patterns", ["*.bin", "*.pt"]),
    (["--tensor-parallel-size", "4"], "tensor_parallel_size", 4),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size", 2),
    (["-pp", "4"], "pipeline_parallel_size", 4),
    (["--data-parallel-size", "2"], "data_parallel_size", 2),
    (["-dp", "2"], "data_parallel_size", 2),
    (["-dp", "4", "--data-parallel-size-local", "2", "-dpa", "10.0.0.1"],
     "data_parallel_size_local", 2),
    (["-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1"], "data_parallel_start_rank", 2),
    (["-dp", "2", "--data-parallel-start-rank", "1", "--data-parallel-size-local", "1",
      "--data-parallel-address", "10.0.0.1"], "data_parallel_start_rank", 1),
    (["--data-parallel-address", "10.0.0.1"], "data_parallel_address", "10.0.0.1"),
    (["-dpa", "head"], "data_parallel_address", "head"),
    (["--data-parallel-rpc-port", "13345"], "data_parallel_rpc_port", 13345),
    (["-dpp", "5555"], "data_parallel_rpc_port", 5555),
    (["--enable-expert-parallel"], "enable_expert_parallel", True),
    (["--no-enable-expert-parallel"], "enable_expert_parallel", False),
    (["--distributed-executor-backend", "uni"], "distributed_executor_backend", "uni"),
    (["--distributed-executor-backend", "mp"], "distributed_executor_backend", "mp"),
    (["--distributed-executor-backend", "ray"], "distributed_executor_backend", "ray"),
    (["--nnodes", "2"], "nnodes", 2),
    (["-n", "4", "-r", "3"], "node_rank", 3),
    (["--nnodes", "2", "--node-rank", "1"], "node_rank", 1),
    (["--master-addr", "10.0.0.1"], "master_addr", "10.0.0.1"),
    (["--master-port", "12345"], "master_port", 12345),
    (["--max-parallel-loading-workers", "2"], "max_parallel_loading_workers", 2),
    (["--block-size", "32"], "block_size", 32),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--kv-cache-memory-bytes", "1G"], "kv_cache_memory_bytes", 1024**3),
    (["--num-gpu-blocks-override", "64"], "num_gpu_blocks_override", 64),
    (["--swap-space", "0"], "swap_space", 0.0),
    (["--kv-cache-dtype", "float32"], "kv_cache_dtype", "float32"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--prefix-caching-hash-algo", "builtin"], "prefix_caching_hash_algo", "builtin"),
    (["--cpu-offload-gb", "0"], "cpu_offload_gb", 0.0),
    (["--calculate-kv-scales", "--kv-cache-dtype", "fp8"], "calculate_kv_scales", True),
    (["--model-impl", "transformers"], "model_impl", "transformers"),
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--max-num-batched-tokens", "1k"], "max_num_batched_tokens", 1000),
    (["--max-num-queued-reqs", "64"], "max_num_queued_reqs", 64),
    (["--max-num-queued-tokens", "32K"], "max_num_queued_tokens", 32768),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--max-num-partial-prefills", "2"], "max_num_partial_prefills", 2),
    (["--max-long-partial-prefills", "1"], "max_long_partial_prefills", 1),
    (["--long-prefill-token-threshold", "128"], "long_prefill_token_threshold", 128),
    (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
    (["--compile-token-buckets", "16", "64"], "compile_token_buckets", [16, 64]),
    (["--compilation-cache-dir", "/tmp/xla"], "compilation_cache_dir", "/tmp/xla"),
    (["--no-enable-compilation-cache"], "enable_compilation_cache", False),
    (["--background-compile"], "background_compile", True),
    (["--cudagraph-mode", "FULL"], "cudagraph_mode", "FULL"),
    (["--async-scheduling"], "async_scheduling", True),
    (["--attention-backend", "reference"], "attention_backend", "reference"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "structured_outputs_config",
     {"backend": "guidance"}),
    (["--structured-outputs-config.disable_any_whitespace", "true"], "structured_outputs_config",
     {"disable_any_whitespace": True}),
    (["--reasoning-parser", "qwen3"], "reasoning_parser", "qwen3"),
    (["--reasoning-parser-plugin", "my_parsers.py"], "reasoning_parser_plugin", "my_parsers.py"),
    (["--enable-lora"], "enable_lora", True),
    (["--enable-lora", "--max-loras", "4"], "max_loras", 4),
    (["--enable-lora", "--max-lora-rank", "64"], "max_lora_rank", 64),
    (["--enable-lora", "--max-cpu-loras", "8"], "max_cpu_loras", 8),
    (["--enable-lora", "--lora-dtype", "bfloat16"], "lora_dtype", "bfloat16"),
    (["--enable-lora", "--fully-sharded-loras"], "fully_sharded_loras", True),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     "speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),
    (["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens",
      "2"], "speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    (["--limit-mm-per-prompt", '{"image": 4}'], "limit_mm_per_prompt", {"image": 4}),
    (["--limit-mm-per-prompt.image", "0"], "limit_mm_per_prompt", {"image": 0}),
    (["--mm-processor-kwargs", '{"do_image_splitting": false}'], "mm_processor_kwargs",
     {"do_image_splitting": False}),
    (["--allowed-local-media-path", "/data/images"], "allowed_local_media_path", "/data/images"),
    (["--allowed-media-domains", "example.com", "cdn.example.com"], "allowed_media_domains",
     ["example.com", "cdn.example.com"]),
    (["--show-hidden-metrics-for-version", "0.11"], "show_hidden_metrics_for_version", "0.11"),
]  # fmt: skip


@pytest.mark.parametrize("argv, field, expected", VALID_FLAGS, ids=lambda v: str(v))
def test_every_flag_parses(argv, field, expected):
    args = _parse(argv)
    assert getattr(args, field) == expected
    config = args.create_engine_config()
    part = next(p for p, cls in CONFIG_CLASSES.items() if field in field_types(cls))
    assert getattr(getattr(config, part), field) == expected


def test_every_config_field_is_covered_by_a_flag_test():
    covered = {field for _, field, _ in VALID_FLAGS}
    covered |= {name for kwargs, _ in NOT_SUPPORTED_YET for name in kwargs}
    assert covered == {f.name for f in dataclasses.fields(EngineArgs)}


def test_engine_args_mirror_the_config_fields():
    hints = typing.get_type_hints(EngineArgs)
    for cls in CONFIG_CLASSES.values():
        for name, tp in field_types(cls).items():
            assert hints[name] == tp, name
            assert field_default(EngineArgs, name) == field_default(cls, name), name


def test_cli_defaults_equal_python_defaults():
    assert _parse([]) == EngineArgs()


def test_create_engine_config_resolves_defaults():
    config = EngineArgs().create_engine_config()
    assert config.cache_config.block_size == 16
    assert type(EngineArgs(block_size=32).create_engine_config().cache_config.block_size) is int
    assert config.cache_config.enable_prefix_caching is True
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.scheduler_config.max_num_seqs == 256
    assert config.scheduler_config.max_num_batched_tokens == 8192
    small = EngineArgs(max_num_batched_tokens=64).create_engine_config()
    assert small.scheduler_config.max_num_seqs == 64
    unchunked = EngineArgs(enable_chunked_prefill=False, max_model_len=4096)
    assert unchunked.create_engine_config().scheduler_config.max_num_batched_tokens == 4096
    cpu = EngineArgs().create_engine_config("cpu").scheduler_config
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 2048)
    pooling = EngineArgs().create_engine_config("cpu", pooling=True).scheduler_config
    assert (pooling.max_num_seqs, pooling.max_num_batched_tokens) == (128, 2048)
    given = EngineArgs(max_num_seqs=8).create_engine_config("cpu", pooling=True)
    assert given.scheduler_config.max_num_seqs == 8


def test_a_pooling_models_auto_dtype_on_cpu(monkeypatch, tmp_path):
    """--dtype auto is bfloat16 for a pooling model on a CPU whose /proc/cpuinfo flags
    name AMX-BF16, and stays auto (float32 on CPU) otherwise; --dtype wins."""
    from jaxengine.config import model as model_mod

    has_amx = model_mod.cpu_has_amx_bf16.__wrapped__
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile\n")
    assert has_amx(flags)
    flags.write_text("processor : 0\nflags : fpu avx512f avx512_bf16\n")
    assert not has_amx(flags) and not has_amx(tmp_path / "missing")

    def dtype(args: EngineArgs, platform: str, pooling: bool = False) -> str:
        return args.create_engine_config(platform, pooling=pooling).model_config.dtype

    monkeypatch.setattr(model_mod, "cpu_has_amx_bf16", lambda: True)
    assert dtype(EngineArgs(), "cpu", pooling=True) == "bfloat16"
    assert dtype(EngineArgs(), "cpu") == dtype(EngineArgs(), "gpu", pooling=True) == "auto"
    assert dtype(EngineArgs(dtype="float32"), "cpu", pooling=True) == "float32"
    monkeypatch.setattr(model_mod, "cpu_has_amx_bf16", lambda: False)
    assert dtype(EngineArgs(), "cpu", pooling=True) == "auto"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "abc"], "--gpu-memory-utilization"),
        (["--max-model-len", "12q"], "--max-model-len"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--block-size", "12"], "--block-size"),
        (["--dtype", "float64"], "--dtype"),
        (["--seed", "x"], "--seed"),
        (["--swap-space", "-1"], "--swap-space"),
        (["--hf-overrides", "{bad json"], "--hf-overrides"),
        (["--hf-overrides", "[1, 2]"], "--hf-overrides"),
        (["--max-long-partial-prefills", "2"], "--max-long-partial-prefills"),
        (["--compile-token-buckets", "64", "16"], "--compile-token-buckets"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens"),
        (["--served-model-name", ""], "--served-model-name"),
        (["--quantization", "nonsense"], "--quantization"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--attention-backend", "flash"], "--attention-backend"),
        (["--show-hidden-metrics-for-version", "latest"], "--show-hidden-metrics-for-version"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["--master-port", "70000"], "--master-port"),
        (["-dp", "2", "-dpl", "3"], "--data-parallel-size-local"),
        (["-dp", "2", "-dpl", "0"], "--data-parallel-size-local"),
        (["-dp", "2", "-dpl", "1", "-dpr", "2", "-dpa", "h"], "--data-parallel-start-rank"),
        (["-dp", "2", "-dpr", "1"], "--data-parallel-start-rank"),
        (["-dp", "2", "-dpl", "1"], "--data-parallel-address"),
        (["-dp", "2", "-dpl", "1", "-dpa", "h", "--nnodes", "2"], "--nnodes"),
    ],
)
def test_bad_values_fail_at_parse_time_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


NOT_SUPPORTED_YET = [
    (
        {"distributed_executor_backend": "external_launcher"},
        "--distributed-executor-backend external_launcher",
    ),
    ({"kv_cache_dtype": "fp8_inc"}, "--kv-cache-dtype fp8_inc is not supported yet"),
    ({"quantization": "bitsandbytes"}, "--quantization bitsandbytes is not supported yet"),
    ({"load_format": "bitsandbytes"}, "--load-format bitsandbytes is not supported yet"),
    ({"tokenizer_mode": "custom"}, "--tokenizer-mode custom is not supported yet"),
    ({"cpu_offload_gb": 4}, "--cpu-offload-gb 4 is not supported yet"),
    ({"code_revision": "v1"}, "--code-revision v1 is not supported yet"),
    ({"num_lookahead_slots": 4}, "--num-lookahead-slots 4 is not supported yet"),
]


@pytest.mark.parametrize("kwargs, message", NOT_SUPPORTED_YET)
def test_not_supported_yet_parses_but_fails_at_create_engine_config(kwargs, message):
    ((name, value),) = kwargs.items()
    flag = "--" + name.replace("_", "-")
    argv = [flag] if value is True else [flag, str(value)]
    args = _parse(argv)
    with pytest.raises(NotImplementedError, match=message):
        args.create_engine_config()
    with pytest.raises(NotImplementedError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_python_kwargs_are_validated():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(max_num_seqs="8")
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineArgs(max_long_partial_prefills=3)
    with pytest.raises(TypeError):
        EngineArgs(no_such_flag=1)
    with pytest.raises(ValueError, match="async_scheduling: is not supported with pipeline"):
        EngineArgs(async_scheduling=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling: is not supported across hosts"):
        EngineArgs(async_scheduling=True, nnodes=2)
    with pytest.raises(ValueError, match="modality 'video' is not supported"):
        EngineArgs(limit_mm_per_prompt={"video": 1}).create_engine_config()
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        EngineArgs(limit_mm_per_prompt={"image": -1}).create_engine_config()
    assert EngineArgs(model="m", max_model_len=128).create_engine_config().model_config.model == "m"


def test_config_file_and_explicit_override(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "max-num-seqs: 8\nmax_model_len: 2K\nenable_prefix_caching: false\n"
        "served_model_name: [a, b]\nhf_overrides: {x: 1}\ngpu-memory-utilization: 0.5\n"
        "enforce_eager: true\ncompile_token_buckets: [16, 32]\n"
    )
    args = _parse(["--config", str(path), "--max-num-seqs", "16", "--hf-overrides.y", "2"])
    assert args.max_num_seqs == 16  # explicit flag wins over the file
    assert args.max_model_len == 2048
    assert args.enable_prefix_caching is False
    assert args.served_model_name == ["a", "b"]
    assert args.hf_overrides == {"x": 1, "y": 2}
    assert args.gpu_memory_utilization == 0.5
    assert args.enforce_eager is True
    assert args.compile_token_buckets == [16, 32]
    assert _parse(["--enable-prefix-caching", f"--config={path}"]).enable_prefix_caching


def test_config_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_flag: 1\n")
    for argv in (["--config", str(bad)], ["--config", str(tmp_path / "missing.yaml")]):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
        assert "--config" in capsys.readouterr().err


def test_dotted_json_flags():
    args = _parse(
        [
            "--hf-overrides",
            '{"a": 1, "n": {"k": 0}}',
            "--hf-overrides.n.j",
            "true",
            "--hf-overrides.name=text",
            "--hf-overrides.archs+",
            "A",
            "--hf-overrides.archs+=B,C",
            "--hf_overrides.rope_scaling.factor",
            "2.0",
        ]
    )
    assert args.hf_overrides == {
        "a": 1,
        "n": {"k": 0, "j": True},
        "name": "text",
        "archs": ["A", "B", "C"],
        "rope_scaling": {"factor": 2.0},
    }


def test_underscore_flag_names():
    assert _parse(["--max_num_seqs", "4", "--enable_chunked_prefill"]).max_num_seqs == 4


@pytest.mark.parametrize(
    "text, value",
    [("512", 512), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 * 1024**2),
     ("1g", 10**9), ("1.5K", 1536)],
)  # fmt: skip
def test_human_readable_ints(text, value):
    assert parse_human_int(text) == value


def test_help_is_grouped_by_config_class(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n{cls.__name__}:") for cls in CONFIG_CLASSES.values()]
    assert positions == sorted(positions)
    assert "--gpu-memory-utilization" in out and "(default: 0.9)" in out
    assert "--no-enable-prefix-caching" in out


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    code = (
        "import sys\nfrom jaxengine.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )


def test_cli_help_and_version_do_not_import_jax():
    assert "jaxengine" in _run_cli("--help").stdout
    from jaxengine.version import __version__

    assert __version__ in _run_cli("--version").stdout


def test_cli_subcommand_registry(monkeypatch, tmp_path, capsys):
    module = tmp_path / "fake_subcommand.py"
    module.write_text(
        "from jaxengine.engine_args import EngineArgs\n"
        "def register(subparsers):\n"
        "    p = subparsers.add_parser('fake', help='a fake subcommand')\n"
        "    EngineArgs.add_cli_args(p)\n"
        "    p.set_defaults(func=lambda args: print('seqs', args.max_num_seqs) or 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from jaxengine.cli import main as cli_main

    monkeypatch.setattr(cli_main, "SUBCOMMANDS", ["fake_subcommand"])
    assert cli_main.main(["fake", "--max_num_seqs", "5"]) == 3
    assert "seqs 5" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main.main(["fake", "--gpu-memory-utilization", "2"])
    assert "--gpu-memory-utilization" in capsys.readouterr().err


def test_serve_compiles_in_the_background_unless_told_not_to():
    from server.api_server.args import add_server_args

    parser = add_server_args(FlexibleArgumentParser())
    assert parser.parse_args([]).background_compile is True
    assert parser.parse_args(["--no-background-compile"]).background_compile is False
    assert EngineArgs().background_compile is False  # the offline LLM compiles first


@pytest.mark.parametrize(
    "platform, kwargs, pooling, expected",
    [
        ("gpu", {}, False, True),
        ("tpu", {}, False, True),
        ("cpu", {}, False, False),
        (None, {}, False, False),
        ("gpu", {}, True, False),
        ("gpu", {"pipeline_parallel_size": 2}, False, False),
        ("tpu", {"nnodes": 2}, False, False),
        (
            "gpu",
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            False,
            False,
        ),
        ("gpu", {"async_scheduling": False}, False, False),
        ("cpu", {"async_scheduling": True}, False, True),
    ],
)
def test_async_scheduling_default(platform, kwargs, pooling, expected):
    """Unset, ``--async-scheduling`` is on for an accelerator unless the engine runs
    what it does not support (then off, not refused); off on a CPU; as given when set."""
    config = EngineArgs(model="m", **kwargs).create_engine_config(platform, pooling=pooling)
    assert config.scheduler_config.async_scheduling is expected
    flags = EngineArgs.from_cli_args(_parser().parse_args(["--no-async-scheduling"]))
    assert flags.async_scheduling is False
