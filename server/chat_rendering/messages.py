"""A chat request's messages as the chat template gets them.

Text parts (``text``, ``input_text``) and ``image_url`` parts, whose images reach the
template as ``{"type": "image"}`` parts (`server/chat_rendering/images.py` loads the images);
the content format ("string" or "openai", ``--chat-template-content-format``); an
assistant's ``tool_calls`` with their arguments decoded; and the request's own chat
template, refused unless ``--trust-request-chat-template``.
"""

from __future__ import annotations

import json
from typing import Any

from server.chat_rendering.images import IMAGE_PART
from server.errors import APIError

_PART_TYPES_TEXT = ("text", "input_text")

NO_IMAGE_TEMPLATE = (
    "the chat template does not support images: it takes each message's content as one "
    "string, not a list of parts (if it does iterate over content parts, start the server "
    "with --chat-template-content-format openai)"
)


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def request_template(request: Any, kwargs: dict[str, Any], options: Any) -> str | None:
    """The chat template a request brings, or None: ``chat_template_kwargs``'s
    ``chat_template`` (taken out of ``kwargs``), else ``chat_template``. As vLLM, a
    request that brings one is refused (400) unless --trust-request-chat-template."""
    given = kwargs.pop("chat_template", None) or getattr(request, "chat_template", None)
    if given is not None and not options.trust_request_chat_template:
        raise APIError(UNTRUSTED_TEMPLATE)
    return given


def content_format(option: str, template: str | None) -> str:
    """ "string" or "openai": how message content reaches the template."""
    if option != "auto":
        return option
    text = template or ""
    iterates = any(s in text for s in ("['type']", '["type"]', ".type ==", "content[0]"))
    return "openai" if iterates else "string"


def normalize_message(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A message whose content is a string (``fmt="string"``) or a list of parts: text
    parts, and ``{"type": "image"}`` for each ``image_url`` part (400 for an image
    with ``fmt="string"``: the template cannot place it).

    An assistant message's ``tool_calls`` reach the template with their
    ``function.arguments`` as a dict (decoded from OpenAI's JSON string), as Hugging
    Face templates expect; its content may be null.
    """
    if "role" not in message:
        raise APIError("each message needs a `role`", param="messages")
    if message.get("tool_calls") is not None:
        message = {**message, "tool_calls": _template_tool_calls(message["tool_calls"])}
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise APIError("message content must be a string or a list of parts", param="messages")
    parts = [_template_part(part, fmt) for part in content]
    if fmt == "openai":
        return {**message, "content": parts}
    return {**message, "content": "\n".join(p["text"] for p in parts)}


def _template_part(part: Any, fmt: str) -> dict[str, str]:
    """A content part as the template gets it: a text part, or an image's
    ``{"type": "image"}`` (which only a template over parts, "openai", can place)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _PART_TYPES_TEXT:
        return {"type": "text", "text": part.get("text", "")}
    if kind != IMAGE_PART:
        raise APIError(
            f"content part type {kind!r} is not supported (text and image_url only)",
            param="messages",
        )
    if fmt != "openai":
        raise APIError(NO_IMAGE_TEMPLATE, param="messages")
    return {"type": "image"}


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined (images left out)."""
    content = message.get("content")
    if not isinstance(content, list):
        return content or ""
    texts = [p for p in content if isinstance(p, dict) and p.get("type") in _PART_TYPES_TEXT]
    return "\n".join(p.get("text", "") for p in texts)


def _template_tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError("a message's `tool_calls` must be a list", param="messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise APIError("each tool call needs a `function` object", param="messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise APIError(
                    f"tool call arguments are not JSON: {arguments!r}", param="messages"
                ) from None
        out.append({**call, "function": {**function, "arguments": arguments or {}}})
    return out
