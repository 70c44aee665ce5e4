"""`glm45`: GLM-4.5 / GLM-4.6 tool calls (vLLM's ``--tool-call-parser glm45``).

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>[1, 2]</arg_value>
    </tool_call>

Rules, shared by `extract_tool_calls` and the stream:

* A block runs from ``<tool_call>`` to ``</tool_call>`` (or the end of the output).
* Its name is the block's text, leading whitespace skipped, up to the first newline
  or ``<``, stripped. A name that is empty or holds whitespace makes the block no call:
  it stays content as written.
* Each argument is ``<arg_key>KEY</arg_key>`` (a key without ``<``), optional
  whitespace, ``<arg_value>`` and the value up to ``</arg_value>``, the next
  ``<arg_key>`` or the end of the block. Other text in the block is ignored.
* A value stays a string as written when the request's tool schema declares the
  parameter a string (GLM's template writes strings raw); otherwise it is
  JSON-decoded when it parses (``42``, ``true``, ``[1, 2]``) and kept as a string when
  it does not.

The arguments stream one parameter at a time: ``{``, then each ``"key": value`` once
its value has ended (joined by ", "), then ``}``: exactly `json.dumps` of the object.

Pure Python: no jax.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.base import ToolParser, content_only, extract_tagged, register_tool_parser
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.qwen3_xml import string_params
from server.tool_parsers.stream import ToolCallStream

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_VALUE_ENDS = (VALUE_END, KEY, END)
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_NAME = re.compile(r"[^\n<]*")
_ARG = re.compile(
    r"<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|(?=<arg_key>)|\Z)", re.S
)


def valid_name(text: str) -> str | None:
    """The call's name from the text before its first newline or ``<``, or None."""
    name = text.strip()
    return name if name and not any(c.isspace() for c in name) else None


def arg_piece(key: str, raw: str, strings: set[str], first: bool) -> str:
    """One argument's part of the arguments text: ``"key": value``, ", " before it."""
    value: Any = raw
    if key not in strings:
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
    piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
    return piece if first else ", " + piece


def call_in_block(body: str, request: Any, make_id: Any) -> list[ToolCall]:
    """The call of one block's text (after ``<tool_call>``), or [] when it is none."""
    head = body.lstrip()
    written = _NAME.match(head)
    name = valid_name(written.group(0))
    if name is None:
        return []
    rest = head[written.end() :]
    strings = string_params(request, name)
    args = [(m.group(1).strip(), m.group(2)) for m in _ARG.finditer(rest)]
    text = "".join(arg_piece(k, v, strings, i == 0) for i, (k, v) in enumerate(args))
    return [ToolCall(name, "{" + text + "}", make_id())]


class Glm45Stream(ToolCallStream):
    """Modes, each a method: text (content), name (after ``<tool_call>``), junk (a
    block that is no call), args (between arguments), value (a value being read)."""

    def __init__(self, make_id: Any, request: Any) -> None:
        super().__init__(make_id)
        self._request = request
        self._mode = "text"
        self._raw = ""  # the block as written, while it may still turn out no call
        self._strings: set[str] = set()
        self._key = ""
        self._first_arg = True

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _text(self, final: bool) -> bool:
        if self._take_content_until((START,), final) is None:
            return False
        self._mode, self._raw = "name", START
        return True

    def _name(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(stripped)]
        self._buf = stripped
        ends = [p for p in (self._buf.find("\n"), self._buf.find("<")) if p >= 0]
        if not ends and not final:
            return False
        pos = min(ends) if ends else len(self._buf)
        name = valid_name(self._buf[:pos])
        self._raw += self._buf[:pos]
        self._buf = self._buf[pos:]
        if name is None:
            self._mode = "junk"
            return True
        self._begin_call(name)
        self._send_args("{")
        self._strings = string_params(self._request, name)
        self._first_arg, self._mode = True, "args"
        return True

    def _junk(self, final: bool) -> bool:
        pos = self._buf.find(END)
        if pos < 0 and not final:
            keep = partial_marker_len(self._buf, (END,))
            self._raw += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        cut = len(self._buf) if pos < 0 else pos + len(END)
        self._content(self._raw + self._buf[:cut])
        self._buf, self._raw, self._mode = self._buf[cut:], "", "text"
        return pos >= 0

    def _args(self, final: bool) -> bool:
        hits = [(self._buf.find(m), m) for m in (KEY, END)]
        hits = [(p, m) for p, m in hits if p >= 0]
        if not hits:
            keep = 0 if final else partial_marker_len(self._buf, (KEY, END))
            self._buf = self._buf[len(self._buf) - keep :]  # text between arguments
            if final:
                self._close_call()
            return False
        pos, marker = min(hits)
        self._buf = self._buf[pos:]
        if marker == END:
            self._buf = self._buf[len(END) :]
            self._close_call()
            return True
        return self._open_value(final)

    def _open_value(self, final: bool) -> bool:
        """At ``<arg_key>``: reads the key and ``<arg_value>`` when both are there;
        skips the marker when they cannot come; waits otherwise."""
        after = self._buf[len(KEY) :]
        lt = after.find("<")
        if lt >= 0 and after.startswith(KEY_END, lt):
            value = after[lt + len(KEY_END) :].lstrip()
            if value.startswith(VALUE):
                self._key, self._mode = after[:lt].strip(), "value"
                self._buf = value[len(VALUE) :]
                return True
            if not final and VALUE.startswith(value):
                return False  # whitespace, or a partial <arg_value>, so far
        elif not final and (lt < 0 or KEY_END.startswith(after[lt:])):
            return False  # the key, or its end marker, is still being written
        self._buf = after  # no argument starts at this <arg_key>
        return True

    def _value(self, final: bool) -> bool:
        hits = [(self._buf.find(m), m) for m in _VALUE_ENDS]
        hits = [(p, m) for p, m in hits if p >= 0]
        if not hits and not final:
            return False
        pos, marker = min(hits) if hits else (len(self._buf), "")
        piece = arg_piece(self._key, self._buf[:pos], self._strings, self._first_arg)
        self._send_args(piece)
        self._buf = self._buf[pos + len(VALUE_END) if marker == VALUE_END else pos :]
        self._first_arg, self._mode = False, "args"
        return True

    def _close_call(self) -> None:
        self._send_args("}")
        self._in_call, self._mode = False, "text"


@register_tool_parser("glm45")
class Glm45ToolParser(ToolParser):
    """GLM-4.5 / 4.6 ``<tool_call>`` calls with ``<arg_key>``/``<arg_value>`` pairs."""

    markers = (START, END, KEY, KEY_END, VALUE, VALUE_END)  # any special: keep them all

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        if START not in model_output:
            return content_only(model_output)
        return extract_tagged(
            model_output, _CALL, lambda body: call_in_block(body, request, self.make_id)
        )

    def stream(self, request: Any = None) -> Glm45Stream:
        return Glm45Stream(self.make_id, request)
