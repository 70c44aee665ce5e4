"""`ToolCallStream`: the per-choice streaming state shared by the parsers.

A parser's stream subclass implements `_step(final)`, which consumes `self._buf` (the
text fed and not yet classified) with these building blocks:

* `_content(text)`: content, through the whitespace rule of `base`'s docstring (a stretch of
  content that is only whitespace is held; a call starting drops it, anything else
  flushes it);
* `_take_content_until(markers, final)`: content up to the first marker, holding back a
  possible partial marker at the end of the buffer;
* `_begin_call(name)`, `_send_args_upto(stable)`, `_end_call(arguments)`: the fragments
  of one call. `stable` is any prefix of the final arguments text known so far; only
  what extends the text already sent goes out, so fragments never need taking back.

Pure Python: no jax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxengine.reasoning.base import partial_marker_len
from server.tool_parsers.calls import DeltaMessage, DeltaToolCall, make_tool_call_id
from server.tool_parsers.json_stream import JsonFollower, arguments_value


class ToolCallStream:
    """Feed deltas, get `DeltaMessage`s; `tool_calls_sent` tells whether a call went out."""

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        self.tool_calls_sent = False
        self._make_id = make_id
        self._buf = ""
        self._content_out: list[str] = []
        self._calls_out: list[DeltaToolCall] = []
        self._held = ""  # whitespace-only start of the current content stretch
        self._stretch_live = False  # the current stretch has non-whitespace text
        self._index = -1
        self._in_call = False
        self._sent_args = ""  # arguments text sent for the current call

    def feed(self, delta_text: str) -> DeltaMessage:
        """Content and call fragments for newly generated text."""
        self._buf += delta_text
        self._step(final=False)
        return self._take()

    def finish(self) -> DeltaMessage:
        """Flushes what was held back (partial markers, an unterminated call)."""
        self._step(final=True)
        if not self.tool_calls_sent:
            self._content_out.append(self._held)
        self._held = ""
        return self._take()

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ content

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._stretch_live:
            self._content_out.append(text)
            return
        self._held += text
        if self._held.strip():
            self._content_out.append(self._held)
            self._held = ""
            self._stretch_live = True

    def _take_content_until(self, markers: Sequence[str], final: bool) -> str | None:
        """Sends the content before the first marker in the buffer and drops the marker;
        returns that marker, or None (the buffer keeps only a possible partial marker)."""
        found = [(self._buf.find(m), m) for m in markers]
        found = [(pos, m) for pos, m in found if pos >= 0]
        if found:
            pos, marker = min(found)
            self._content(self._buf[:pos])
            self._buf = self._buf[pos + len(marker) :]
            return marker
        keep = 0 if final else partial_marker_len(self._buf, markers)
        cut = len(self._buf) - keep
        self._content(self._buf[:cut])
        self._buf = self._buf[cut:]
        return None

    # ------------------------------------------------------------------ calls

    def _begin_call(self, name: str) -> None:
        self._index += 1
        self._calls_out.append(DeltaToolCall(self._index, self._make_id(), name))
        self._held, self._stretch_live = "", False  # the stretch before the call ended
        self._in_call, self._sent_args = True, ""
        self.tool_calls_sent = True

    def _follow_json_call(self, follower: JsonFollower) -> None:
        """A call written as a JSON object that `follower` reads as it grows: the call
        begins once its "name" has settled, then its arguments' stable prefix goes out."""
        if not self._in_call:
            settled = follower.settled
            name = settled.get("name") if isinstance(settled, dict) else None
            if isinstance(name, str) and name:
                self._begin_call(name)
        if self._in_call:
            args = arguments_value(follower.growing)
            self._send_args_upto(follower.stable_arguments(args))

    def _send_args_upto(self, stable: str) -> None:
        """Sends what `stable` (a prefix of the final arguments) adds to the sent text."""
        if self._in_call and len(stable) > len(self._sent_args):
            if stable.startswith(self._sent_args):
                self._send_args(stable[len(self._sent_args) :])

    def _send_args(self, fragment: str) -> None:
        self._sent_args += fragment
        self._calls_out.append(DeltaToolCall(self._index, arguments=fragment))

    def _end_call(self, arguments: str) -> None:
        """Sends the rest of the final arguments text and closes the call."""
        if arguments.startswith(self._sent_args):
            rest = arguments[len(self._sent_args) :]
            if rest:
                self._send_args(rest)
        self._in_call = False

    def _take(self) -> DeltaMessage:
        """The output of one feed, with the fragments of each call merged into one."""
        merged: list[DeltaToolCall] = []
        for frag in self._calls_out:
            if merged and merged[-1].index == frag.index:
                merged[-1].arguments += frag.arguments
            else:
                merged.append(frag)
        out = DeltaMessage("".join(self._content_out), merged)
        self._content_out, self._calls_out = [], []
        return out
