"""The Responses event stream, built from chat's chunk stream.

Events, each with its ``type`` and a ``sequence_number`` counting from 0:

    response.created, response.in_progress
    per output item, one after the other:
      response.output_item.added
      reasoning:     response.content_part.added (reasoning_text),
                     response.reasoning_text.delta ..., response.reasoning_text.done,
                     response.content_part.done
      message:       response.content_part.added (output_text),
                     response.output_text.delta ..., response.output_text.done,
                     response.content_part.done
      function_call: response.function_call_arguments.delta ...,
                     response.function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete when the token limit cut it)

An item opens when the chat deltas first carry its kind (reasoning, content, or a
tool call with its name) and is done when the next one opens or the generation ends.
`ResponseEvents.items` are the finished output items, for the final Response.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from server.responses import output as O


@dataclasses.dataclass
class _Item:
    """The open output item: its kind, id and text so far."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    index: int  # output_index
    text: str = ""
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def snapshot(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return O.reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return O.message_item(self.id, self.text, status, self.logprobs)
        arguments = self.text if status != "in_progress" else ""
        return O.function_call_item(self.id, self.call_id, self.name, arguments, status)


@dataclasses.dataclass
class _Call:
    """A streamed tool call: what its deltas said before its item could open."""

    call_id: str | None = None
    name: str | None = None
    pending: str = ""
    item: _Item | None = None


class ResponseEvents:
    """One response's events. Feed `start`, then `chunk` per chat chunk, then `finish`
    with the final Response object; each returns the events to send."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.chat_usage: dict[str, Any] | None = None
        self.metrics: dict[str, Any] | None = None
        self._open: _Item | None = None
        self._calls: dict[int, _Call] = {}
        self._out: list[dict[str, Any]] = []

    def _emit(self, kind: str, **fields: Any) -> None:
        self._out.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def _take(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out

    def start(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        self._emit("response.created", response=response)
        self._emit("response.in_progress", response=response)
        return self._take()

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat.completion.chunk (n = 1)."""
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        if "metrics" in chunk:
            self.metrics = chunk["metrics"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                self._content(delta["content"], logprobs)
            for call in delta.get("tool_calls") or []:
                self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return self._take()

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """Closes the open item; the terminal event carries ``response``."""
        self.close_item()
        terminal = "response.incomplete" if response["status"] == "incomplete" else None
        self._emit(terminal or "response.completed", response=response)
        return self._take()

    def failed(self, message: str, code: str, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The end of a stream that failed: an ``error`` event, then
        ``response.failed`` with the failed Response object."""
        self._emit("error", code=code, message=message, param=None)
        self._emit("response.failed", response=response)
        return self._take()

    # ------------------------------------------------------------------ items

    def _open_item(self, kind: str, prefix: str, call_id: str = "", name: str = "") -> _Item:
        self.close_item()
        item = _Item(kind, O.new_id(prefix), len(self.items), call_id=call_id, name=name)
        self._open = item
        self._emit(
            "response.output_item.added", output_index=item.index, item=item.snapshot("in_progress")
        )
        if kind != "function_call":
            part = _part(item)
            self._emit("response.content_part.added", **_where(item), part=part)
        return item

    def close_item(self) -> None:
        """Sends the open item's done events; the last item of a generation cut by the
        token limit is ``"incomplete"``."""
        item, self._open = self._open, None
        if item is None:
            return
        where = _where(item)
        if item.kind == "function_call":
            self._emit(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=item.index,
                name=item.name,
                arguments=item.text,
            )
        else:
            text_done = "response.reasoning_text.done" if item.kind == "reasoning" else None
            fields = {} if text_done else {"logprobs": item.logprobs}
            self._emit(text_done or "response.output_text.done", **where, text=item.text, **fields)
            self._emit("response.content_part.done", **where, part=_part(item))
        status = "incomplete" if self.finish_reason == "length" else "completed"
        done = item.snapshot(status)
        self.items.append(done)
        self._emit("response.output_item.done", output_index=item.index, item=done)

    def _reasoning(self, text: str) -> None:
        item = self._open if self._open and self._open.kind == "reasoning" else None
        item = item or self._open_item("reasoning", "rs")
        item.text += text
        self._emit("response.reasoning_text.delta", **_where(item), delta=text)

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        item = self._open if self._open and self._open.kind == "message" else None
        item = item or self._open_item("message", "msg")
        item.text += text
        item.logprobs += logprobs
        self._emit("response.output_text.delta", **_where(item), delta=text, logprobs=logprobs)

    def _tool_call(self, delta: dict[str, Any]) -> None:
        call = self._calls.setdefault(delta.get("index", 0), _Call())
        function = delta.get("function") or {}
        call.call_id = call.call_id or delta.get("id")
        call.name = call.name or function.get("name")
        fragment = function.get("arguments") or ""
        if call.item is None:
            call.pending += fragment
            if call.name is None:
                return  # the item opens with its name
            call_id = call.call_id or O.new_id("call")
            call.item = self._open_item("function_call", "fc", call_id, call.name)
            fragment, call.pending = call.pending, ""
        elif call.item is not self._open:
            raise RuntimeError("a tool call's arguments went on after the next output item began")
        if fragment:
            call.item.text += fragment
            self._emit(
                "response.function_call_arguments.delta",
                item_id=call.item.id,
                output_index=call.item.index,
                delta=fragment,
            )


def _where(item: _Item) -> dict[str, Any]:
    return {"item_id": item.id, "output_index": item.index, "content_index": 0}


def _part(item: _Item) -> dict[str, Any]:
    if item.kind == "reasoning":
        return {"type": "reasoning_text", "text": item.text}
    return O.text_part(item.text, item.logprobs)


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event as OpenAI sends them: ``event:`` its type, ``data:`` it."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
