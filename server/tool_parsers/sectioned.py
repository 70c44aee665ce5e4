"""Calls between special-token markers, each a header then JSON arguments:
DeepSeek-V3 / R1 (`deepseek_v3`), DeepSeek-V3.1 (`deepseek_v31`) and Kimi K2
(`kimi_k2`), vLLM's names.

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json
                  {"city": "Paris"}
                  ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                  <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>

Rules (one `SectionedStream` parses both the whole output and a stream, so the two
agree by construction):

* Text outside a section is content. Inside a section, whitespace between calls is
  dropped; other text ends the section (it is content).
* A call is the call marker, a header up to the header's end marker, and arguments up
  to the call's end marker (or the end of the output). The header names the function
  (and, for Kimi K2, is the call's id, as vLLM passes it back to the template); the
  arguments are a JSON object, a ```json fence around it allowed.
* A call whose header names nothing, or whose arguments are not an object, stays
  content as written, and so do the section markers of a section without a call.
  The stream begins a call once its arguments have opened an object, so it has sent
  nothing for a call that turns out malformed.

Pure Python: no jax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.base import ToolParser, arguments_json, register_tool_parser
from server.tool_parsers.calls import ExtractedToolCalls, ToolCall
from server.tool_parsers.json_stream import JsonFollower, first_json_value
from server.tool_parsers.stream import ToolCallStream


def _plain_name(text: str) -> str | None:
    name = text.strip()
    return name if name and not any(c.isspace() for c in name) else None


@dataclass(frozen=True)
class CallFormat:
    """A format's markers and how its header reads."""

    section: tuple[str, str]
    call: tuple[str, str]
    head_end: str
    name_of: Callable[[str], str | None]
    """The function's name in a header, None when the header names none."""
    id_of: Callable[[str], str | None] = lambda header: None
    """The call's id written in a header (None: a fresh id)."""

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.section, *self.call, self.head_end)


def arguments_text(raw: str) -> str | None:
    """The arguments JSON text of a call's raw arguments (a ```json fence allowed; none
    written: ``{}``), None when they are not a JSON object."""
    body = raw.strip()
    if body.startswith("```"):
        body = body[3:].removeprefix("json")
    body = body.removesuffix("```").strip()
    value = first_json_value(body) if body else {}
    return None if value is None else arguments_json(value)


def _json_part(raw: str) -> str | None:
    """The JSON of arguments written so far, after a ```json fence (None: only
    whitespace or a fence's start so far)."""
    body = raw.lstrip()
    if "```json".startswith(body):
        return None
    return body[3:].removeprefix("json") if body.startswith("```") else body


DS_SEP = "<｜tool▁sep｜>"
DEEPSEEK_V3 = CallFormat(
    section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    call=("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
    head_end="\n",  # "function<｜tool▁sep｜>NAME" then a newline, then the fenced JSON
    name_of=lambda h: _plain_name(h.partition(DS_SEP)[2]) if DS_SEP in h else None,
)
DEEPSEEK_V31 = CallFormat(
    section=DEEPSEEK_V3.section, call=DEEPSEEK_V3.call, head_end=DS_SEP, name_of=_plain_name
)
KIMI_K2 = CallFormat(
    section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    call=("<|tool_call_begin|>", "<|tool_call_end|>"),
    head_end="<|tool_call_argument_begin|>",
    # "functions.get_weather:0": the name between the namespace and the call's index
    name_of=lambda h: _plain_name(h.strip().rpartition(":")[0].rpartition(".")[2]),
    id_of=lambda h: _plain_name(h),
)


class SectionedStream(ToolCallStream):
    """Modes, each a method: text, section (between calls), head, args."""

    def __init__(self, fmt: CallFormat, make_id: Any) -> None:
        super().__init__(make_id)
        self._fmt = fmt
        self._mode = "text"
        self._held_section = ""  # a section's begin marker, until a call makes it go
        self._header = ""
        self._raw = ""  # the open call's arguments as written
        self._fed = 0  # how much of their JSON the follower has read
        self._follower = JsonFollower()

    def _step(self, final: bool) -> None:
        while getattr(self, f"_{self._mode}")(final):
            pass

    def _text(self, final: bool) -> bool:
        (begin, _), call = self._fmt.section, self._fmt.call[0]
        marker = self._take_content_until((begin, call), final)
        if marker is None:
            return False
        self._held_section = marker if marker == begin else ""
        self._mode = "section" if marker == begin else "head"
        return True

    def _section(self, final: bool) -> bool:
        self._buf = self._buf.lstrip()
        end, call = self._fmt.section[1], self._fmt.call[0]
        for marker, mode in ((call, "head"), (end, "text")):
            if self._buf.startswith(marker):
                self._buf, self._mode = self._buf[len(marker) :], mode
                if mode == "text":
                    self._unheld(marker)
                return True
        if not final and (not self._buf or call.startswith(self._buf) or end.startswith(self._buf)):
            return False
        self._unheld("")  # other text: the section has ended
        self._mode = "text"
        return bool(self._buf)

    def _unheld(self, marker: str) -> None:
        """A section ends: its markers are content when it held no call."""
        if self._held_section:
            self._content(self._held_section + marker)
        self._held_section = ""

    def _head(self, final: bool) -> bool:
        pos = self._buf.find(self._fmt.head_end)
        if pos < 0:
            if final:
                written, self._buf = self._buf, ""
                self._malformed(written, closed=False)
            return False
        self._header, self._buf = self._buf[:pos], self._buf[pos + len(self._fmt.head_end) :]
        if self._fmt.name_of(self._header) is None:
            self._buf = self._fmt.head_end + self._buf
            self._malformed(self._header, closed=False)
            return True
        self._raw, self._fed, self._follower, self._mode = "", 0, JsonFollower(), "args"
        return True

    def _args(self, final: bool) -> bool:
        end = self._fmt.call[1]
        pos = self._buf.find(end)
        keep = 0 if final else partial_marker_len(self._buf, (end,))
        cut = pos if pos >= 0 else len(self._buf) - keep
        self._raw += self._buf[:cut]
        part = _json_part(self._raw)
        if part is not None:
            self._follower.feed(part[self._fed :])
            self._fed = len(part)
        self._buf = self._buf[cut + len(end) :] if pos >= 0 else self._buf[cut:]
        if pos < 0 and not final:
            self._follow()
            return False
        self._close(closed=pos >= 0)
        return True

    def _follow(self) -> None:
        """Begins the call once its arguments open an object; sends their stable part."""
        growing = self._follower.growing
        if not self._in_call and isinstance(self._follower.settled, dict):
            self._begin()
        if self._in_call and isinstance(growing, dict):
            self._send_args_upto(self._follower.stable_arguments(growing))

    def _begin(self) -> None:
        self._begin_call(self._fmt.name_of(self._header) or "")
        own_id = self._fmt.id_of(self._header)
        if own_id is not None:
            self._calls_out[-1].id = own_id
        self._held_section = ""

    def _close(self, closed: bool) -> None:
        arguments = arguments_text(self._raw)
        if arguments is None and not self._in_call:
            self._malformed(self._header + self._fmt.head_end + self._raw, closed)
            return
        if not self._in_call:
            self._begin()
        self._end_call(arguments or self._sent_args)
        self._mode = "section"

    def _malformed(self, written: str, closed: bool) -> None:
        """A call that is none: its text (from the call marker) is content."""
        self._unheld("")
        self._content(self._fmt.call[0] + written + (self._fmt.call[1] if closed else ""))
        self._mode = "text"


class SectionedToolParser(ToolParser):
    """Base of the sectioned formats; `fmt` is the format."""

    fmt: CallFormat = DEEPSEEK_V3

    def stream(self, request: Any = None) -> SectionedStream:
        return SectionedStream(self.fmt, self.make_id)

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        stream = self.stream(request)
        pieces = [stream.feed(model_output), stream.finish()]
        content = "".join(p.content for p in pieces)
        calls: dict[int, ToolCall] = {}
        for frag in (f for p in pieces for f in p.tool_calls):
            if frag.index not in calls:
                calls[frag.index] = ToolCall(frag.name or "", "", frag.id or self.make_id())
            calls[frag.index].arguments += frag.arguments
        return ExtractedToolCalls(bool(calls), list(calls.values()), content or None)


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(SectionedToolParser):
    """DeepSeek-V3 / R1: ``function<｜tool▁sep｜>NAME`` then fenced JSON arguments."""

    fmt = DEEPSEEK_V3
    markers = DEEPSEEK_V3.markers[:4]


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(SectionedToolParser):
    """DeepSeek-V3.1: ``NAME<｜tool▁sep｜>`` then JSON arguments."""

    fmt = DEEPSEEK_V31
    markers = DEEPSEEK_V31.markers


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(SectionedToolParser):
    """Kimi K2: ``functions.NAME:INDEX`` (the call's id) then JSON arguments."""

    fmt = KIMI_K2
    markers = KIMI_K2.markers
