"""A prompt the engine accepted: what ``prepare`` returns and ``add_prepared`` queues.

A value type beside `SamplingParams` and `RequestOutput`, so that the API server
(which validates every prompt before it queues any) and the data-parallel head
(which sends prepared prompts to other nodes) name it without reaching into the
engine.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxengine.sampling_params import SamplingParams


class PreparedPrompt(NamedTuple):
    """A validated prompt: its text (if any), token ids, and engine-ready params."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    lora_request: Any = None  # a `LoRARequest`, None for the base model
    mm_items: tuple = ()  # its images (`multimodal.items.ImageItem`), in prompt order
