"""CompilationConfig: the shape buckets compiled ahead of time and the XLA cache.

jaxengine compiles one step function per (token-count bucket, request-count bucket)
pair at start-up; these buckets are its counterpart of vLLM's CUDA graph capture
sizes (--cuda-graph-sizes). A batch is padded up to the nearest bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/jaxengine/xla"
CudagraphMode = Literal["FULL", "PIECEWISE"]


def _increasing(values: list[int]) -> bool:
    return all(a < b for a, b in zip(values, values[1:], strict=False))


@dataclass(frozen=True)
class CompilationConfig:
    """Configuration for ahead-of-time compilation of the jitted step."""

    compile_token_buckets: list[int] = spec(default_factory=list, gt=0)
    """Token-count buckets the step is compiled for (jaxengine's counterpart of CUDA
    graph capture sizes): each step's flat batch of scheduled tokens is padded up
    to the smallest bucket that holds it, and the bucket of T tokens holds
    min(T, max_num_seqs) requests. Strictly increasing; the last must be at least
    max_num_batched_tokens. Empty (the default): powers of two up to
    max_num_batched_tokens."""
    compilation_cache_dir: str = DEFAULT_COMPILATION_CACHE_DIR
    """Directory of the persistent XLA compilation cache ("~" is expanded), so a
    restart does not compile the buckets again."""
    enable_compilation_cache: bool = True
    """Whether to use the persistent XLA compilation cache."""
    background_compile: bool = False
    """Compile the buckets in a background thread while the engine already serves:
    start-up waits for the model to load, not for every bucket, and a step that
    needs a bucket not compiled yet compiles it first. `jaxengine serve` turns it on;
    the offline `LLM` compiles every bucket before it returns (as vLLM captures its
    CUDA graphs at start-up). Multi-host and Ray engines always compile first."""
    cudagraph_mode: CudagraphMode | None = None
    """How a step is compiled (vLLM's name: the step is jaxengine's CUDA graph).
    "FULL": one program per bucket, every layer inlined. "PIECEWISE": per bucket, the
    embedding, one program per kind of decoder layer and the head, the layers called
    one after another from the host (`runner.piecewise`): the same arithmetic, a
    fraction of the compile time, a few host calls more per step. None (the default):
    PIECEWISE on CPU (a SmolLM2 step compiles about 4x faster and decodes no slower),
    FULL on accelerators (one launch per step). Models whose layers are not a decoder
    stack (BERT) and pipeline stages always run FULL."""

    def __post_init__(self) -> None:
        validate_config(self)
        name = "compile_token_buckets"
        require(_increasing(list(self.compile_token_buckets)), name, "must be strictly increasing")
        require(bool(self.compilation_cache_dir), "compilation_cache_dir", "must not be empty")
