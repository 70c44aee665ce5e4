"""A decision's ``input`` as chat messages, and each question as the user turn that
asks it (the prompt whose next token is read).

Input items (`input_messages`):

- a string: one user message;
- messages (``"type": "message"`` or none): user content is text, ``input_json``
  (rendered as JSON text) and ``input_image`` parts; developer and system content is
  text (a developer message is a system message); assistant content is
  ``output_text`` and ``refusal`` parts. Prompt-cache breakpoints on parts are accepted
  and have no effect (the prefix cache is automatic and changes no result);
- ``function_call`` / ``custom_tool_call`` items: the ``tool_calls`` of an assistant
  message (a custom call's ``input`` as its arguments), joining an assistant turn right
  before them; ``function_call_output`` / ``custom_tool_call_output`` items: tool
  messages, each for a call given earlier (by ``call_id``; else a 400). Images in tool
  outputs are a 400.

`question_messages` appends the question to the conversation: into its last message
when that is a user message (so templates that need alternating roles render it),
else as a new user message. The question reads (`question_parts`)::

    <instructions>                         (a predicate: "Statement: <instructions>")

    Answer with exactly one of these options, and nothing else:
    <label>[: <description>]
    ...

with the predicate's and the score's own lead-in. The model's answer starts right
after the template's generation prompt, so each label's first token there is read.
"""

from __future__ import annotations

from typing import Any

from server.decisions.protocol import Question, content_part
from server.errors import APIError

ROLE_PARTS = {
    "user": ("input_text", "input_image", "input_json"),
    "developer": ("input_text",),
    "system": ("input_text",),
    "assistant": ("output_text", "refusal"),
}
"""The content part types each input role may carry."""
CALLS = {"function_call": "arguments", "custom_tool_call": "input"}
"""Tool-call item types -> the field that becomes the call's arguments."""
OUTPUTS = ("function_call_output", "custom_tool_call_output")
LEAD_IN = {
    "predicate": "Is this statement true of the input above? Answer with exactly one of "
    "these options, and nothing else:",
    "choice": "Answer with exactly one of these options, and nothing else:",
    "score": "Rate the input on this scale, from lowest to highest. Answer with exactly "
    "one of these levels, and nothing else:",
}


def input_messages(raw: str | list[Any], images_ok: bool) -> list[dict[str, Any]]:
    """The chat messages of ``input``; 400 (APIError) naming the first bad field."""
    if isinstance(raw, str):
        if not raw.strip():
            raise APIError("input must not be empty", param="input")
        return [{"role": "user", "content": raw}]
    if not raw:
        raise APIError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where, images_ok))
        elif kind in CALLS:
            _add_call(messages, calls, item, where)
        elif kind in OUTPUTS:
            messages.append(_tool_output(item, calls, where))
        else:
            raise APIError(f"{where}: item type {kind!r} is not supported", param=f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str, images_ok: bool) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLE_PARTS:
        raise APIError(
            f"{where}.role {role!r} is not one of {', '.join(ROLE_PARTS)}", param=f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ROLE_PARTS[role]:
                raise APIError(
                    f"{where}.content[{j}]: a {role} message takes no {kind!r} part "
                    f"({', '.join(ROLE_PARTS[role])} only)",
                    param=f"{where}.content[{j}]",
                )
            parts.append(content_part(part, f"{where}.content[{j}]", images_ok))
    else:
        raise APIError(
            f"{where}.content must be a string or a list of parts", param=f"{where}.content"
        )
    chat_role = "system" if role == "developer" else role
    return {"role": chat_role, "content": _collapse(parts)}


def _add_call(messages: list[dict[str, Any]], calls: set[str], item: dict, where: str) -> None:
    """A tool call item as a tool call of the assistant turn it belongs to."""
    field = CALLS[item["type"]]
    name, call_id, arguments = item.get("name"), item.get("call_id"), item.get(field)
    for key, value in (("name", name), ("call_id", call_id), (field, arguments)):
        if not isinstance(value, str):
            raise APIError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    if call_id in calls:
        raise APIError(f"{where}.call_id {call_id!r} is used twice", param=f"{where}.call_id")
    calls.add(call_id)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tool_output(item: dict[str, Any], calls: set[str], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if call_id not in calls:
        raise APIError(
            f"{where}.call_id {call_id!r} matches no earlier tool call in input",
            param=f"{where}.call_id",
        )
    output = item.get("output")
    if isinstance(output, str):
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    if not isinstance(output, list):
        raise APIError(
            f"{where}.output must be a string or a list of parts", param=f"{where}.output"
        )
    parts = []
    for j, part in enumerate(output):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "input_text":
            raise APIError(
                f"{where}.output[{j}]: a tool output takes input_text parts only "
                f"(images in tool outputs are not supported), not {kind!r}",
                param=f"{where}.output[{j}]",
            )
        parts.append(content_part(part, f"{where}.output[{j}]", False))
    return {"role": "tool", "tool_call_id": call_id, "content": _collapse(parts)}


def question_parts(question: Question) -> list[dict[str, Any]]:
    """The content parts that ask ``question`` (see the module docstring)."""
    parts: list[dict[str, Any]] = []
    if question.type == "predicate":
        parts.append(_text("Statement: "))
    for j, part in enumerate(question.instructions):
        if j:
            parts.append(_text("\n"))
        parts.append(part)
    options = (
        label if not description else f"{label}: {description}"
        for label, description in zip(question.labels, question.descriptions, strict=True)
    )
    parts.append(_text(f"\n\n{LEAD_IN[question.type]}\n" + "\n".join(options)))
    return parts


def question_messages(
    conversation: list[dict[str, Any]], question: Question
) -> list[dict[str, Any]]:
    """``conversation`` with ``question`` asked in its last user turn (see above)."""
    messages = [dict(m) for m in conversation]
    asked = question_parts(question)
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "user":
        before = last["content"]
        before = [_text(before)] if isinstance(before, str) else list(before)
        messages[-1] = {**last, "content": _collapse([*before, _text("\n\n"), *asked])}
    else:
        messages.append({"role": "user", "content": _collapse(asked)})
    return messages


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _collapse(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Adjacent text parts joined; a single string when no image is left between."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = _text(out[-1]["text"] + part["text"])
        else:
            out.append(part)
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out
