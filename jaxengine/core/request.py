"""Request state on the host: tokens, progress, status and stop checks.

A `Request` is one sequence. `n > 1` is handled by the caller as n child requests
(each with its own id); they share the prompt's KV blocks through the prefix cache.

Invariants:

- `all_token_ids == prompt_token_ids + output_token_ids` and only grows (append-only),
  so block hashes computed over full blocks stay valid for the request's lifetime.
- `0 <= num_computed_tokens <= num_tokens + num_output_placeholders`. The tokens at
  positions `[0, num_computed_tokens)` have their KV in the cache (device blocks, or
  host blocks while SWAPPED) or in a step already dispatched; the scheduler advances
  it when it schedules a step.
- `num_output_placeholders` counts tokens that dispatched steps will sample but
  `update` has not appended yet (0 or 1 between steps; up to 2 while a step is in
  flight with async scheduling). A step may compute the position of a placeholder:
  the runner feeds it the token on device.
- `num_cached_tokens` is -1 until the request is scheduled for the first time, then
  the number of prompt tokens found in the prefix cache at that moment.

The sampling params object is opaque here; only these attributes are read (each with a
default when missing): `max_tokens` (None = up to max_model_len), `min_tokens`,
`ignore_eos`, `stop_token_ids`, `prompt_logprobs` (a request asking for prompt logprobs
bypasses the prefix cache, since skipped tokens would have no logits).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. The FINISHED_* values are terminal."""

    WAITING = 0
    """Queued, never scheduled yet."""
    RUNNING = 1
    """In the running set: holds device blocks and is scheduled each step it can be."""
    PREEMPTED = 2
    """Preempted in recompute mode: no blocks, back in the waiting queue; its prompt and
    outputs are recomputed when it resumes (prefix-cache hits permitting)."""
    SWAPPED = 3
    """Preempted in swap mode: its KV lives in host blocks; back in the waiting queue."""
    FINISHED_STOPPED = 4
    """Stopped on EOS, a stop token id, or a stop string (detokenizer)."""
    FINISHED_LENGTH_CAPPED = 5
    """Reached max_tokens or max_model_len."""
    FINISHED_ABORTED = 6
    """Aborted by the client."""

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: "stop", "length", "abort", or None if not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being served. Mutated only by the scheduler and the KV manager."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        arrival_time: float | None = None,
        priority: int | None = None,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
        mm_items: Sequence[Any] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if priority is None:
            priority = getattr(sampling_params, "priority", 0) or 0
        self.priority = priority
        """Lower is served first (as vLLM); used by the "priority" policy. Defaults to
        `sampling_params.priority` when present, else 0."""
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        """Optional salt mixed into the first block's hash: prefix-cache isolation."""
        self.lora_request = lora_request
        """The `LoRARequest` it runs with (None: the base model)."""
        self.mm_items: tuple[Any, ...] = tuple(mm_items)
        """Its images (`multimodal.items.ImageItem`), in prompt order."""

        sp = sampling_params
        self.max_tokens: int | None = getattr(sp, "max_tokens", None)
        self.min_tokens: int = getattr(sp, "min_tokens", 0) or 0
        self.ignore_eos: bool = bool(getattr(sp, "ignore_eos", False))
        self.stop_token_ids: frozenset[int] = frozenset(getattr(sp, "stop_token_ids", None) or ())
        self.pooling: bool = bool(getattr(sp, "is_pooling", False))
        """A pooling request (`PoolingParams`): its whole prompt in one step, then done."""
        self.skip_prefix_cache: bool = (
            getattr(sp, "prompt_logprobs", None) is not None or self.pooling
        )
        self.needs_known_outputs: bool = needs_known_outputs(sp)
        """Its sampling reads its output tokens on the host (penalties, bad words,
        logits processors, a grammar): a step must not be scheduled for it while one
        of its tokens is still in flight."""

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1
        self.block_hashes: list[Any] = []
        """Chained hashes of the full blocks of all_token_ids, extended by the KV manager."""
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that finished the request, if any."""
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        """Speculative decoding: the ids proposed for its next step (checked then)."""

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def prefix_salt(self) -> Any:
        """What the first block's hash mixes in (`kv_cache.hashing`): the cache salt and
        the adapter, so requests of different adapters never share cached pages."""
        if self.lora_request is None:
            return self.cache_salt
        lora = self.lora_request
        return (self.cache_salt, "lora", lora.lora_int_id, lora.lora_name, lora.lora_path)

    def image_keys(self, start: int, end: int) -> tuple[str, ...]:
        """The keys of the images that fill any of positions ``[start, end)``: what a
        block of those positions hashes besides its tokens (`kv_cache.hashing`)."""
        return tuple(i.key for i in self.mm_items if i.start < end and i.end > start)

    # ---- sizes -------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those that dispatched steps are sampling."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def length_reached_in_flight(self) -> bool:
        """Whether a token in flight will be the last one max_tokens allows (so no
        further step is worth scheduling before it arrives)."""
        if not self.num_output_placeholders or self.max_tokens is None:
            return False
        return self.num_output_tokens + self.num_output_placeholders >= self.max_tokens

    def waits_for_placeholder(self, max_model_len: int) -> bool:
        """Whether the token in flight must arrive before it is scheduled again."""
        if not self.num_output_placeholders:
            return False
        return (
            self.needs_known_outputs
            or self.length_reached_in_flight
            or self.num_tokens_with_placeholders >= max_model_len
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float]:
        """(priority, arrival_time): smaller is served earlier."""
        return (self.priority, self.arrival_time)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for t in token_ids:
            self.output_token_ids.append(t)
            self.all_token_ids.append(t)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """After appending one output token: set a FINISHED_* status if the request is done.

    Order: EOS (unless ignore_eos) and stop token ids, both only once `min_tokens`
    outputs exist; then max_tokens and max_model_len. Returns whether it finished.
    String stops are not checked here (the detokenizer layer finishes those by id).
    """
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= request.min_tokens:
        if last == request.eos_token_id and not request.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = request.max_tokens
    if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
        request.num_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def needs_known_outputs(params: Any) -> bool:
    """Whether sampling with ``params`` reads the request's output tokens on the host."""
    return bool(
        getattr(params, "has_penalties", False)
        or getattr(params, "bad_words", None)
        or getattr(params, "logits_processors", None)
        or getattr(params, "structured_outputs", None) is not None
    )
