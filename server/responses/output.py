"""The Response object and its output items, from what chat completions produced.

A response's ``output`` lists, in order: a ``reasoning`` item (the reasoning
parser's ``reasoning_content``, as one ``reasoning_text`` part), a ``message`` with
one ``output_text`` part (when there is content), and a ``function_call`` item per
tool call (``call_id`` is the chat tool call's id). ``output_text`` is not sent: the
openai SDK computes it from the message items. A generation cut by the token limit
has status ``"incomplete"`` (``incomplete_details.reason: "max_output_tokens"``), and
so has its last item; the items before it were finished.

Usage: ``input_tokens`` (``cached_tokens``: the prompt tokens found in the prefix
cache), ``output_tokens`` (``reasoning_tokens``: those before the reasoning parser's
end marker, see `reasoning_tokens`) and ``total_tokens``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from server.responses.protocol import ResponsesRequest

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
"""Statuses after which a response no longer changes."""


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def base_response(
    request: ResponsesRequest, response_id: str, model: str, defaults: dict[str, Any]
) -> dict[str, Any]:
    """The Response object before any output (status ``"in_progress"``): the request's
    settings echoed, ``defaults`` the sampling values used when it gives none."""
    effort = request.reasoning.effort if request.reasoning else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "metadata": request.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "service_tier": request.service_tier or "auto",
        "store": request.store,
        "temperature": _value(request.temperature, "temperature", defaults),
        "text": {"format": (request.text.format if request.text else None) or {"type": "text"}},
        "tool_choice": request.tool_choice or "auto",
        "tools": list(request.tools or []),
        "top_logprobs": request.top_logprobs or 0,
        "top_p": _value(request.top_p, "top_p", defaults),
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
    }


def _value(given: float | None, name: str, defaults: dict[str, Any]) -> float:
    if given is not None:
        return given
    return float(defaults.get(name, 1.0))


def finished(
    base: dict[str, Any],
    output: list[dict[str, Any]],
    usage: dict[str, Any],
    finish_reason: str | None,
) -> dict[str, Any]:
    """The Response object once its generation ended with ``finish_reason``."""
    incomplete = finish_reason == "length"
    return {
        **base,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": usage,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str, status: str = "completed", logprobs: list | None = None
) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a chat.completion choice (see the module docstring)."""
    message = choice["message"]
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(new_id("msg"), message["content"], logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        item = function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"])
        items.append(item)
    if items and choice.get("finish_reason") == "length":
        items[-1]["status"] = "incomplete"
    return items


def usage(chat_usage: dict[str, Any], cached: int, reasoning: int) -> dict[str, Any]:
    """Responses' usage from chat's (``prompt_tokens``, ``completion_tokens``)."""
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def reasoning_tokens(parser: Any, token_ids: Sequence[int], reasoned: bool) -> int:
    """How many generated tokens are reasoning: those before the reasoning parser's end
    marker (the marker included); all of them when the reasoning never ended but some
    was found (``reasoned``); 0 without a parser."""
    if parser is None or not token_ids:
        return 0
    if parser.is_reasoning_end(token_ids):
        return len(token_ids) - len(parser.content_token_ids(token_ids))
    return len(token_ids) if reasoned else 0
