"""Tool-call parser interface: turns what a chat model wrote into OpenAI `tool_calls`.

`ToolParser.extract_tool_calls(text)` parses a whole output; `ToolParser.stream()` gives
a per-choice `ToolCallStream` whose `feed(delta)` returns a `DeltaMessage` (content and
tool-call fragments in OpenAI's delta shape). Invariants every parser keeps for a
well-formed output, whatever the split into deltas:

* concatenated content deltas == `extract_tool_calls(...).content` (None as "");
* per call index: one first fragment with `id` and `name`, then argument fragments
  whose concatenation is the call's final `arguments` JSON text (json.dumps of the
  object, `ensure_ascii=False`), the same text `extract_tool_calls` gives.

Content rules shared by all parsers: text outside the calls is content; when a call was
found, a stretch of content that is only whitespace (the newlines between and after the
calls) is dropped. A malformed call stays in the content as written; the stream can do
that only while it has sent nothing for the call.

Pure Python: no jax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from jaxengine.reasoning.registry import ParserRegistry
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall, make_tool_call_id
from server.tool_parsers.stream import ToolCallStream

REGISTRY: ParserRegistry = ParserRegistry("tool parser", "--tool-parser-plugin")
register_tool_parser = REGISTRY.register
"""Class decorator: `@register_tool_parser("name")`."""


def arguments_json(value: Any) -> str | None:
    """The `arguments` text of a parsed call: json.dumps of its object.

    A missing value is `{}`; a string holding a JSON object is decoded first (some
    models quote their arguments). None when the value is not an object.
    """
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, make_id: Any = make_tool_call_id) -> ToolCall | None:
    """A `ToolCall` from `{"name": ..., "arguments"|"parameters": {...}}`, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = arguments_json(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
    if not isinstance(name, str) or not name or args is None:
        return None
    return ToolCall(name, args, make_id())


def build_extracted(pieces: list[str | ToolCall]) -> ExtractedToolCalls:
    """Content pieces and calls in output order -> `ExtractedToolCalls` (content rules
    in the module docstring: adjacent text merges; whitespace-only stretches go when a
    call was found)."""
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    segments, current = [], []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            segments.append("".join(current))
            current = []
        else:
            current.append(piece)
    segments.append("".join(current))
    if calls:
        segments = [s for s in segments if s.strip()]
    return ExtractedToolCalls(bool(calls), calls, "".join(segments) or None)


def extract_tagged(
    text: str, pattern: re.Pattern, calls_in: Callable[[str], list[ToolCall]]
) -> ExtractedToolCalls:
    """Calls written in tagged blocks (`pattern`'s group 1 is a block's body): each
    block's calls (`calls_in(body)`), or the block kept as content when it has none."""
    pieces: list[str | ToolCall] = []
    pos = 0
    for m in pattern.finditer(text):
        pieces.append(text[pos : m.start()])
        calls = calls_in(m.group(1))
        pieces.extend(calls if calls else [m.group(0)])
        pos = m.end()
    pieces.append(text[pos:])
    return build_extracted(pieces)


def content_only(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(False, [], text or None)


def _special_tokens(tokenizer: Any) -> set[str]:
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            special.add(str(getattr(token, "content", token)))
    return special


class ToolParser:
    """Base class; subclasses are registered with `@register_tool_parser(name)`.

    `markers` are the format's marker strings. When the tokenizer has any of them as a
    special token (or there is no tokenizer to ask), `adjust_request` turns off
    `skip_special_tokens` for requests with tools, or the markers would never reach
    the text. `make_id` makes the call ids.
    """

    markers: tuple[str, ...] = ()
    make_id: Callable[[], str] = staticmethod(make_tool_call_id)

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def markers_are_special(self) -> bool:
        if not self.markers:
            return False
        if self.tokenizer is None:
            return True
        special = _special_tokens(self.tokenizer)
        return any(m in special for m in self.markers)

    def adjust_request(self, request: Any) -> Any:
        """Returns the request, with `skip_special_tokens = False` where needed."""
        tools = getattr(request, "tools", None)
        if (
            tools
            and getattr(request, "tool_choice", None) != "none"
            and hasattr(request, "skip_special_tokens")
            and self.markers_are_special()
        ):
            request.skip_special_tokens = False
        return request

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        """The calls and the content of a whole output; malformed calls stay content."""
        raise NotImplementedError

    def stream(self, request: Any = None) -> ToolCallStream:
        """A fresh streaming state for one choice."""
        raise NotImplementedError
