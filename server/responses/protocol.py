"""The body of ``POST /v1/responses`` (OpenAI's Responses API, with vLLM's extras).

`ResponsesRequest` validates types and refuses, with a 400 at the field, what would
change the output but does not run here: ``conversation`` objects, ``prompt``
templates, ``truncation: "auto"``, ``max_tool_calls``, ``context_management``,
``moderation``, reasoning summaries, ``text.verbosity``, and ``include`` values other
than ``"message.output_text.logprobs"``. Tools and input items are checked where they
are translated (`server/responses/input.py`). Fields that cannot change the output
(``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``stream_options``)
are accepted; any other unknown field is ignored and logged, as on the other routes.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from server.protocol import OpenAIModel
from server.unsupported_fields import Refusal, RefusingModel

logger = logging.getLogger("jaxengine.server")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one ``include`` value that is honoured: logprobs on each ``output_text``."""


def _given(value: Any, _: dict[str, Any]) -> bool:
    return value is not None and value != {} and value != []


REFUSED: dict[str, Refusal] = {
    "conversation": Refusal(
        _given,
        "conversation objects are not supported: continue with previous_response_id, "
        "or send the whole conversation as input",
    ),
    "prompt": Refusal(
        _given, "prompt templates are not supported: send input (and instructions) instead"
    ),
    "truncation": Refusal(
        lambda v, _: v == "auto",
        'truncation "auto" is not supported: a prompt longer than the context is a 400, '
        'as with truncation "disabled"',
    ),
    "max_tool_calls": Refusal(lambda v, _: v is not None, "max_tool_calls is not supported"),
    "context_management": Refusal(_given, "context management (compaction) is not supported"),
    "moderation": Refusal(_given, "moderation is not supported"),
}
"""The refused top-level fields, by name (the nested ones have validators below)."""


class ReasoningConfig(OpenAIModel):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort``."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summaries(cls, value: str | None) -> str | None:
        if value not in (None, "auto"):
            raise ValueError(
                f"reasoning summaries ({value!r}) are not supported: the reasoning comes "
                "back whole as reasoning_text (--reasoning-parser)"
            )
        return value


class TextConfig(OpenAIModel):
    """``text``: the output's ``format`` (text, json_object, json_schema)."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"text.verbosity {value!r} is not supported")
        return value


class ResponsesRequest(OpenAIModel, RefusingModel):
    """POST /v1/responses: OpenAI's fields, and the vLLM extras it passes to chat
    completions (``stop``, ``top_k``, ``min_p``, ``repetition_penalty``,
    ``structured_outputs``, ...)."""

    refused: ClassVar[dict[str, Refusal]] = REFUSED

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    # accepted: they cannot change the output
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras, passed to chat completions
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs: a constraint (instead of ``text.format``) or options
    (``disable_any_whitespace``, ...) for the one ``text.format`` gives."""
    # refused unless left out (REFUSED)
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None

    @field_validator("include")
    @classmethod
    def _check_include(cls, value: list[str] | None) -> list[str] | None:
        for item in value or []:
            if item != LOGPROBS_INCLUDE:
                raise ValueError(
                    f"include {item!r} is not supported (only {LOGPROBS_INCLUDE!r}): "
                    "jaxengine runs no hosted tools and returns no encrypted reasoning"
                )
        return value

    @model_validator(mode="after")
    def _check_background(self):
        if self.background and not self.store:
            raise ValueError("background responses need store=true (they are retrieved later)")
        return self

    def wants_logprobs(self) -> bool:
        """Logprobs on each output_text: asked for by ``include`` or ``top_logprobs``."""
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)
