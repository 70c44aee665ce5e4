"""The runner's shape parameters (`RunnerSettings`), fixed for its lifetime: what the
worker's build decides and every part of the runner reads. Numpy only."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxengine.runner.pooler import PoolerSettings


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """The runner's shape parameters, fixed for its lifetime."""

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    token_buckets: tuple[int, ...]
    vocab_size: int
    cache_page_shape: tuple[int, ...]  # one layer's page: (block_size, 2 * Hkv, D)
    cache_dtype: np.dtype
    num_layers: int
    num_host_blocks: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    seed: int = 0
    eos_token_id: int | None = None
    calculate_kv_scales: bool = False  # `runner.kv_scales`
    num_speculative_tokens: int = 0  # proposals verified per request and step
    pooler: PoolerSettings | None = None  # a pooling model's (no sampling at all)
    hidden_size: int = 0  # (a classification head's input width)
    state_shapes: tuple | None = None  # per layer: state pools' shapes or None (`runner.states`)

    @property
    def num_paged_layers(self) -> int:
        """Layers whose cache is pages (a hybrid model's attention layers only)."""
        if self.state_shapes is None:
            return self.num_layers
        return sum(shape is None for shape in self.state_shapes)

    @property
    def pages_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_sample_slots(self) -> int:
        """The sampled ids' padded length: the most logits rows of a step."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)
