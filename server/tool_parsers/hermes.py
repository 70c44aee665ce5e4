"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

The format of Hermes 2 Pro / 3 and of Qwen2.5 / Qwen3 (their chat templates). A call
left open at the end of the output (no `</tool_call>`) still counts when its JSON is
complete. "parameters" is accepted for "arguments"; text after the JSON object inside
the tags is ignored.

Pure Python: no jax.
"""

from __future__ import annotations

import re
from typing import Any

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.base import (
    ToolParser,
    call_from_object,
    content_only,
    extract_tagged,
    register_tool_parser,
)
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.json_stream import (
    JsonFollower,
    first_json_value,
)
from server.tool_parsers.stream import ToolCallStream

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


class MarkedJsonStream(ToolCallStream):
    """Calls as JSON objects between a start and an end marker (the end may be missing
    at the end of the output)."""

    start, end = START, END

    def __init__(self, make_id: Any) -> None:
        super().__init__(make_id)
        self._body: str | None = None  # the open call's text; None outside a call
        self._follower = JsonFollower()

    def _step(self, final: bool) -> None:
        while True:
            if self._body is None:
                if self._take_content_until((self.start,), final) is None:
                    return
                self._body, self._follower = "", JsonFollower()
            pos = self._buf.find(self.end)
            if pos < 0 and not final:
                cut = len(self._buf) - partial_marker_len(self._buf, (self.end,))
                self._grow(self._buf[:cut])
                self._buf = self._buf[cut:]
                return
            closed = pos >= 0
            self._grow(self._buf[:pos] if closed else self._buf)
            self._buf = self._buf[pos + len(self.end) :] if closed else ""
            self._close(closed)
            if not closed:
                return

    def _grow(self, chunk: str) -> None:
        assert self._body is not None
        self._body += chunk
        follower = self._follower
        follower.feed(chunk)
        self._follow_json_call(follower)

    def _close(self, closed: bool) -> None:
        assert self._body is not None
        call = call_from_object(first_json_value(self._body), self._make_id)
        if call is not None:
            if not self._in_call:
                self._begin_call(call.name)
            self._end_call(call.arguments)
        elif not self._in_call:
            self._content(self.start + self._body + (self.end if closed else ""))
        self._in_call = False
        self._body = None


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Hermes / Qwen JSON calls in `<tool_call>` tags."""

    markers = (START, END)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        if START not in model_output:
            return content_only(model_output)

        def calls_in(body: str) -> list[ToolCall]:
            call = call_from_object(first_json_value(body), self.make_id)
            return [] if call is None else [call]

        return extract_tagged(model_output, _CALL, calls_in)

    def stream(self, request: Any = None) -> MarkedJsonStream:
        return MarkedJsonStream(self.make_id)
