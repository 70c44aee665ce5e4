"""The chat completions request body: ``POST /v1/chat/completions``.

Its sampling fields (OpenAI's and vLLM's) are the shared `SamplingFields`
(`server/protocol.py`); the fields that would change the output but do not run are
refused by name (`CHAT_REFUSED`, `server/unsupported_fields.py`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

from server.protocol import SamplingFields
from server.unsupported_fields import CHAT_REFUSED, Refusal


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    refused: ClassVar[dict[str, Refusal]] = CHAT_REFUSED
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    # refused (server/unsupported_fields.py)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
