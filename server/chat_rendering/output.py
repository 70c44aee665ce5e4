"""A chat choice's generated text split into reasoning, content and tool calls.

The pipeline, whole (`ChatOutputParser.message`) or streamed (`ChoiceStream`); the
view hands each engine output sequence to `message_of` / `feed_output`, so a parser
of token ids (harmony, `server/chat_rendering/harmony_output.py`) plugs in as a subclass:

1. the reasoning parser (``--reasoning-parser``), if any, splits the reasoning off;
2. the content goes to the tool calls of the request's `ToolChoice`: for "required"
   and "named" the whole content is the constrained JSON of the calls (`ForcedCalls`),
   for "auto" the server's tool parser (``--tool-call-parser``) finds calls in it;
   with "none" it stays content.

``finish_reason`` becomes ``"tool_calls"`` when calls were made and the generation
stopped by itself (not on length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from server.tool_calls import ForcedCalls, ToolChoice


@dataclasses.dataclass
class Delta:
    """What one streamed step adds to a choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, other: Delta) -> Delta:
        return Delta(
            self.reasoning + other.reasoning,
            self.content + other.content,
            [*self.tool_calls, *other.tool_calls],
        )


class ChatOutputParser:
    """The parsers of one request: built per request (tool parsers keep request state).

    ``reasoning``: a reasoning parser instance or None; ``tools``: a tool parser
    instance (used only for the "auto" choice) or None.
    """

    def __init__(
        self,
        request: Any,
        choice: ToolChoice,
        reasoning: Any,
        tools: Any,
        make_id: Callable[[], str],
    ) -> None:
        self.request = request
        self.choice = choice
        self.reasoning = reasoning
        self.tools = tools if choice.mode == "auto" else None
        self.make_id = make_id
        self.parallel = request.parallel_tool_calls is not False
        self.show_reasoning = reasoning is not None and request.include_reasoning

    @property
    def plain(self) -> bool:
        """No parsing at all: the text is the content."""
        return self.reasoning is None and self.tools is None and not self.choice.forced

    def message(self, text: str, role: str, prefix: str = "") -> tuple[dict[str, Any], bool]:
        """(OpenAI's ``message``, whether tools were called) for a choice's whole text."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
        calls: list[dict[str, Any]] = []
        if self.choice.forced:
            forced = ForcedCalls(self.choice, self.make_id)
            forced.feed(content or "")
            calls, content = forced.calls(), None
        elif self.tools is not None:
            found = self.tools.extract_tool_calls(content or "", self.request)
            if found.tools_called:
                calls = [self._call(c) for c in found.tool_calls]
                content = found.content
        if not self.parallel:
            calls = calls[:1]
        if prefix:
            content = prefix + (content or "")
        message: dict[str, Any] = {"role": role, "content": content}
        if self.show_reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def message_of(self, seq: Any, role: str, prefix: str = "") -> tuple[dict[str, Any], bool]:
        """`message` for an engine output sequence (its ``text``; a parser of token
        ids, `server/chat_rendering/harmony_output.py`, reads ``token_ids`` instead)."""
        return self.message(seq.text, role, prefix)

    def _call(self, call: Any) -> dict[str, Any]:
        function = {"name": call.name, "arguments": call.arguments}
        return {"id": call.id or self.make_id(), "type": "function", "function": function}

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def delta_dict(self, delta: Delta) -> dict[str, Any]:
        """OpenAI's ``delta`` of a chunk (empty when there is nothing to send)."""
        out: dict[str, Any] = {}
        if self.plain or delta.content:
            out["content"] = delta.content
        if self.show_reasoning and delta.reasoning:
            out["reasoning_content"] = out["reasoning"] = delta.reasoning
        if delta.tool_calls:
            out["tool_calls"] = delta.tool_calls
        return out


class ChoiceStream:
    """One choice's streaming state: feed each text delta, then `finish` once."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self._reasoning = parser.reasoning.stream() if parser.reasoning is not None else None
        self._forced = ForcedCalls(parser.choice, parser.make_id) if parser.choice.forced else None
        self._tools = parser.tools.stream(parser.request) if parser.tools is not None else None

    def feed_output(self, seq: Any) -> Delta:
        """`feed` for an engine output sequence's new text."""
        return self.feed(seq.text)

    def feed(self, text: str) -> Delta:
        if self._reasoning is None:
            return self._content(text)
        reasoning, content = self._reasoning.feed(text)
        return Delta(reasoning=reasoning or "").add(self._content(content or ""))

    def finish(self) -> Delta:
        """What the parsers held back until the end."""
        delta = Delta()
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            delta = Delta(reasoning=reasoning or "").add(self._content(content or ""))
        if self._tools is not None:
            delta = delta.add(self._parsed(self._tools.finish()))
        return delta

    def _content(self, text: str) -> Delta:
        if self._forced is not None:
            return Delta(tool_calls=self._forced.feed(text))
        if self._tools is not None:
            return self._parsed(self._tools.feed(text)) if text else Delta()
        return Delta(content=text)

    def _parsed(self, message: Any) -> Delta:
        calls = [c.to_openai() for c in message.tool_calls]
        if not self.parser.parallel:
            calls = [c for c in calls if c.get("index", 0) == 0]
        return Delta(content=message.content or "", tool_calls=calls)

    @property
    def tools_called(self) -> bool:
        if self._forced is not None:
            return self._forced.called
        return self._tools is not None and bool(self._tools.tool_calls_sent)
