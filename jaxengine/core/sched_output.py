"""The scheduler <-> runner contract: SchedulerOutput, RunnerOutput, EngineCoreOutput.

All frozen dataclasses of plain Python values (tuples, dicts, ints), importable
without jax.

One step, as the runner sees it (`SchedulerOutput`):

1. Forget requests in `finished_req_ids` (finished or aborted since the last step;
   ids it never saw may appear, ignore them).
2. Copy pages: first `blocks_to_swap_out` (device -> host), then `blocks_to_swap_in`
   (host -> device), both before the forward pass.
3. Register `scheduled_new_reqs` (first schedule of a request: full data). Update
   `scheduled_cached_reqs`: append `new_block_ids` to the request's block table, or
   replace the table with them when `resumed_from_preemption`. Requests in
   `preempted_req_ids` are not scheduled this step; keep their state (they resume as
   cached requests) but drop them from the batch.
4. For every request in `num_scheduled_tokens`: the input tokens sit at positions
   `[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[id])`; their ids
   are `prompt_token_ids[those positions]` for new requests and `new_token_ids` for
   cached ones. Write their KV through the block table (position p -> block
   `block_ids[p // block_size]`, slot `p % block_size`), attend over positions
   `[0, p]`, and sample one token after the last one unless the id is in
   `partial_req_ids` (prefill not finished: return an empty list). A request in
   `structured_output_req_ids` samples only tokens allowed by its row of
   `grammar_bitmask`. A pooling request (`PoolingParams`) samples nothing: its
   whole prompt is scheduled in one step and its result is its pooled hidden states.
   Speculative decoding: a request in `scheduled_spec_decode_tokens` has its last
   `len(drafts)` scheduled positions filled with those proposed ids (they are not
   among its known tokens). Sample after its last known token and after each draft
   (each with the outputs before it), accept the drafts while each equals the token
   sampled before it, and return the accepted drafts plus the next sampled token.
   A hybrid model's saved states: copy each `state_restores` row into its request's
   state slot before the forward pass, and each request's slot into its
   `state_saves` row after it.
   Images (a vision-language model): first run `encoder_inputs` in order, each
   image's embeddings into its rows; a new request's `images` then say which prompt
   positions take which key's rows as their input embeddings.
5. Return a `RunnerOutput` with one entry per scheduled request, and (speculative
   decoding) each request's proposals for its next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled for the first time."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: Any
    block_ids: tuple[int, ...]
    """The full block table."""
    num_computed_tokens: int
    """Tokens already in the cache (prefix hit) = the first scheduled position."""
    eos_token_id: int | None = None
    lora_request: Any = None
    """The `LoRARequest` it runs with (None: the base model)."""
    images: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Its images (a vision-language model): ``(key, prompt positions)`` each; the
    positions take the rows of that key's latest `EncoderInput` as embeddings."""
    image_grids: tuple[tuple[int, int, int], ...] = ()
    """An M-RoPE model's (Qwen2.5-VL): each image's tokens as (frames, rows, columns),
    in `images`' order, which place its decoder positions; empty elsewhere."""


@dataclass(frozen=True)
class EncoderInput:
    """One image to encode before a step's forward, into ``rows`` of the runner's
    image embeddings (one row per embedding, in order)."""

    key: str
    inputs: dict
    """The processor's arrays for this image (`multimodal.items.ImageItem.inputs`)."""
    units: int
    rows: tuple[int, ...]


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already knows: only what changed."""

    req_id: str
    resumed_from_preemption: bool
    """True: `new_block_ids` is the full table (replace it); False: append them."""
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    """The first scheduled position."""
    new_token_ids: tuple[int, ...]
    """The input token ids of this step's scheduled positions."""


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute in one step. `total_num_scheduled_tokens <= max_num_batched_tokens`
    and `len(num_scheduled_tokens) <= max_num_seqs`."""

    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]
    """Tokens scheduled per request (> 0), in batch order (running first, then admitted)."""
    total_num_scheduled_tokens: int
    partial_req_ids: frozenset[str] = frozenset()
    """Scheduled requests still mid-prefill after this step: no token is sampled."""
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    """(device block, host block) pairs."""
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    """(host block, device block) pairs."""
    structured_output_req_ids: tuple[str, ...] = ()
    """Requests whose next token is constrained (structured outputs), in bitmask order."""
    grammar_bitmask: Any = None
    """None, or int32 numpy rows [n, ceil(V / 32)]: bit j of word w set = token
    32 * w + j allowed. One row per request of `structured_output_req_ids`, in order,
    and after it one more per proposal it verifies (the mask after that proposal)."""
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Speculative decoding: the proposed ids each request verifies this step (their
    positions are the last ones of its `num_scheduled_tokens`)."""
    encoder_inputs: tuple[EncoderInput, ...] = ()
    """Images to encode before the forward, in order. Every image position a step
    computes has its key encoded in this step or an earlier one, and its rows are
    not reassigned before the step runs (`core.encoder_cache`)."""
    state_restores: tuple[tuple[str, int], ...] = ()
    """A hybrid model's prefix hits: (request, saved-state row) pairs; the row's
    states go into the request's slot before the forward pass."""
    state_saves: tuple[tuple[str, int], ...] = ()
    """(request, saved-state row) pairs: the request's states at the end of this
    step (at a block's end) go into the row after the forward pass."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced, aligned on `req_ids` (every scheduled request)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request: the sampled ids (none for a request in `partial_req_ids`; one, or
    with speculative decoding the accepted drafts and one more)."""
    logprobs: list[Any] | None = None
    """Per request, opaque (passed through to EngineCoreOutput), or None for all."""
    prompt_logprobs: list[Any] | None = None
    """Per request, opaque (passed through), or None for all."""
    spec_token_ids: list[list[int]] | None = None
    """Speculative decoding: per request, the ids it proposes for its next step."""
    pooler_output: list[Any] | None = None
    """Pooling requests: per request, its pooled result (a numpy array) once its
    whole prompt ran, else None; None for all when the step had none."""


@dataclass(frozen=True)
class SpecDecodingStats:
    """Cumulative speculative-decoding counters (vLLM's ``spec_decode_*``)."""

    num_drafts: int = 0
    """Steps in which a request verified proposals."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    """Accepted proposals by their position in the draft (0: the first)."""

    def observe(self, num_draft: int, num_accepted: int) -> SpecDecodingStats:
        per_pos = list(self.accepted_per_pos) + [0] * (num_draft - len(self.accepted_per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1
        return SpecDecodingStats(
            self.num_drafts + 1,
            self.num_draft_tokens + num_draft,
            self.num_accepted_tokens + num_accepted,
            tuple(per_pos),
        )


@dataclass(frozen=True)
class EngineCoreOutput:
    """Per request, what `Scheduler.update` learned in one step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """"stop", "length" or None (still running)."""
    stop_reason: int | str | None = None
    """The stop token id that finished the request (None for EOS or length)."""
    new_logprobs: Any = None
    new_prompt_logprobs: Any = None
    num_cached_tokens: int = 0
    pooling_output: Any = None
    """A pooling request's result (it finishes with it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics and logs. Prefix-cache counters are cumulative tokens."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Running requests per LoRA adapter name."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Waiting requests per LoRA adapter name."""
    max_lora: int = 0
    """``--max-loras`` (0: LoRA off)."""
    spec_decoding: SpecDecodingStats | None = None
    """Speculative-decoding counters (None: speculative decoding off)."""
    sleep_level: int = 0
    """0 awake; the sleep level (1 weights in host memory, 2 dropped) while asleep.
    Set by the engine (`LLMEngine.get_stats`), not the scheduler."""
    mm_cache_queries: int = 0
    """Images requests needed (once per request and image; `core.encoder_cache`)."""
    mm_cache_hits: int = 0
    """Of those, the images found encoded already."""
    num_deferred: int = 0
    """Of ``num_waiting``, the requests the last admission pass skipped (vLLM's
    "deferred": LoRA budget, grammar still compiling, a token in flight, the
    partial-prefill limit); the others wait for capacity."""
    num_kv_cache_total_blocks: int = 0
    """Usable KV-cache blocks on the device."""
    num_prefix_cached_blocks: int = 0
    """Of those, the blocks in the prefix cache now (in use or free until evicted)."""
    num_prefix_cached_tokens: int = 0
    """The tokens those blocks hold (``num_prefix_cached_blocks * block_size``)."""

    @property
    def prefix_cache_usage(self) -> float:
        """Fraction of the KV-cache blocks in the prefix cache, in [0, 1]."""
        total = self.num_kv_cache_total_blocks
        return self.num_prefix_cached_blocks / total if total else 0.0
