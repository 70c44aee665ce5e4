"""`qwen3_xml`: Qwen3-Coder's XML-ish calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value loses one leading and one trailing newline (the template writes them). It is
JSON-decoded when it parses (`42`, `true`, `[1, 2]`, `{"a": 1}`), else kept as a
string -- unless the request's tool schema declares the parameter a string, then it
stays a string as written. A missing `</parameter>` ends at the next `<parameter=` or
`</function>`; a missing `</function>` or `</tool_call>` at the end of the call or the
output. A `<tool_call>` block without a `<function=...>` stays content.

The arguments stream one parameter at a time: `{`, then `"key": value` pieces joined
by ", ", then `}` -- exactly `json.dumps` of the object. A value the schema declares a
string streams as it is written (the code of a file-writing tool); other values go
out whole once their end marker arrives.

Pure Python: no jax.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.base import (
    ToolParser,
    content_only,
    extract_tagged,
    register_tool_parser,
)
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.stream import ToolCallStream

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_FUNCTION_MARKS = (PARAM, FUNC_END, END)
_VALUE_ENDS = (PARAM_END, PARAM, FUNC_END, END)
_LONGEST_END = max(map(len, _VALUE_ENDS))
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FUNC = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|\Z)", re.S)
_PARAM = re.compile(
    r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.S
)


def string_params(request: Any, function: str) -> set[str]:
    """Parameters that `function`'s schema in `request.tools` declares as strings."""
    out: set[str] = set()
    for tool in getattr(request, "tools", None) or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or fn.get("name") != function:
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        for key, schema in props.items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if kind == "string" or (isinstance(kind, list) and set(kind) <= {"string", "null"}):
                out.add(key)
    return out


def param_value(raw: str, as_string: bool) -> Any:
    """A parameter's value from its text (see the module docstring)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if as_string:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def param_piece(key: str, raw: str, strings: set[str], first: bool) -> str:
    """One parameter's part of the arguments text: `"key": value`, ", " before it."""
    value = json.dumps(param_value(raw, key in strings), ensure_ascii=False)
    return ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value


def calls_in_block(body: str, request: Any, make_id: Any) -> list[ToolCall]:
    """The calls of one `<tool_call>` block's text."""
    calls = []
    for func in _FUNC.finditer(body):
        name = func.group(1).strip()
        if not name:
            continue
        strings = string_params(request, name)
        params = [(m.group(1).strip(), m.group(2)) for m in _PARAM.finditer(func.group(2))]
        args = "".join(param_piece(k, v, strings, i == 0) for i, (k, v) in enumerate(params))
        calls.append(ToolCall(name, "{" + args + "}", make_id()))
    return calls


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(position, marker) of the earliest marker in `text[start:]`; (-1, "") if none."""
    hits = [(text.find(m, start), m) for m in markers]
    hits = [(pos, m) for pos, m in hits if pos >= 0]
    return min(hits) if hits else (-1, "")


class Qwen3XmlStream(ToolCallStream):
    """Modes, each a method: text (content), block (inside `<tool_call>`, between
    functions), function (between parameters), param (a value being read)."""

    def __init__(self, make_id: Any, request: Any) -> None:
        super().__init__(make_id)
        self._request = request
        self._mode = "text"
        self._raw = ""  # the block's text while it has no function: content if none comes
        self._funcs = 0  # functions seen in the current block
        self._live = False  # the current function is a call (it has a name)
        self._first_param = True
        self._key = ""
        self._strings: set[str] = set()
        self._scan = 0  # where the value's end marker search resumes
        self._piece_sent = ""  # the part of the parameter's piece already sent
        self._value_sent = 0  # characters of a string value already sent

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _consume(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        if not self._funcs:
            self._raw += text
        return text

    def _text(self, final: bool) -> bool:
        if self._take_content_until((START,), final) is None:
            return False
        self._mode, self._raw, self._funcs = "block", START, 0
        return True

    def _block(self, final: bool) -> bool:
        pos, marker = _first(self._buf, (FUNC, END))
        gt = self._buf.find(">", pos + len(FUNC)) if marker == FUNC else -1
        if marker == FUNC and gt >= 0:
            return self._open_function(pos, gt)
        if marker == END or final:
            self._consume(pos + len(END) if marker == END else len(self._buf))
            self._close_block()
            return marker == END
        keep = len(self._buf) - pos if marker else partial_marker_len(self._buf, (FUNC, END))
        self._consume(len(self._buf) - keep)  # text outside functions is ignored
        return False

    def _open_function(self, pos: int, gt: int) -> bool:
        name = self._buf[pos + len(FUNC) : gt].strip()
        self._consume(gt + 1)
        self._live, self._first_param, self._mode = bool(name), True, "function"
        if name:
            self._funcs += 1
            self._begin_call(name)
            self._send_args("{")
            self._strings = string_params(self._request, name)
        return True

    def _close_block(self) -> None:
        if not self._funcs:  # no call in the block: it stays content as written
            self._content(self._raw)
        self._mode = "text"

    def _function(self, final: bool) -> bool:
        pos, marker = _first(self._buf, _FUNCTION_MARKS)
        gt = self._buf.find(">", pos + len(PARAM)) if marker == PARAM else -1
        if marker == PARAM and gt >= 0:
            self._key = self._buf[pos + len(PARAM) : gt].strip()
            self._consume(gt + 1)
            self._mode = "param"
            return True
        if marker in (FUNC_END, END) or final:
            # </function> is consumed; </tool_call> is left for the block to close
            self._consume(
                pos + len(FUNC_END) if marker == FUNC_END else pos if marker else len(self._buf)
            )
            if self._live:
                self._send_args("}")
                self._in_call = False
            self._mode = "block"
            return bool(marker)
        keep = len(self._buf) - pos if marker else partial_marker_len(self._buf, _FUNCTION_MARKS)
        self._consume(len(self._buf) - keep)  # text between parameters is ignored
        return False

    def _param(self, final: bool) -> bool:
        pos, marker = _first(self._buf, _VALUE_ENDS, self._scan)
        if not marker and not final:
            self._scan = max(0, len(self._buf) - _LONGEST_END + 1)  # the next search
            if self._live and self._key in self._strings:
                self._stream_string()
            return False
        raw = self._consume(pos if marker else len(self._buf))
        if marker == PARAM_END:
            self._consume(len(PARAM_END))
        if self._live:
            piece = param_piece(self._key, raw, self._strings, self._first_param)
            self._send_args(piece[len(self._piece_sent) :])
        self._first_param, self._mode = False, "function"
        self._scan, self._piece_sent, self._value_sent = 0, "", 0
        return True

    def _stream_string(self) -> None:
        """Sends the settled part of a string value still being written: all of it but
        a possible partial end marker, the leading newline and a last newline (both
        dropped if the value ends there)."""
        text = self._buf[: len(self._buf) - partial_marker_len(self._buf, _VALUE_ENDS)]
        if not text:
            return
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        if not self._piece_sent:
            comma = "" if self._first_param else ", "
            self._piece_sent = comma + json.dumps(self._key, ensure_ascii=False) + ': "'
            self._send_args(self._piece_sent)
        if len(text) > self._value_sent:
            more = json.dumps(text[self._value_sent :], ensure_ascii=False)[1:-1]
            self._value_sent = len(text)
            self._piece_sent += more
            self._send_args(more)


@register_tool_parser("qwen3_xml")
class Qwen3XmlToolParser(ToolParser):
    """Qwen3-Coder `<function=...>` calls."""

    markers = (START, END)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        if START not in model_output:
            return content_only(model_output)
        return extract_tagged(
            model_output, _CALL, lambda body: calls_in_block(body, request, self.make_id)
        )

    def stream(self, request: Any = None) -> Qwen3XmlStream:
        return Qwen3XmlStream(self.make_id, request)
