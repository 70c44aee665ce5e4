"""POST /v1/chat/completions/batch (vLLM): several conversations in one request.

The body is a chat completion request whose ``messages`` is a list of conversations;
every other field applies to each of them. Each conversation becomes one chat request
(``{id}_{i}``) run concurrently through `ChatHandler`, and the response is one chat
completion whose choice ``i`` answers conversation ``i``, with the usage summed.
As in vLLM, streaming, tools, beam search and ``n`` > 1 are refused; so is
``prompt_logprobs``, which has no place in the merged response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from server import response_fields as R
from server.chat.protocol import ChatCompletionRequest
from server.errors import APIError, validation_message
from server.protocol import OpenAIModel
from server.serving import until_disconnected

_REFUSED = (
    ("stream", "Batch chat completions do not support streaming. Please set `stream` to false."),
    ("tools", "Batch chat completions do not support tools. Please leave out `tools`."),
    (
        "use_beam_search",
        "Batch chat completions do not support beam search. Please set `use_beam_search` to False.",
    ),
    ("prompt_logprobs", "Batch chat completions do not support `prompt_logprobs`."),
)


class BatchChatCompletionRequest(OpenAIModel):
    """The batch body: ``messages`` is a list of conversations; the other fields
    (kept as given) are those of a chat completion request."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    messages: list[list[dict[str, Any]]] = Field(min_length=1)
    n: int | None = 1

    @model_validator(mode="after")
    def _check_batch(self):
        if any(not conversation for conversation in self.messages):
            raise ValueError("each conversation in `messages` needs at least one message")
        if self.n is not None and self.n != 1:
            raise ValueError("Batch chat completions do not support `n > 1`. Please set `n` to 1.")
        extra = self.model_extra or {}
        for name, reason in _REFUSED:
            if extra.get(name):
                raise ValueError(reason)
        return self

    def conversations(self, request_id: str) -> list[ChatCompletionRequest]:
        """One validated chat request per conversation (ids ``{request_id}_{i}``);
        an invalid field fails the whole batch (APIError) before anything runs."""
        fields = self.model_dump(exclude={"messages", "request_id"}, exclude_unset=True)
        try:
            return [
                ChatCompletionRequest.model_validate(
                    {**fields, "messages": conversation, "request_id": f"{request_id}_{i}"}
                )
                for i, conversation in enumerate(self.messages)
            ]
        except ValidationError as e:
            message, param = validation_message(list(e.errors()))
            raise APIError(message, param=param) from None


class BatchChatHandler:
    """Runs a batch through a `ChatHandler` and merges the replies."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat

    async def create(self, request: BatchChatCompletionRequest, raw_request=None) -> dict:
        extra = request.model_extra or {}
        request_id = extra.get("request_id") or R.random_id("chatcmpl")
        singles = request.conversations(request_id)
        work = _all([self.chat.create(single) for single in singles])
        replies = await until_disconnected(raw_request, work)
        return merge_replies(request_id, replies)


async def _all(works: Sequence[Awaitable[dict]]) -> list[dict]:
    """Every reply, in order; if one fails, the others are cancelled (which aborts
    their engine requests) before the error goes on."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merge_replies(request_id: str, replies: Sequence[dict]) -> dict[str, Any]:
    """One chat completion: reply ``i``'s choice as choice ``i``, the usage summed."""
    choices = []
    for i, reply in enumerate(replies):
        for choice in reply["choices"]:
            choices.append({**choice, "index": i})
    usage: dict[str, Any] = {}
    for reply in replies:
        for key, value in reply["usage"].items():
            if isinstance(value, int):
                usage[key] = usage.get(key, 0) + value
            elif isinstance(value, dict):  # e.g. prompt_tokens_details
                inner = usage.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = (inner.get(k) or 0) + (v or 0)
    merged = {**replies[0], "id": request_id, "choices": choices, "usage": usage}
    if "metrics" in merged:
        merged["metrics"] = None  # vLLM: per-request timings describe one conversation
    return merged
