"""CacheConfig: the paged KV cache (block size, memory share, dtype, prefix caching)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import spec, validate_config

BlockSize = Literal[1, 8, 16, 32, 64, 128, 256]
CacheDType = Literal[
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"
]
PrefixCachingHashAlgo = Literal["builtin", "sha256"]
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

DEFAULT_BLOCK_SIZE = 16
"""Block size that EngineArgs.create_engine_config picks when --block-size is unset."""


@dataclass(frozen=True)
class CacheConfig:
    """Configuration for the KV cache."""

    block_size: BlockSize | None = None
    """Size of a contiguous cache block in number of tokens. There is no static
    default: if unspecified, EngineArgs.create_engine_config sets it for the
    platform (16 today)."""
    gpu_memory_utilization: float = spec(0.9, gt=0, le=1)
    """The fraction of accelerator memory used by the model executor, in (0, 1].
    For example 0.5 means 50% memory use. It is a per-instance limit: two
    instances on the same device can use 0.5 each."""
    kv_cache_memory_bytes: int | None = spec(None, gt=0, human_readable=True)
    """Size of the KV cache per device in bytes. By default (None) it is derived
    from --gpu-memory-utilization; when set, --gpu-memory-utilization is ignored.
    The flag accepts human-readable k/m/g/K/M/G: 1k -> 1000, 1K -> 1024."""
    num_gpu_blocks_override: int | None = spec(None, gt=0)
    """Number of KV cache blocks to use. If set, overrides the number derived from
    the memory profile. Used to test preemption."""
    swap_space: float = spec(4, ge=0)
    """Size of the CPU swap space per device, in GiB."""
    kv_cache_dtype: CacheDType = "auto"
    """Data type for KV cache storage. If "auto", the model's data type (the dtype its
    weights are loaded in, see --dtype) is used; "bfloat16", "float16" and "float32"
    store the cache in that type whatever the model's. "fp8" (= "fp8_e4m3") and
    "fp8_e5m2" store one byte per value, so the cache holds twice the tokens of a
    16-bit one: each layer stores k / k_scale and v / v_scale (per-tensor scales from
    the checkpoint where it has them, or from --calculate-kv-scales, else 1.0; values
    saturate at the format's largest) and attention widens the pages after loading
    them. "fp8_inc" is not
    supported yet."""
    calculate_kv_scales: bool = False
    """Compute the fp8 KV cache's k_scale and v_scale from the first forward pass
    (the largest |k| over 200 and |v| over 100, as vLLM) instead of taking them from
    the checkpoint (or 1.0). Needs --kv-cache-dtype fp8 or fp8_e5m2."""
    enable_prefix_caching: bool | None = None
    """Whether to enable prefix caching. Unset (None) means enabled."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "sha256"
    """The hash algorithm for prefix caching. "sha256" hashes a pickled block key
    with SHA-256 (collision resistant); "builtin" uses Python's built-in hash
    (faster, with a tiny risk of collisions)."""
    cpu_offload_gb: float = spec(0, ge=0)
    """The space in GiB to offload weights to CPU memory, per device. The default 0
    means no offloading; any other value is not supported yet."""

    def __post_init__(self) -> None:
        validate_config(self)

    def cache_dtype(self, model_dtype: str) -> str:
        """The concrete dtype name the KV cache is stored in.

        "auto" -> `model_dtype` (e.g. "bfloat16"); "fp8" and "fp8_e4m3" ->
        "float8_e4m3fn", "fp8_e5m2" -> "float8_e5m2" (scale 1.0: values are stored as
        they are, saturating at the format's largest); others as given.
        """
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return FP8_CACHE_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (None counts as on)."""
        return self.enable_prefix_caching is not False
