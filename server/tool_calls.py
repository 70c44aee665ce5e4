"""Tool calling in chat: which choice a request makes, and the calls forced by a schema.

``tool_choice`` (vLLM's rules):

- ``"none"``: no calls; the tools are still rendered into the prompt unless the
  server runs with ``--exclude-tools-when-tool-choice-none``;
- ``"auto"``: the model may call; the server's tool parser (``--enable-auto-tool-choice
  --tool-call-parser NAME``) finds the calls in the text; without those flags a 400;
- ``"required"`` and ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by structured outputs to a JSON schema built from the tools, so these
  work on any model, with no parser: for a named tool the schema is its arguments
  object, for ``required`` an array (``maxItems`` 1 without ``parallel_tool_calls``) of
  ``{"name", "parameters"}`` objects. The call objects are closed
  (``additionalProperties: false``) and the JSON is compact (no optional
  whitespace): with either left open a small model at temperature 1 can keep
  inventing keys, or writing blank lines, until ``max_tokens``.

Left out, the choice is ``"auto"`` when tools are given and auto tool choice is on,
else ``"none"``. A ``tool_choice`` without ``tools`` is a 400.

`ForcedCalls` reads the calls back from the constrained JSON, whole or as it streams;
each call's arguments are the raw text of its arguments object, so the streamed
fragments join to exactly the final arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from server.errors import APIError

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """What a request asks of tools: mode "none", "auto", "required" or "named"."""

    mode: str
    name: str | None = None
    """The tool of a "named" choice."""

    @property
    def forced(self) -> bool:
        """Whether structured outputs force the calls (required / named)."""
        return self.mode in ("required", "named")


NO_TOOLS = ToolChoice("none")


def tool_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool's ``function`` object, checked (400 ``tools`` for a malformed one)."""
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"tools[{i}]: only function tools are supported", param="tools")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"tools[{i}].function needs a `name`", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(f"tools[{i}].function.parameters must be an object", param="tools")
        functions.append(function)
    return functions


def resolve_tool_choice(request: Any, auto_tool_choice: bool) -> ToolChoice:
    """The request's `ToolChoice`; 400 (``tool_choice``) for one the server cannot honour.

    ``auto_tool_choice``: the server runs a tool parser (--enable-auto-tool-choice with
    --tool-call-parser)."""
    tools, choice = request.tools, request.tool_choice
    if choice is not None and not tools:
        raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if not tools:
        return NO_TOOLS
    names = [f["name"] for f in tool_functions(tools)]
    if choice is None:
        return ToolChoice("auto") if auto_tool_choice else NO_TOOLS
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice {choice!r} is not one of none, auto, required, or a named function",
                param="tool_choice",
            )
        if choice == "auto" and not auto_tool_choice:
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise APIError(f"Tool {name!r} has not been passed in `tools`.", param="tool_choice")
    return ToolChoice("named", name)


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema, closed to the listed properties unless it says
    otherwise (a free-form object, with no ``properties``, stays open)."""
    schema = copy.deepcopy(function.get("parameters") or {})
    if not schema:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def forced_schema(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> dict:
    """The JSON schema that a "required" or "named" choice constrains the output to."""
    functions = tool_functions(tools)
    if choice.mode == "named":
        function = next(f for f in functions if f["name"] == choice.name)
        return arguments_schema(function)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": f["name"]},
                "parameters": arguments_schema(f),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---------------------------------------------------------------------- reading calls


@dataclasses.dataclass
class _Call:
    """One call of the array as far as it has been read."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    id: str | None = None
    args_sent: int = 0


class _ArrayScanner:
    """Incremental reader of ``[{"name": "...", "parameters": {...}}, ...]``.

    It follows the JSON structure character by character (strings and escapes
    included) and records, per call object, the name once its string closes and the
    span of the ``parameters`` value in the text.
    """

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[_Call] = []
        self._stack: list[str] = []
        self._in_string = self._escape = False
        self._string_start = 0
        self._state = ""  # at call level: key, colon, value, in_value, after
        self._key: str | None = None
        self._value_start = 0

    def feed(self, delta: str) -> None:
        base = len(self.text)
        self.text += delta
        for i, c in enumerate(delta, base):
            self._char(i, c)

    def _char(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._string_closed(i)
            return
        at_call = len(self._stack) == 2
        if at_call and self._state == "in_value" and (c.isspace() or c in ",}"):
            self._value_end(i)  # a scalar value ends at a delimiter
        if c.isspace():
            return
        if at_call and self._state == "value":
            self._state, self._value_start = "in_value", i
        if c == '"':
            self._in_string, self._string_start = True, i
        elif c in "[{":
            self._stack.append(c)
            if len(self._stack) == 2 and c == "{":
                self.calls.append(_Call())
                self._state = "key"
        elif c in "]}":
            if self._stack:
                self._stack.pop()
            if len(self._stack) == 2 and self._state == "in_value":
                self._value_end(i + 1)  # a container value closed
        elif at_call and c == ":":
            self._state = "value"
        elif at_call and c == ",":
            self._state = "key"

    def _string_closed(self, i: int) -> None:
        if len(self._stack) != 2:
            return
        if self._state == "key":
            self._key = _loads(self.text[self._string_start : i + 1])
            self._state = "colon"
        elif self._state == "in_value":
            self._value_end(i + 1)

    def _value_end(self, end: int) -> None:
        call = self.calls[-1]
        if self._key == "name":
            name = _loads(self.text[self._value_start : end])
            call.name = name if isinstance(name, str) else None
        elif self._key == "parameters":
            call.args_start, call.args_end = self._value_start, end
        self._state = "after"

    def arguments(self, call: _Call) -> str:
        """The call's arguments text so far (all of it once complete)."""
        if call.args_start is None:
            if self._key == "parameters" and self._state == "in_value" and call is self.calls[-1]:
                return self.text[self._value_start :]
            return ""
        return self.text[call.args_start : call.args_end]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ForcedCalls:
    """The calls of a "required" or "named" output, fed as it streams.

    `feed` returns OpenAI delta tool calls: a call's first entry carries its id, type
    and name, the later ones argument fragments. `calls` gives the final list.
    """

    def __init__(self, choice: ToolChoice, make_id: Callable[[], str]) -> None:
        self.choice = choice
        self._make_id = make_id
        self._scanner = _ArrayScanner()
        self._named = _Call(name=choice.name) if choice.mode == "named" else None
        self._text = ""  # the named call's arguments: the whole output

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if self._named is not None:
            self._text += delta
        else:
            self._scanner.feed(delta)
        return self._deltas(self._calls())

    def _arguments(self, call: _Call) -> str:
        if self._named is not None:
            return self._text
        return self._scanner.arguments(call)

    def _deltas(self, calls: list[_Call]) -> list[dict[str, Any]]:
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                continue  # arguments wait for the name
            args = self._arguments(call)
            fragment = args[call.args_sent :]
            call.args_sent = len(args)
            if call.id is None:
                call.id = self._make_id()
                first = {"name": call.name, "arguments": fragment}
                out.append({"index": index, "id": call.id, "type": "function", "function": first})
            elif fragment:
                out.append({"index": index, "function": {"arguments": fragment}})
        return out

    @property
    def called(self) -> bool:
        return any(c.id is not None for c in self._calls())

    def _calls(self) -> list[_Call]:
        return [self._named] if self._named is not None else self._scanner.calls

    def calls(self) -> list[dict[str, Any]]:
        """OpenAI's ``message.tool_calls`` from everything fed so far."""
        out = []
        for call in self._calls():
            if call.name is None:
                continue
            if call.id is None:
                call.id = self._make_id()
            function = {"name": call.name, "arguments": self._arguments(call)}
            out.append({"id": call.id, "type": "function", "function": function})
        return out
