"""CompilationConfig: the shape buckets compiled ahead of time and the XLA cache.

jaxengine compiles one step function per (token-count bucket, request-count bucket)
pair at start-up; these buckets are its counterpart of vLLM's CUDA graph capture
sizes (--cuda-graph-sizes). A batch is padded up to the nearest bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxengine.config.utils import require, spec, validate_config

DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/jaxengine/xla"


def _increasing(values: list[int]) -> bool:
    return all(a < b for a, b in zip(values, values[1:], strict=False))


@dataclass(frozen=True)
class CompilationConfig:
    """Configuration for ahead-of-time compilation of the jitted step."""

    compile_token_buckets: list[int] = spec(default_factory=list, gt=0)
    """Token-count buckets the step is compiled for (jaxengine's counterpart of CUDA
    graph capture sizes): each step's flat batch of scheduled tokens is padded up
    to the smallest bucket that holds it. Strictly increasing. Empty (the default)
    derives them from the scheduler config, up to max_num_batched_tokens."""
    compile_request_buckets: list[int] = spec(default_factory=list, gt=0)
    """Request-count buckets the step is compiled for: the number of requests in a
    step is padded up to the smallest bucket that holds it. Strictly increasing.
    Empty (the default) derives them from the scheduler config, up to
    max_num_seqs."""
    compilation_cache_dir: str = DEFAULT_COMPILATION_CACHE_DIR
    """Directory of the persistent XLA compilation cache ("~" is expanded), so a
    restart does not compile the buckets again."""
    enable_compilation_cache: bool = True
    """Whether to use the persistent XLA compilation cache."""

    def __post_init__(self) -> None:
        validate_config(self)
        for name in ("compile_token_buckets", "compile_request_buckets"):
            require(_increasing(list(getattr(self, name))), name, "must be strictly increasing")
        require(bool(self.compilation_cache_dir), "compilation_cache_dir", "must not be empty")
