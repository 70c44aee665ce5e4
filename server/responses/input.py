"""A Responses request as the chat completions request that runs it.

Input items become chat messages (`items_to_messages`):

- a message (``{"role", "content"}``, with or without ``"type": "message"``): its
  content a string or ``input_text`` / ``output_text`` parts (``input_image``,
  ``input_file`` and ``input_audio`` are a 400: the engine takes text only);
- ``function_call`` items: the ``tool_calls`` of an assistant message (consecutive
  calls, and calls right after an assistant message, join that message);
- ``function_call_output`` items: ``tool`` messages;
- ``reasoning`` items are dropped, as vLLM drops them: chat templates leave the
  reasoning of earlier turns out of the prompt.

``instructions`` become a first system message; they are not carried over by
``previous_response_id`` (OpenAI's rule), whose conversation is prepended by the
caller. Function tools (Responses' flat shape) become chat tools; every other tool
type is a 400 naming it. ``text.format`` becomes ``response_format``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.chat.protocol import ChatCompletionRequest
from server.errors import APIError, validation_message
from server.responses.protocol import ResponsesRequest

TEXT_PARTS = ("input_text", "output_text", "text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ROLES = ("user", "system", "developer", "assistant")
CHAT_PARAMS = {
    "messages": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "logprobs": "include",
}
"""Chat request fields -> the Responses field a client sent (for a 400's ``param``)."""
PASSED = (
    "model",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "priority",
    "chat_template_kwargs",
    "structured_outputs",
    "parallel_tool_calls",
)
"""Fields that go to the chat request as they are."""


def chat_request(
    request: ResponsesRequest, conversation: list[dict[str, Any]], request_id: str
) -> ChatCompletionRequest:
    """The chat request that runs ``request`` on ``conversation`` (a previous response's
    messages, then ``input_messages(request.input)``), after its instructions; 400
    (APIError) for anything it cannot carry."""
    if not conversation:
        raise APIError("input must not be empty", param="input")
    messages = [dict(m) for m in conversation]  # the store's stay as they are
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    fields: dict[str, Any] = {name: getattr(request, name) for name in PASSED}
    fields.update(
        messages=messages,
        max_tokens=request.max_output_tokens,
        request_id=request_id,
        response_format=response_format(request.text),
        reasoning_effort=request.reasoning.effort if request.reasoning else None,
        stream=request.stream,
        stream_options={"include_usage": True} if request.stream else None,
    )
    if request.wants_logprobs():
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        fields.update(tools=chat_tools(request.tools), tool_choice=chat_tool_choice(request))
    elif request.tool_choice not in (None, "auto", "none"):
        fields["tool_choice"] = chat_tool_choice(request)  # chat's 400: no tools
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise APIError(message, param=CHAT_PARAMS.get(param, param)) from None


def input_messages(data: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input``: a user message (a string) or items."""
    if isinstance(data, str):
        return [{"role": "user", "content": data}]
    return items_to_messages(data)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from Responses items (input items, or a response's output)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append(_tool_output(item, i))
        elif kind != "reasoning":
            raise APIError(f"input[{i}]: item type {kind!r} is not supported", param="input")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(f"input[{i}]: role {role!r} is not one of {', '.join(ROLES)}", param="input")
    return {"role": role, "content": _content(item.get("content"), f"input[{i}]")}


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(_image(part, where))
        elif kind in MEDIA_PARTS:
            raise APIError(
                f"{where}: {kind} content is not supported (no file or audio inputs yet)",
                param="input",
            )
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise APIError(f"{where}: content part type {kind!r} is not supported", param="input")
    return parts


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part (``image_url``: a URL or data: URL) as chat's part;
    ``file_id`` images are refused (there is no files API)."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise APIError(
            f"{where}: input_image needs an image_url (file_id images are not supported)",
            param="input",
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    """A function_call item as a tool call of the assistant turn it belongs to."""
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise APIError(f"input[{i}]: a function_call needs `name` and `call_id`", param="input")
    if not isinstance(arguments, str):
        raise APIError(f"input[{i}]: function_call arguments must be a JSON string", param="input")
    function = {"name": name, "arguments": arguments}
    call = {"id": call_id, "type": "function", "function": function}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tool_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise APIError(f"input[{i}]: a function_call_output needs `call_id`", param="input")
    output = item.get("output")
    return {"role": "tool", "tool_call_id": call_id, "content": _content(output, f"input[{i}]")}


BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "mcp",
    "image_generation",
    "local_shell",
    "shell",
)


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' function tools (``{type, name, description, parameters, strict}``)
    in chat's nested shape; any other tool type is a 400 naming it."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in BUILT_IN_TOOLS:
            raise APIError(
                f"tools[{i}]: the built-in tool {kind!r} is not supported: jaxengine runs "
                "no hosted tools (function tools only)",
                param="tools",
            )
        if kind != "function":
            raise APIError(f"tools[{i}]: tool type {kind!r} is not supported", param="tools")
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: tool[k] for k in keys if k in tool}})
    return out


def chat_tool_choice(request: ResponsesRequest) -> str | dict[str, Any] | None:
    """``tool_choice``: auto / none / required, or ``{"type": "function", "name"}``."""
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        f"tool_choice {choice!r} is not supported: give auto, none, required or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    fmt = text.format if text is not None else None
    kind = fmt.get("type") if fmt else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        keys = ("name", "description", "schema", "strict")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise APIError(f"text.format type {kind!r} is not supported", param="text")
