"""SchedulerConfig: the per-step token budget, request caps and scheduling policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

SchedulingPolicy = Literal["fcfs", "priority"]

DEFAULT_MAX_NUM_SEQS = 256
"""max_num_seqs that EngineArgs.create_engine_config picks when unset."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""max_num_batched_tokens picked when unset and chunked prefill is on."""
# (max_num_seqs, max_num_batched_tokens) when the engine runs on CPU.
CPU_DEFAULTS = (64, 2048)
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")
"""Platforms (`jax.default_backend()`) where async scheduling is on by default."""


def async_by_default(
    platform: str | None,
    *,
    pooling: bool = False,
    pipeline: bool = False,
    multi_host: bool = False,
    speculative: bool = False,
) -> bool:
    """What an unset ``--async-scheduling`` resolves to: on for an accelerator
    (``platform``), where the host's scheduling of the next step overlaps the device's
    work on this one (1.40x batch-1 decode on an H200, bench/README.md), unless the
    engine runs what async scheduling does not (pipeline parallelism, several hosts,
    speculative decoding, a pooling model); off on a CPU (and for an unknown
    platform), where the host and the device share the same cores."""
    if platform not in ACCELERATORS:
        return False
    return not (pooling or pipeline or multi_host or speculative)


POOLING_CPU_MAX_NUM_SEQS = 128
"""A pooling model's max_num_seqs on CPU: its requests run whole in one step, and a
step of short texts (16 tokens each) fills the 2048-token budget at 128 requests
(bench/README.md: embedding throughput)."""
MIN_UNCHUNKED_BATCHED_TOKENS = 2048
"""Without chunked prefill the budget is max(max_model_len, this)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Configuration for the scheduler."""

    max_num_seqs: int | None = spec(None, gt=0)
    """Maximum number of sequences to be processed in a single iteration. There is
    no static default: if unspecified, EngineArgs.create_engine_config sets it."""
    max_num_batched_tokens: int | None = spec(None, gt=0, human_readable=True)
    """Maximum number of tokens to be processed in a single iteration. There is no
    static default: if unspecified, EngineArgs.create_engine_config sets it (8192
    with chunked prefill, else max(max_model_len, 2048) once the model length is
    known). The flag accepts human-readable k/m/g/K/M/G: 1k -> 1000, 1K -> 1024."""
    max_num_queued_reqs: int | None = spec(None, ge=0)
    """Maximum number of requests in flight (waiting or running) at once, a request
    with n > 1 counting as n; None (the default) for no limit. A request that would
    go over it is refused with HTTP 503, so that a load balancer can retry it on
    another instance; the server goes on serving. Checked by the API server's async
    engine front when a request arrives (as vLLM's AsyncLLM); the offline LLM does
    not apply it. With data parallelism it caps the whole server, all replicas
    together (unlike max_num_seqs, which is per replica): size it as about
    data_parallel_size * max_num_seqs plus the queue depth wanted."""
    max_num_queued_tokens: int | None = spec(None, ge=0, human_readable=True)
    """Maximum total prompt tokens of the requests in the prefill phase (queued or
    prefilling: no output token yet), a request with n > 1 counting its prompt n
    times; None (the default) for no limit. While that backlog is at or over it, a
    new request is refused with HTTP 503 (checked after max_num_queued_reqs). Set
    it to about target_TTFT * prefill_throughput. The count is conservative: a
    request counts its whole prompt (prefix-cache hits and chunks already computed
    included) until its first token. Checked by the API server's async engine front
    when a request arrives; the offline LLM does not apply it. With data
    parallelism it caps the whole server's backlog, all replicas together. The flag
    accepts human-readable k/m/g/K/M/G."""
    enable_chunked_prefill: bool | None = None
    """If True, prefill requests can be chunked based on the remaining
    max_num_batched_tokens. Unset (None) means enabled."""
    max_num_partial_prefills: int = spec(1, ge=1)
    """For chunked prefill, the maximum number of sequences that can be partially
    prefilled concurrently."""
    max_long_partial_prefills: int = spec(1, ge=1)
    """For chunked prefill, the maximum number of prompts longer than
    long_prefill_token_threshold that will be prefilled concurrently. Setting this
    below max_num_partial_prefills lets shorter prompts jump ahead of longer ones."""
    long_prefill_token_threshold: int = spec(0, ge=0)
    """For chunked prefill, a request is considered long if its prompt is longer
    than this number of tokens."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """The scheduling policy. "fcfs" serves requests in order of arrival;
    "priority" serves them by their given priority (lower value first), breaking
    ties by arrival time."""
    async_scheduling: bool | None = None
    """If True, the host schedules and packs step N+1 while the device runs step N;
    sampled tokens are read back one step late and fed to the next step on device.
    Outputs are the same as without it. A step whose batch holds requests that need
    their latest tokens on the host (penalties, bad words, logits processors,
    structured outputs) waits for the previous one. Not supported with pipeline
    parallelism or across hosts. None (the default): on where the engine runs on an
    accelerator (GPU, TPU) and nothing it runs needs it off (pipeline parallelism,
    several hosts, speculative decoding, a pooling model), as in vLLM; off on a CPU,
    where the host and the "device" share the same cores (`async_by_default`)."""
    num_lookahead_slots: int = spec(0, ge=0)
    """The number of slots to allocate per sequence per step beyond the known
    token ids. Used by speculative decoding to store KV of tokens that may or may
    not be accepted. With --speculative-config it is num_speculative_tokens (0, the
    default, means that too); without it, it must be 0."""

    def __post_init__(self) -> None:
        validate_config(self)
        require(
            self.max_long_partial_prefills <= self.max_num_partial_prefills,
            "max_long_partial_prefills",
            f"({self.max_long_partial_prefills}) must be <= max_num_partial_prefills "
            f"({self.max_num_partial_prefills})",
        )
        if self.max_num_partial_prefills > 1:
            require(
                self.chunked_prefill,
                "max_num_partial_prefills",
                "> 1 needs chunked prefill (--enable-chunked-prefill)",
            )
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            require(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})",
            )

    @property
    def chunked_prefill(self) -> bool:
        """Whether chunked prefill is on (None counts as on)."""
        return self.enable_chunked_prefill is not False
