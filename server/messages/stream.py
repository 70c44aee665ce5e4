"""Anthropic's streamed events, built from chat.completion.chunk dicts.

The order, as Anthropic sends it::

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta, message_stop

Each chunk's delta is read in the order reasoning, content, tool calls; a change of
kind closes the open block and opens the next: ``thinking`` (``thinking_delta``s,
then a ``signature_delta`` before it stops), ``text`` (``text_delta``s), ``tool_use``
(opened by the call's first delta, with its id and name; its arguments follow as
``input_json_delta``s). ``message_delta`` carries the stop reason, the matched stop
sequence and the final usage (`server/messages/response.py`). An error after the
status line ends the stream with an ``error`` event; there is no ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from server.messages.errors import anthropic_error_body, error_status
from server.messages.response import message_start, signature, stop_reason, usage

Event = tuple[str, dict[str, Any]]
"""(event name, data): the ``type`` in the data is the event name."""


class BlockStream:
    """Content block events from a choice's chat deltas; `close` once at the end."""

    def __init__(self, thinking_shown: bool = True) -> None:
        self.thinking_shown = thinking_shown
        self.count = 0  # blocks opened so far; the open one is count - 1
        self.kind: str | None = None  # of the open block
        self.thinking = ""  # the open thinking block's text (for its signature)
        self.tool_blocks: dict[int, int] = {}  # chat's tool call index -> block index

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._thinking(delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        return events

    def close(self) -> list[Event]:
        """Stops the open block, if any."""
        if self.kind is None:
            return []
        events: list[Event] = []
        if self.kind == "thinking":
            sig = {"type": "signature_delta", "signature": signature(self.thinking)}
            events.append(self._delta(sig))
        events.append(
            ("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})
        )
        self.kind, self.thinking = None, ""
        return events

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.kind = block["type"]
        start = {"type": "content_block_start", "index": self.count, "content_block": block}
        self.count += 1
        return [*events, ("content_block_start", start)]

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> Event:
        at = self.count - 1 if index is None else index
        return "content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta}

    def _thinking(self, text: str) -> list[Event]:
        events = []
        if self.kind != "thinking":
            events = self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thinking += text
        if self.thinking_shown:
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return events

    def _text(self, text: str) -> list[Event]:
        events = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events: list[Event] = []
        if call.get("id") is not None and index not in self.tool_blocks:
            block = {
                "type": "tool_use",
                "id": call["id"],
                "name": function.get("name"),
                "input": {},
            }
            events = self._open(block)
            self.tool_blocks[index] = self.count - 1
        fragment = function.get("arguments") or ""
        if fragment and index in self.tool_blocks:
            partial = {"type": "input_json_delta", "partial_json": fragment}
            events.append(self._delta(partial, self.tool_blocks[index]))
        return events


async def message_events(
    chunks: AsyncIterator[dict[str, Any]], msg_id: str, model: str, thinking_shown: bool = True
) -> AsyncIterator[Event]:
    """The events of one message from chat's chunks (one choice, usage on every chunk
    and in a final usage chunk)."""
    blocks = BlockStream(thinking_shown)
    finish, matched, last_usage, metrics = None, None, None, None
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if last_usage is None:
                start = message_start(msg_id, model, chunk.get("usage"))
                yield "message_start", {"type": "message_start", "message": start}
                yield "ping", {"type": "ping"}
            last_usage = chunk.get("usage") or last_usage or {}
            metrics = chunk.get("metrics", metrics)
            for choice in chunk["choices"]:
                for event in blocks.feed(choice.get("delta") or {}):
                    yield event
                if choice.get("finish_reason") is not None:
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
    for event in blocks.close():
        yield event
    reason, sequence = stop_reason(finish, matched)
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    end = {"type": "message_delta", "delta": delta, "usage": usage(last_usage)}
    if metrics is not None:
        end["metrics"] = metrics
    yield "message_delta", end
    yield "message_stop", {"type": "message_stop"}


async def anthropic_sse(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Server-sent events, ``event: <name>`` then ``data: {...}``; a failure becomes an
    ``error`` event (the status line is already sent). ``events`` is closed when the
    client goes away, which aborts the engine request."""
    async with contextlib.aclosing(events):
        try:
            async for name, data in events:
                yield _event(name, data)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the server goes on
            message, status = error_status(exc)  # logs an unexpected one
            yield _event("error", anthropic_error_body(message, status))


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
