"""`mistral`: `[TOOL_CALLS]` then the calls, in either of Mistral's two formats:

* a JSON array `[{"name": ..., "arguments": {...}}, ...]` (or one object), the format
  of the v3 tokenizers (Mistral 7B v0.3, Nemo, Small 24B);
* `name[ARGS]{...}`, one call per `[TOOL_CALLS]`, the format of the v11+ tokenizers
  (Mistral Small 3.2, Magistral, Devstral).

Text before the first marker and after each call is content. Call ids are 9
alphanumeric characters: Mistral's chat templates reject any other id when the calls
come back in the conversation.

Pure Python: no jax.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.base import (
    ToolParser,
    arguments_json,
    build_extracted,
    call_from_object,
    content_only,
    register_tool_parser,
)
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.json_stream import JsonFollower, arguments_value
from server.tool_parsers.stream import ToolCallStream

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]\s*")
_NAME_SO_FAR = re.compile(r"\s*[\w.\-]*\s*")
_LEAD = re.compile(r"\s*")
_ALNUM = string.ascii_letters + string.digits


def make_mistral_id() -> str:
    """A 9-character alphanumeric call id (what Mistral's templates require)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _segment(seg: str, make_id: Any) -> list[str | ToolCall]:
    """The pieces of the text after one `[TOOL_CALLS]` (itself included if malformed)."""
    decoder = json.JSONDecoder(strict=False)
    start = _LEAD.match(seg).end()
    named = None if seg.startswith(("[", "{"), start) else _NAMED.match(seg)
    if named is not None:
        start = named.end()
    try:
        value, end = decoder.raw_decode(seg, start)
    except ValueError:
        return [TOOL_CALLS + seg]
    if named is not None:
        args = arguments_json(value) if isinstance(value, dict) else None
        calls = [ToolCall(named.group(1), args, make_id())] if args is not None else [None]
    else:
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(item, make_id) for item in items]
    if not calls or None in calls:
        return [TOOL_CALLS + seg]
    return [*calls, seg[end:]]


class MistralStream(ToolCallStream):
    """Modes, each a method: text (content), marker (just after `[TOOL_CALLS]`), array
    (the JSON format), args (the arguments of a `name[ARGS]` call)."""

    def __init__(self, make_id: Any) -> None:
        super().__init__(make_id)
        self._mode = "text"
        self._raw = ""  # text since the marker, for a malformed call's content
        self._follower = JsonFollower()
        self._done = 0  # calls of the current array already ended

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _text(self, final: bool) -> bool:
        if self._take_content_until((TOOL_CALLS,), final) is None:
            return False
        self._mode, self._raw = "marker", TOOL_CALLS
        return True

    def _marker(self, final: bool) -> bool:
        start = _LEAD.match(self._buf).end()
        if self._buf.startswith(("[", "{"), start):
            self._enter("array", start)
            return True
        named = _NAMED.match(self._buf)
        if named is not None:
            self._begin_call(named.group(1))
            self._enter("args", named.end())
            return True
        held = self._buf[: len(self._buf) - partial_marker_len(self._buf, (ARGS,))]
        if not final and _NAME_SO_FAR.fullmatch(held):
            return False
        self._malformed()
        return True

    def _enter(self, mode: str, skip: int) -> None:
        self._raw += self._buf[:skip]
        self._buf = self._buf[skip:]
        self._mode, self._follower, self._done = mode, JsonFollower(), 0

    def _malformed(self, text: str = "") -> None:
        """Sends the marker and `text` as content; the buffer goes on as text."""
        self._content(self._raw + text)
        self._mode = "text"

    def _array(self, final: bool) -> bool:
        follower = self._follower
        self._buf = follower.feed(self._buf)
        if follower.scanner.bad:
            return self._broken(follower.scanner.text)
        ended = follower.scanner.end is not None
        settled, growing = follower.settled, follower.growing
        items = settled if isinstance(settled, list) else [settled] if settled else []
        while self._done < len(items) - (0 if ended else 1):
            call = call_from_object(items[self._done], self._make_id)
            if call is None:
                return self._broken(follower.scanner.text)
            if not self._in_call:
                self._begin_call(call.name)
            self._end_call(call.arguments)
            self._done += 1
        if not ended and self._done < len(items):
            self._follow(items[self._done], growing)
        if not ended and not final:
            return False
        self._in_call, self._mode = False, "text"
        return True

    def _broken(self, text: str) -> bool:
        """A malformed call: content if nothing of this marker's calls went out."""
        if self._in_call or self._done:
            self._in_call, self._mode = False, "text"
        else:
            self._malformed(text)
        return True

    def _follow(self, item: Any, growing: Any) -> None:
        if not self._in_call:
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str) and name:
                self._begin_call(name)
        if self._in_call:
            grown = growing if isinstance(growing, dict) else None
            if isinstance(growing, list) and self._done < len(growing):
                grown = growing[self._done]
            args = arguments_value(grown)
            self._send_args_upto(self._follower.stable_arguments(args))

    def _args(self, final: bool) -> bool:
        follower = self._follower
        self._buf = follower.feed(self._buf)
        self._send_args_upto(follower.stable_arguments(follower.growing))
        if follower.scanner.end is None and not follower.scanner.bad and not final:
            return False
        value = follower.value()
        args = arguments_json(value) if isinstance(value, dict) else None
        if args is not None:
            self._end_call(args)
        self._in_call, self._mode = False, "text"
        return True


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral models' `[TOOL_CALLS]` calls."""

    markers = (TOOL_CALLS, ARGS)
    make_id = staticmethod(make_mistral_id)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        head, *segments = model_output.split(TOOL_CALLS)
        if not segments:
            return content_only(model_output)
        pieces: list[str | ToolCall] = [head]
        for seg in segments:
            pieces.extend(_segment(seg, self.make_id))
        return build_extracted(pieces)

    def stream(self, request: Any = None) -> MistralStream:
        return MistralStream(self.make_id)
