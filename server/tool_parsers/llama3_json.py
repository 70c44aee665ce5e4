"""`llama3_json`: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}`.

The calls start the output (after whitespace), or follow `<|python_tag|>` (text
before the tag is content). Several calls are separated by `;`. "arguments" is
accepted for "parameters". Parsing stops at the first object that is not a call:
from there on the text is content (so `{"answer": 42}` alone is content).

Pure Python: no jax.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import (
    ToolParser,
    build_extracted,
    call_from_object,
    register_tool_parser,
)
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.json_stream import JsonFollower
from server.tool_parsers.stream import ToolCallStream

TAG = "<|python_tag|>"
_SEP = re.compile(r"[\s;]*")


def _split(text: str) -> tuple[str, str] | None:
    """(content before the calls, the calls' text), None when there are no calls."""
    if text.lstrip().startswith("{"):
        return "", text
    pos = text.find(TAG)
    return None if pos < 0 else (text[:pos], text[pos + len(TAG) :])


class Llama3JsonStream(ToolCallStream):
    """Modes, each a method: probe (the first characters), content_mode (before the
    tag), between (separators), object (a call being read), tail (content after)."""

    def __init__(self, make_id: Any) -> None:
        super().__init__(make_id)
        self._mode = "probe"
        self._follower = JsonFollower()

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _probe(self, final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith("{"):
            self._mode = "between"
        elif (not head or TAG.startswith(head)) and not final:
            return False
        else:
            self._mode = "content_mode"
        return True

    def _content_mode(self, final: bool) -> bool:
        if self._take_content_until((TAG,), final) is None:
            return False
        self._mode = "between"
        return True

    def _tail(self, final: bool) -> bool:
        self._content(self._buf)
        self._buf = ""
        return False

    def _between(self, final: bool) -> bool:
        sep = _SEP.match(self._buf).group(0)
        self._content(sep.replace(";", ""))
        self._buf = self._buf[len(sep) :]
        if not self._buf:
            return False
        if self._buf[0] == "{":
            self._mode, self._follower = "object", JsonFollower()
        else:
            self._mode = "tail"
        return True

    def _object(self, final: bool) -> bool:
        follower = self._follower
        self._buf = follower.feed(self._buf)
        self._follow_json_call(follower)
        if follower.scanner.end is None and not follower.scanner.bad and not final:
            return False
        call = call_from_object(follower.value(), self._make_id)
        if call is not None:
            if not self._in_call:
                self._begin_call(call.name)
            self._end_call(call.arguments)
            self._mode = "between"
        else:
            if not self._in_call:
                self._content(follower.scanner.text)
            self._in_call, self._mode = False, "tail"
        return True


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls."""

    markers = (TAG,)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        split = _split(model_output)
        if split is None:
            return ExtractedToolCalls(False, [], model_output or None)
        head, body = split
        pieces: list[str | ToolCall] = [head]
        decoder = json.JSONDecoder(strict=False)
        pos = 0
        while True:
            sep = _SEP.match(body, pos).group(0)
            pieces.append(sep.replace(";", ""))
            pos += len(sep)
            if not body.startswith("{", pos):
                break
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                break
            call = call_from_object(obj, self.make_id)
            if call is None:
                break
            pieces.append(call)
            pos = end
        pieces.append(body[pos:])
        return build_extracted(pieces)

    def stream(self, request: Any = None) -> Llama3JsonStream:
        return Llama3JsonStream(self.make_id)
