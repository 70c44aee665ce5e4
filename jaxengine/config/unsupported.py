"""Features that parse but do not run yet: one table, one check.

Each row is (flag, predicate on the EngineConfig, how to show the value). When a
feature lands, delete its row. `check_supported` raises NotImplementedError naming
the flag and value, e.g. "--tensor-parallel-size 2 is not supported yet".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxengine.config.engine import EngineConfig

SUPPORTED_QUANTIZATION = (
    None, "gguf", "int8", "fp8", "gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors",
    "mxfp4",
)  # fmt: skip
SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SUPPORTED_TOKENIZER_MODES = ("auto", "slow")
SUPPORTED_KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)
SUPPORTED_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")
SUPPORTED_STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")
SUPPORTED_SPECULATIVE_METHODS = (None, "ngram", "draft_model", "eagle", "mtp")

# (flag, getter of the value, predicate: True when the value is NOT supported yet)
UNSUPPORTED: list[tuple[str, Callable[[EngineConfig], Any], Callable[[Any], bool]]] = [
    (
        "--distributed-executor-backend",
        lambda c: c.parallel_config.distributed_executor_backend,
        lambda v: v not in SUPPORTED_EXECUTOR_BACKENDS,
    ),
    (
        "--kv-cache-dtype",
        lambda c: c.cache_config.kv_cache_dtype,
        lambda v: v not in SUPPORTED_KV_CACHE_DTYPES,
    ),
    ("--cpu-offload-gb", lambda c: c.cache_config.cpu_offload_gb, lambda v: v != 0),
    (
        "--quantization",
        lambda c: c.model_config.quantization,
        lambda v: v not in SUPPORTED_QUANTIZATION,
    ),
    (
        "--tokenizer-mode",
        lambda c: c.model_config.tokenizer_mode,
        lambda v: v not in SUPPORTED_TOKENIZER_MODES,
    ),
    (
        "--structured-outputs-config.backend",
        lambda c: c.structured_outputs_config.option("backend"),
        lambda v: v not in SUPPORTED_STRUCTURED_OUTPUT_BACKENDS,
    ),
    (
        "--load-format",
        lambda c: c.load_config.load_format,
        lambda v: v not in SUPPORTED_LOAD_FORMATS,
    ),
    ("--runner", lambda c: c.model_config.runner, lambda v: v == "draft"),
    ("--task", lambda c: c.model_config.task, lambda v: v in ("draft", "transcription")),
    # No model code is run from the hub, so there is no code revision to pick.
    ("--code-revision", lambda c: c.model_config.code_revision, lambda v: v is not None),
    # Lookahead slots hold proposed tokens: they exist only with speculative decoding.
    (
        "--num-lookahead-slots",
        lambda c: 0 if c.speculative_config.enabled else c.scheduler_config.num_lookahead_slots,
        lambda v: v != 0,
    ),
    (
        "--speculative-config.method",
        lambda c: c.speculative_config.method,
        lambda v: v not in SUPPORTED_SPECULATIVE_METHODS,
    ),
    # the draft model runs on the target's tensor group, up to the target's length
    (
        "--speculative-config.draft_tensor_parallel_size",
        lambda c: _draft_tp(c),
        lambda v: v is not None,
    ),
    (
        "--speculative-config.max_model_len",
        lambda c: c.speculative_config.option("max_model_len"),
        lambda v: v is not None,
    ),
    (
        "--speculative-config.speculative_token_tree",
        lambda c: c.speculative_config.option("speculative_token_tree"),
        lambda v: v is not None,
    ),
]


def _draft_tp(config: EngineConfig) -> int | None:
    """The draft's tensor-parallel size when it differs from the target's."""
    tp = config.speculative_config.option("draft_tensor_parallel_size")
    return None if tp in (None, config.parallel_config.tensor_parallel_size) else tp


def unsupported_features(config: EngineConfig) -> list[str]:
    """Messages for every setting of `config` that jaxengine cannot run yet."""
    messages = []
    for flag, get, bad in UNSUPPORTED:
        value = get(config)
        if bad(value):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            shown = "" if isinstance(value, bool) else f" {value}"
            messages.append(f"{flag}{shown} is not supported yet")
    return messages


def check_supported(config: EngineConfig) -> None:
    """Raises NotImplementedError listing the settings that do not run yet."""
    messages = unsupported_features(config)
    if messages:
        raise NotImplementedError("; ".join(messages))
