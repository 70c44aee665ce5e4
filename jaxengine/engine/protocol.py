"""What the fronts ask of an engine: the `Engine` protocol.

Implemented by `LLMEngine` (one replica) and `DataParallelEngine` (several used as
one); the offline `LLM`, the async fronts (`EngineFront`) and the data-parallel
node hold their engine as an `Engine` and know neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxengine.config import EngineConfig
    from jaxengine.core.sched_output import SchedulerStats
    from jaxengine.engine.rollout import RolloutControl
    from jaxengine.inputs import PreparedPrompt
    from jaxengine.outputs import RequestOutput
    from jaxengine.sampling_params import SamplingParams


class Engine(Protocol):
    """A synchronous engine: requests in, `step()` by `step()` outputs out."""

    config: EngineConfig  # max_model_len resolved
    tokenizer: Any  # a transformers tokenizer, or None with --skip-tokenizer-init
    generation_config: dict
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    pooler: Any  # a pooling model's `PoolerSettings`, None for a generating one
    images: Any  # a vision-language model's `multimodal.processor.ImageProcessor`, or None

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids)."""
        ...

    def prepare(
        self, prompt: str | list[int] | dict, params: SamplingParams, lora_request: Any = None
    ) -> PreparedPrompt:
        """Tokenizes and validates a prompt; raises ValueError (nothing queued) if bad."""
        ...

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, **kwargs
    ) -> None:
        """`prepare`, then `add_prepared` (``arrival_time``, ``priority``)."""
        ...

    def add_prepared(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Any:
        """Queues a prompt that `prepare` accepted."""
        ...

    def abort_request(self, request_ids: str | list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; the outputs it produced."""
        ...

    def get_stats(self) -> SchedulerStats:
        """The scheduler's snapshot: queues, KV usage, counters."""
        ...

    def add_lora(self, lora_request: Any) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def list_loras(self) -> set[int]: ...

    @property
    def rollout(self) -> RolloutControl:
        """Sleep mode and weight updates over every replica (`engine.rollout`)."""
        ...

    def shutdown(self) -> None:
        """Aborts what is in flight and releases the devices. Idempotent."""
        ...
