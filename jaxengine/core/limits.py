"""SchedulerLimits: the resolved numbers the scheduler and KV manager run under.

A small frozen dataclass, so the core does not depend on the config tree's shape; build
it with `SchedulerLimits.from_configs(scheduler_config, cache_config, ...)` once the
number of KV blocks is known (after the runner profiled memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxengine.core.kv_cache.hashing import get_hash_fn
from jaxengine.core.policy import get_policy


def num_host_blocks_for(swap_space_gib: float, bytes_per_block: int) -> int:
    """Host (swap) blocks that fit in `swap_space_gib` GiB, each `bytes_per_block` bytes
    (a block's KV across all layers)."""
    if swap_space_gib <= 0 or bytes_per_block <= 0:
        return 0
    return int(swap_space_gib * (1 << 30)) // bytes_per_block


@dataclass(frozen=True)
class SchedulerLimits:
    """Resolved scheduler and KV-cache limits. Validated on construction."""

    max_num_seqs: int
    """Most requests in the running set (and so in one step)."""
    max_num_batched_tokens: int
    """The per-step token budget."""
    max_model_len: int
    """Prompt + output tokens per request; a request reaching it finishes ("length")."""
    num_blocks: int
    """Device KV blocks, block 0 (the null page) included."""
    block_size: int = 16
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    """With chunked prefill: per-step chunk cap per request, and the size above which a
    prefill counts as long (0 = off)."""
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    num_host_blocks: int = 0
    """Host blocks for swap preemption; 0 means recompute preemption only."""
    max_loras: int = 0
    """Distinct LoRA adapters among running requests (``--max-loras``; 0: LoRA off).
    A waiting request whose adapter would be one more stays waiting."""
    num_speculative_tokens: int = 0
    """Speculative decoding: at most this many proposals verified per request and
    step (0: off)."""
    num_lookahead_tokens: int = 0
    """KV slots allocated beyond each request's scheduled tokens (a draft model writes
    its proposals' KV there before the next step verifies them)."""
    encoder_cache_rows: int = 0
    """Images: image embeddings the device keeps (``encoder_cache_size``); also the
    embeddings encoded per step (``max_num_encoder_input_tokens``). 0: text only."""
    whole_images: bool = False
    """An image's tokens attend to each other both ways (Gemma 3): no prefill chunk
    ends inside an image."""
    state_cache_rows: tuple[int, int] = (0, 0)
    """A hybrid model with prefix caching: (first row, count) of its state pools
    kept for states saved at block ends (`core.kv_cache.state_cache`); count 0: none.
    A prefix hit then stops at a saved state, and a partial prefill chunk ends at a
    block's end where it can."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError("need 1 <= max_long_partial_prefills <= max_num_partial_prefills")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len})"
            )
        needed = -(-self.max_model_len // self.block_size)
        if needed > self.num_blocks - 1:
            raise ValueError(
                f"the KV cache ({self.num_blocks - 1} usable blocks of {self.block_size} "
                f"tokens) cannot hold one sequence of max_model_len={self.max_model_len}"
            )
        get_policy(self.scheduling_policy)
        get_hash_fn(self.prefix_caching_hash_algo)

    @classmethod
    def from_configs(
        cls,
        scheduler_config: Any,
        cache_config: Any,
        num_blocks: int,
        max_model_len: int,
        *,
        bytes_per_block: int = 0,
        num_host_blocks: int | None = None,
    ) -> SchedulerLimits:
        """Limits from resolved configs (`EngineArgs.create_engine_config`, then
        `EngineConfig.with_max_model_len`): defaults are decided there, not here.

        Host blocks: `num_host_blocks` if given, else swap_space GiB / `bytes_per_block`
        (0 when `bytes_per_block` is 0). As vLLM, a zero long_prefill_token_threshold
        becomes 4% of max_model_len when max_num_partial_prefills > 1.
        """
        sc, cc = scheduler_config, cache_config
        unresolved = [
            name
            for name, value in (
                ("block_size", cc.block_size),
                ("max_num_seqs", sc.max_num_seqs),
                ("max_num_batched_tokens", sc.max_num_batched_tokens),
                ("enable_chunked_prefill", sc.enable_chunked_prefill),
            )
            if value is None
        ]
        if unresolved:
            raise ValueError(f"unresolved config fields: {', '.join(unresolved)}")
        threshold = sc.long_prefill_token_threshold
        if sc.max_num_partial_prefills > 1 and threshold == 0:
            threshold = int(max_model_len * 0.04)
        if num_host_blocks is None:
            num_host_blocks = num_host_blocks_for(cc.swap_space, bytes_per_block)
        return cls(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=cc.block_size,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            max_num_partial_prefills=sc.max_num_partial_prefills,
            max_long_partial_prefills=sc.max_long_partial_prefills,
            long_prefill_token_threshold=threshold,
            scheduling_policy=sc.scheduling_policy,
            enable_prefix_caching=cc.prefix_caching,
            prefix_caching_hash_algo=cc.prefix_caching_hash_algo,
            num_host_blocks=num_host_blocks,
        )
