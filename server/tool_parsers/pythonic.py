"""`pythonic`: a Python list of calls, `[get_weather(city="Paris"), f2(x=1)]`.

The format of Llama 3.2 / 4 with the pythonic templates (optionally inside
`<|python_start|>` ... `<|python_end|>`); `llama4_pythonic` is vLLM's name for it
with Llama 4 (the same parser). The list must start the output (after
whitespace); text after it is content. Arguments are keyword arguments whose values
are Python literals (`ast.literal_eval`: strings, numbers, True/False/None, lists,
tuples, dicts); anything else makes the output plain content. Nothing is executed.

One scanner (`ListScanner`) finds the calls for both `extract_tool_calls` and the
stream, so the two agree by construction.

Pure Python: no jax.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from server.tool_parsers.base import (
    ToolParser,
    build_extracted,
    content_only,
    register_tool_parser,
)
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.stream import ToolCallStream

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_OPEN = re.compile(r"\s*(?:<\|python_start\|>)?\s*\[")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _json_value(value: Any) -> Any:
    """A literal as JSON data (tuples become lists); TypeError when it has no JSON form."""
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"{type(value).__name__} has no JSON form")


def call_arguments(call_text: str) -> str | None:
    """The arguments JSON of `name(k=v, ...)`, None unless it is such a call."""
    try:
        node = ast.parse(call_text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _json_value(ast.literal_eval(kw.value))
        return json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class ListScanner:
    """Incremental scanner over the list after its `[`; `feed_char` returns an event:
    ("name", name) at a call's `(`, ("call", text) at its `)`, ("end", "") at the `]`,
    ("bad", "") when the text is not a list of calls, else None."""

    def __init__(self) -> None:
        self.depth = 1  # brackets open, the list's included
        self.quote = ""  # the open string's quote character
        self.escape = False
        self.element = ""  # text since the list opened or the last comma
        self.call = ""  # the call being read
        self.after_call = False

    def feed_char(self, c: str) -> tuple[str, str] | None:
        if self.depth >= 2:
            return self._in_call(c)
        if c == "(":
            name = self.element.strip()
            if self.after_call or not _NAME.fullmatch(name):
                return ("bad", "")
            self.depth, self.call, self.element = 2, name + "(", ""
            return ("name", name)
        if c == "," and self.after_call:
            self.after_call, self.element = False, ""
        elif c == "]" and not self.element.strip():
            self.depth = 0
            return ("end", "")
        elif c.isspace() or (not self.after_call and (c.isalnum() or c == "_")):
            self.element += c
        else:
            return ("bad", "")
        return None

    def _in_call(self, c: str) -> tuple[str, str] | None:
        self.call += c
        if self.quote:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == self.quote:
                self.quote = ""
        elif c in "'\"":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}":
            self.depth -= 1
            if self.depth == 1:
                if c != ")":
                    return ("bad", "")
                self.after_call = True
                return ("call", self.call)
        return None


def _could_open(text: str) -> bool:
    """Whether more text may still make `text` match `_OPEN`."""
    head = text.lstrip()
    if head.startswith(PY_START):
        head = head[len(PY_START) :].lstrip()
    return not head or PY_START.startswith(head)


class PythonicStream(ToolCallStream):
    """Modes, each a method: probe (before the `[`), list, after (the text after the
    list, up to `<|python_end|>`), rest (content)."""

    def __init__(self, make_id: Any) -> None:
        super().__init__(make_id)
        self._mode = "probe"
        self._raw = ""  # the list's text so far, content if it holds no call
        self._scanner = ListScanner()
        self._name = ""

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _probe(self, final: bool) -> bool:
        m = _OPEN.match(self._buf)
        if m is None and not final and _could_open(self._buf):
            return False
        if m is not None:
            self._raw, self._buf = self._buf[: m.end()], self._buf[m.end() :]
        self._mode = "list" if m is not None else "rest"
        return True

    def _list(self, final: bool) -> bool:
        if self.tool_calls_sent:
            self._raw = ""  # no longer needed: the list cannot become content
        for i, c in enumerate(self._buf):
            event = self._scanner.feed_char(c)
            if event is None:
                continue
            kind, value = event
            if kind == "name":
                self._name = value
            elif kind == "call" and (args := call_arguments(value)) is not None:
                self._begin_call(self._name)  # a call goes out whole, once it parses
                self._end_call(args)
            elif kind != "name":  # "end", "bad" or a call that does not parse
                end = i + 1 if kind == "end" else i
                self._raw, self._buf = self._raw + self._buf[:end], self._buf[end:]
                return self._leave(after=kind == "end")
        self._raw, self._buf = self._raw + self._buf, ""
        return self._leave(after=False) if final else False

    def _leave(self, after: bool) -> bool:
        if not self.tool_calls_sent:
            self._content(self._raw)
        self._mode = "after" if after and self.tool_calls_sent else "rest"
        return True

    def _after(self, final: bool) -> bool:
        if self._take_content_until((PY_END,), final) is None:
            return False
        self._mode = "rest"
        return True

    def _rest(self, final: bool) -> bool:
        self._content(self._buf)
        self._buf = ""
        return False


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Python-list tool calls (Llama 3.2 / 4 pythonic templates)."""

    markers = (PY_START, PY_END)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        m = _OPEN.match(model_output)
        if m is None:
            return content_only(model_output)
        scanner, pieces, name = ListScanner(), [], ""
        for pos in range(m.end(), len(model_output)):
            event = scanner.feed_char(model_output[pos])
            if event is None:
                continue
            kind, value = event
            if kind == "name":
                name = value
            elif kind == "call" and (args := call_arguments(value)) is not None:
                pieces.append(ToolCall(name, args, self.make_id()))
            elif kind == "end" and pieces:
                pieces.append(model_output[pos + 1 :].replace(PY_END, "", 1))
                return build_extracted(pieces)
            else:
                break
        return content_only(model_output)

    def stream(self, request: Any = None) -> PythonicStream:
        return PythonicStream(self.make_id)


@register_tool_parser("llama4_pythonic")
class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's ``--tool-call-parser llama4_pythonic``: Llama 4's pythonic calls, which
    its template wraps in `<|python_start|>` ... `<|python_end|>` (special tokens, kept
    in the text by `adjust_request`); the parsing is `pythonic`'s."""
