"""How many KV-cache pages an engine gets, and the start-up line that says so.

Order of precedence: ``--num-gpu-blocks-override``, then ``--kv-cache-memory-bytes``,
then on GPU/TPU the device's free memory times ``--gpu-memory-utilization`` (minus
what is already in use: weights and a reserve for activations). On CPU there is no
device memory to measure, and all of host RAM would be wrong, so the default is
enough pages for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
``CPU_DEFAULT_BYTES``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax.numpy as jnp

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_DEFAULT_BYTES = 2 << 30
ACTIVATION_RESERVE = 0.05  # fraction of device memory left for activations and XLA


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    """The cache an engine allocates: ``num_blocks`` pages including the null page."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    def describe(self, max_model_len: int) -> str:
        tokens = (self.num_blocks - 1) * self.block_size
        gib = self.num_blocks * self.bytes_per_block / (1 << 30)
        return (
            f"KV cache: {self.num_blocks - 1} pages of {self.block_size} tokens "
            f"({tokens} tokens, {gib:.2f} GiB); maximum concurrency at max_model_len "
            f"{max_model_len}: {tokens / max_model_len:.2f}x"
        )


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    *,
    kv_parts: int = 2,
) -> int:
    """Bytes of one page across all layers: ``kv_parts`` rows of ``head_dim`` per KV
    head and token (2: K and V; 1: a multi-head latent attention cache's one latent
    row, `layers.attention.kv_cache_shape`)."""
    return num_layers * block_size * kv_parts * num_kv_heads * head_dim * itemsize


def device_memory(device) -> tuple[int, int] | None:
    """(limit, in use) bytes of an accelerator, or None where unknown (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats raise various errors
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def plan_kv_cache(
    *,
    per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_gpu_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    memory: tuple[int, int] | None = None,
) -> KVCacheSize:
    """Decides the page count; raises ValueError when one sequence cannot fit.
    ``memory``: (limit, in use) bytes of the device (`device_memory`), None on CPU."""
    pages_per_seq = -(-max_model_len // block_size)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    elif kv_cache_memory_bytes is not None:
        num_blocks = kv_cache_memory_bytes // per_block
    else:
        if memory is None:
            want = max_num_seqs * pages_per_seq + 1
            num_blocks = min(want, max(CPU_DEFAULT_BYTES // per_block, pages_per_seq + 1))
        else:
            limit, in_use = memory
            usable = limit * (gpu_memory_utilization - ACTIVATION_RESERVE)
            if in_use >= usable:
                raise ValueError(
                    f"the model's weights take {in_use / GiB:.2f} GiB of a device, more "
                    f"than the {usable / GiB:.2f} GiB it may use (--gpu-memory-utilization "
                    f"{gpu_memory_utilization} of {limit / GiB:.2f} GiB, less "
                    f"{ACTIVATION_RESERVE:.0%} for activations): nothing is left for the KV "
                    "cache; use more devices (--tensor-parallel-size) or a quantized model"
                )
            num_blocks = int((usable - in_use) // per_block)
    if num_blocks < pages_per_seq + 1:
        raise ValueError(
            f"the KV cache holds {max(num_blocks - 1, 0)} pages of {block_size} tokens, fewer "
            f"than one sequence of max_model_len {max_model_len} needs ({pages_per_seq}); "
            "raise --gpu-memory-utilization / --kv-cache-memory-bytes or lower --max-model-len"
        )
    return KVCacheSize(num_blocks, block_size, per_block)


def cache_dtype(config: Any, model: Any) -> Any:
    """The KV cache's dtype for ``model`` (a `TransformerConfig`) under ``config`` (an
    `EngineConfig`): ``--kv-cache-dtype``, ``auto`` being the model's dtype."""
    return jnp.dtype(config.cache_config.cache_dtype(jnp.dtype(model.dtype).name))
