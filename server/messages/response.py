"""Anthropic's ``message`` object from a chat.completion (one choice), and the pieces a
stream shares with it: stop reasons, usage, thinking signatures, tool inputs.

- content blocks, in order: ``thinking`` (the choice's reasoning), ``text`` (its
  content, when not empty), one ``tool_use`` per tool call (``input``: the call's
  arguments, decoded);
- ``stop_reason``: chat's ``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens``,
  ``stop`` on a stop string -> ``stop_sequence`` (and ``stop_sequence`` the string),
  ``stop`` otherwise (EOS, a stop token) -> ``end_turn``, ``abort`` (the engine gave
  the request up: /pause, a rollout abort) -> ``pause_turn``, whose partial reply a
  client may send back as a prefill to continue it;
- ``usage``: Anthropic's input tokens exclude the cache reads, so with
  ``--enable-prompt-tokens-details`` ``input_tokens`` + ``cache_read_input_tokens``
  is chat's ``prompt_tokens``; without it the reads are unknown and left out.

A thinking block's ``signature`` is the SHA-256 of its text: clients need one to send
the block back, and the server does not check it. ``--enable-per-request-metrics``
timings come as a ``metrics`` object beside ``usage``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any

logger = logging.getLogger("jaxengine.server")

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "abort": "pause_turn"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched: Any) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for chat's finish_reason and stop_reason (the
    matched stop string, a stop token id, or None)."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage for chat's (prompt, completion, cached tokens)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    details = chat_usage.get("prompt_tokens_details")
    out = {"input_tokens": prompt, "output_tokens": chat_usage.get("completion_tokens", 0)}
    if details is not None:
        cached = details.get("cached_tokens") or 0
        out["input_tokens"] = prompt - cached
        out["cache_read_input_tokens"] = cached
    return out


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def thinking_block(thinking: str, shown: bool) -> dict[str, Any]:
    """``shown`` False: ``display: "omitted"``, the text left out, the signature kept."""
    return {
        "type": "thinking",
        "thinking": thinking if shown else "",
        "signature": signature(thinking),
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's decoded arguments; {} for arguments cut short (max_tokens) or not an
    object, which a client cannot run either way."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        logger.warning("tool call arguments are not complete JSON: %r", arguments[:200])
        return {}
    return value if isinstance(value, dict) else {}


def message_start(msg_id: str, model: str, chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """The empty message that ``message_start`` carries."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(chat_usage),
    }


def from_chat_completion(completion: dict[str, Any], thinking_shown: bool = True) -> dict[str, Any]:
    """The ``message`` for a chat.completion of one choice."""
    choice = completion["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append(thinking_block(message["reasoning_content"], thinking_shown))
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": tool_input(function["arguments"]),
            }
        )
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    out = {
        **message_start(completion["id"], completion["model"], completion.get("usage")),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
    }
    if completion.get("metrics") is not None:
        out["metrics"] = completion["metrics"]
    return out
