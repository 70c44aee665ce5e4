"""An Anthropic Messages request as the equivalent `ChatCompletionRequest`.

The Messages API runs on the chat-completions path (`ChatHandler`), so the prompt,
sampling, tool calling and reasoning are chat's. The mapping:

- ``system`` (a string or text blocks) -> a system message; ``messages`` -> chat
  messages: text blocks -> text parts; an assistant's ``tool_use`` blocks -> its
  ``tool_calls``; its ``thinking`` blocks -> its ``reasoning_content`` (and
  ``reasoning``), which templates that show past reasoning read and the others drop;
  ``redacted_thinking`` is dropped (opaque); a user's ``tool_result`` blocks -> tool
  messages, in order with the user's text (an ``is_error`` result's text starts with
  "Error: "). A final assistant turn is a prefill: chat continues it.
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) -> function
  tools; ``tool_choice`` auto / any / tool / none -> "auto" / "required" / named /
  "none", ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``. ``any`` and
  ``tool`` are constrained by structured outputs, as in chat.
- ``thinking`` enabled or adaptive needs the server's reasoning parser; it sets
  the template's ``enable_thinking`` (disabled clears it). Enabled's ``budget_tokens``
  is checked as Anthropic checks it (at least 1024, below ``max_tokens``) and becomes
  chat's ``thinking_token_budget``: the engine forces the end of reasoning after that
  many reasoning tokens (`jaxengine.reasoning.budget`; a parser without a single end
  token refuses it). The reasoning counts towards ``max_tokens``, the hard limit.
- ``output_config.format`` -> ``response_format`` (a JSON schema), ``effort`` ->
  ``reasoning_effort``; ``max_tokens``, ``stop_sequences``, ``temperature``,
  ``top_p``, ``top_k``, ``metadata.user_id`` -> their chat fields.

A user's ``image`` block (``source`` base64 or url) becomes chat's ``image_url`` part
(a model that takes no images refuses it there). Everything that cannot be rendered
or run (documents, server tools, unknown blocks) is an `APIError` (400) naming it and
its place in the request.
"""

from __future__ import annotations

import json
from typing import Any

from server.chat.protocol import ChatCompletionRequest
from server.errors import APIError
from server.messages.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    OutputConfig,
)

NO_IMAGES = "image blocks are only taken in user messages"
NO_DOCUMENTS = (
    "document blocks (and their citations) are not supported: send the document's text "
    "in a text block"
)
CLIENT_TOOL_KEYS = frozenset(
    {"name", "description", "input_schema", "type", "cache_control", "strict"}
)
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
FORCED_CHOICES = ("any", "tool")
MIN_BUDGET_TOKENS = 1024  # Anthropic's smallest thinking budget


def to_chat_request(
    request: AnthropicCountTokensRequest, reasoning: bool, request_id: str | None = None
) -> ChatCompletionRequest:
    """The chat request for ``request`` (a count_tokens request gives the prompt only).

    ``reasoning``: the server runs a reasoning parser (``--reasoning-parser``).
    """
    messages = system_messages(request.system) + chat_messages(request.messages)
    fields: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.messages[-1].role == "assistant":  # a prefill: continue it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    kwargs = {**thinking_kwargs(request, reasoning), **(request.chat_template_kwargs or {})}
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    fields.update(tool_fields(request))
    if request.output_config is not None:
        fields.update(output_fields(request.output_config))
    if isinstance(request, AnthropicMessagesRequest):
        fields.update(sampling_fields(request))
        fields["request_id"] = request_id
    return ChatCompletionRequest(**fields)


def sampling_fields(request: AnthropicMessagesRequest) -> dict[str, Any]:
    """The sampling, streaming and thinking-budget fields; a stream asks chat for usage
    on every chunk (the input tokens of ``message_start``, the final usage of
    ``message_delta``)."""
    fields: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stream": request.stream,
    }
    if request.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if request.thinking is not None and request.thinking.type == "enabled":
        fields["thinking_token_budget"] = request.thinking.budget_tokens  # checked
    if request.metadata is not None and request.metadata.user_id is not None:
        fields["user"] = request.metadata.user_id
    return fields


def output_fields(config: OutputConfig) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if config.format is not None:
        schema = {"name": "output", "schema": config.format.json_schema}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if config.effort is not None:
        fields["reasoning_effort"] = config.effort
    return fields


# ---------------------------------------------------------------------- messages


def system_messages(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The system prompt as one system message (none when it is left out)."""
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    parts = [_text_part(block, f"system[{i}]") for i, block in enumerate(system)]
    return [{"role": "system", "content": parts}]


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages for Anthropic turns (a user turn with tool results gives several)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message.content, where))
        else:
            out.extend(_user(message.content, where))
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    parts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append(_text_part(block, at))
        elif kind == "thinking":
            reasoning.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind != "redacted_thinking":
            _refuse_block(kind, at, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(reasoning)
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The user's text parts as user messages, each tool result as a tool message,
    in the order of the blocks."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append(_text_part(block, at))
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_message(block, at))
        else:
            _refuse_block(kind, at, "user")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _tool_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise APIError(f"{at}.input must be an object", param=_field(at))
    function = {"name": _string(block, "name", at), "arguments": json.dumps(arguments)}
    return {"id": _string(block, "id", at), "type": "function", "function": function}


def _tool_message(block: dict[str, Any], at: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, inner in enumerate(content):
            inner_at = f"{at}.content[{k}]"
            kind = _block_type(inner, inner_at)
            if kind != "text":
                _refuse_block(kind, inner_at, "tool_result")
            parts.append(_string(inner, "text", inner_at))
        text = "\n".join(parts)
    else:
        raise APIError(f"{at}.content must be a string or a list of blocks", param=_field(at))
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": text}


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as chat's ``image_url`` part: base64 data as a data: URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = _string(source, "media_type", f"{at}.source")
        url = f"data:{media};base64,{_string(source, 'data', f'{at}.source')}"
    elif kind == "url":
        url = _string(source, "url", f"{at}.source")
    else:
        raise APIError(
            f"{at}.source must be a base64 or url image source, got {kind!r}", param=_field(at)
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _refuse_block(kind: str, at: str, holder: str) -> None:
    if kind == "image":
        raise APIError(f"{at}: {NO_IMAGES}", param=_field(at))
    if kind == "document":
        raise APIError(f"{at}: {NO_DOCUMENTS}", param=_field(at))
    raise APIError(
        f"{at}: content blocks of type {kind!r} are not supported in a {holder} block list",
        param=_field(at),
    )


def _block_type(block: Any, at: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise APIError(f"{at} must be a content block with a `type`", param=_field(at))
    return block["type"]


def _text_part(block: Any, at: str) -> dict[str, str]:
    kind = _block_type(block, at)
    if kind != "text":
        _refuse_block(kind, at, "text")
    return {"type": "text", "text": _string(block, "text", at)}


def _field(at: str) -> str:
    """The top-level field of a location such as ``messages[2].content[0]``."""
    return at.split("[", 1)[0]


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise APIError(f"{at}.{key} must be a string", param=_field(at))
    return value


# ---------------------------------------------------------------------- tools, thinking


def tool_fields(request: AnthropicCountTokensRequest) -> dict[str, Any]:
    """Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    choice = request.tool_choice
    forced = choice is not None and choice.type in FORCED_CHOICES
    if not request.tools:
        if not forced:
            return {}  # "auto" or "none" without tools: nothing to choose from
        raise APIError(f'tool_choice "{choice.type}" needs `tools`', param="tool_choice")
    fields: dict[str, Any] = {
        "tools": [_tool(t, f"tools[{i}]", forced) for i, t in enumerate(request.tools)]
    }
    if choice is not None:
        if choice.type == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = TOOL_CHOICES[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _tool(tool: dict[str, Any], at: str, forced: bool) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise APIError(
            f"{at}: server tools ({kind!r}) are not supported: only client tools (with an "
            "`input_schema`, run by the client) are served",
            param="tools",
        )
    unknown = sorted(set(tool) - CLIENT_TOOL_KEYS)
    if unknown:
        raise APIError(f"{at}: {', '.join(unknown)} not supported on tools", param="tools")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not isinstance(schema, dict):
        raise APIError(f"{at} needs a `name` and an `input_schema` object", param="tools")
    if tool.get("strict") and not forced:
        raise APIError(
            f"{at}.strict: only tool_choice any or tool constrains the calls to the schema",
            param="tools",
        )
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": {**function, "parameters": schema}}


def thinking_kwargs(request: AnthropicCountTokensRequest, reasoning: bool) -> dict[str, Any]:
    """The chat template's ``enable_thinking`` for ``thinking``; 400 for what it cannot
    do: no reasoning parser, a forced tool call, a budget out of range."""
    thinking = request.thinking
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"enable_thinking": False}
    if thinking.type not in ("enabled", "adaptive"):
        raise APIError(
            f"thinking type {thinking.type!r} is not supported (enabled, adaptive, disabled)",
            param="thinking",
        )
    if not reasoning:
        raise APIError(
            "thinking needs a reasoning parser: start the server with --reasoning-parser",
            param="thinking",
        )
    choice = request.tool_choice
    if choice is not None and choice.type in FORCED_CHOICES:
        raise APIError(
            f'thinking cannot be combined with tool_choice "{choice.type}", which '
            "constrains the whole output to the tool call",
            param="thinking",
        )
    if thinking.type == "enabled":
        _check_budget(thinking.budget_tokens, getattr(request, "max_tokens", None))
    return {"enable_thinking": True}


def _check_budget(budget: int | None, max_tokens: int | None) -> None:
    """Anthropic's rules: a budget of at least `MIN_BUDGET_TOKENS`, below ``max_tokens``."""
    if budget is None:
        raise APIError("thinking.enabled.budget_tokens: Field required", param="thinking")
    if budget < MIN_BUDGET_TOKENS:
        raise APIError(
            "thinking.enabled.budget_tokens: Input should be greater than or equal to "
            f"{MIN_BUDGET_TOKENS}",
            param="thinking",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise APIError(
            "`max_tokens` must be greater than `thinking.budget_tokens`", param="thinking"
        )
