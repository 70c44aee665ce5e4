"""Anthropic's Messages API request bodies (pydantic models): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

The models check the shape of the top-level fields; message content blocks and tool
definitions are read (and refused, naming what they ask for) when the request is
translated to chat (`server/messages/translate.py`). Unknown top-level fields are
ignored and logged, as on the OpenAI routes; the Anthropic fields that would change
the output but that jaxengine does not run are declared and refused (`REFUSED`).
``chat_template_kwargs`` is vLLM's extra field, passed to the chat template.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.unsupported_fields import Refusal, RefusingModel

logger = logging.getLogger("jaxengine.server")


def _given(value: Any, _: dict[str, Any]) -> bool:
    return value is not None


REFUSED: dict[str, Refusal] = {
    "container": Refusal(_given, "containers (the code execution sandbox) are not supported"),
    "mcp_servers": Refusal(
        lambda v, _: bool(v),
        "MCP servers (the MCP connector) are not supported: connect to the MCP server on "
        "your side and pass its tools as client tools",
    ),
    "context_management": Refusal(
        _given, "context management (clearing old tool results or thinking) is not supported"
    ),
    "service_tier": Refusal(
        lambda v, _: v not in (None, "auto", "standard_only"),
        'only the "auto" and "standard_only" service tiers are served',
    ),
    "diagnostics": Refusal(_given, "diagnostics (prompt-cache miss reasons) are not supported"),
    "output_format": Refusal(
        _given, "the beta `output_format` field is not supported: send `output_config.format`"
    ),
}
"""The Anthropic request fields refused when given, by name."""


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)


class AnthropicMessage(AnthropicModel):
    """One turn: its content is a string or a list of content blocks (kept as dicts)."""

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s `name`')
        return self


class ThinkingConfig(AnthropicModel):
    """``thinking``: ``type`` is checked in translation, so an unsupported one is
    refused by name."""

    type: str
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    """``output_config``: ``format`` is a structured output (a JSON schema), ``effort``
    reaches the chat template as ``reasoning_effort`` (as vLLM)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class AnthropicCountTokensRequest(AnthropicModel, RefusingModel):
    """POST /v1/messages/count_tokens: what the prompt is rendered from."""

    refused: ClassVar[dict[str, Refusal]] = REFUSED

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    """Prompt caching is automatic (the prefix cache): accepted, changes nothing."""
    # refused when given (REFUSED)
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class Metadata(AnthropicModel):
    user_id: str | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    # refused when given (REFUSED)
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
