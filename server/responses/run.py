"""One Responses request running as a chat completion: its result, whole or as events.

`ResponseRun` wraps what `ChatHandler.start` returned (the chat view and the engine
output streams). It watches the streams on their way to the view (`OutputWatch`) for
what a chat response does not carry: the prompt tokens found in the prefix cache and
the generated token ids, from which the reasoning parser counts reasoning tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from jaxengine.outputs import RequestOutput
from server.responses import output as O
from server.responses.input import items_to_messages
from server.responses.stream import ResponseEvents


class OutputWatch:
    """Passes a request's engine outputs through, keeping the last one and the token
    ids generated so far (``delta``: each output carries only its new tokens)."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.last: RequestOutput | None = None
        self.token_ids: list[int] = []

    async def watch(
        self, streams: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for index, out in streams:
                self.last = out
                for seq in out.outputs:  # one: a Responses request has n = 1
                    ids = list(seq.token_ids)
                    self.token_ids = self.token_ids + ids if self.delta else ids
                yield index, out
        finally:
            aclose = getattr(streams, "aclose", None)
            if aclose is not None:
                await aclose()

    @property
    def cached_tokens(self) -> int:
        return (self.last.num_cached_tokens or 0) if self.last is not None else 0


class ResponseRun:
    """A started response: ``base`` is its Response object before any output,
    ``conversation`` the chat messages it answers (without instructions)."""

    def __init__(
        self,
        view: Any,
        streams: AsyncIterator[tuple[int, RequestOutput]],
        base: dict[str, Any],
        conversation: list[dict[str, Any]],
        reasoning_parser: Any,
        stream: bool,
    ) -> None:
        self.view = view
        self.streams = streams
        self.base = base
        self.conversation = conversation
        self.reasoning_parser = reasoning_parser
        self.watch = OutputWatch(delta=stream)
        self.events = ResponseEvents()
        self.final: dict[str, Any] | None = None
        """The Response object a finished `stream` ended with."""

    @property
    def id(self) -> str:
        return self.base["id"]

    async def collect(self) -> dict[str, Any]:
        """The finished Response object (the request was not streamed)."""
        completion = await self.view.collect(self.watch.watch(self.streams))
        choice = completion["choices"][0]
        reasoned = bool(choice["message"].get("reasoning_content"))
        response = O.finished(
            self.base,
            O.output_items(choice),
            self._usage(completion["usage"], reasoned),
            choice["finish_reason"],
        )
        return _with_metrics(response, completion.get("metrics"))

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        """The events of a streamed request; `final` is the Response they end with."""
        events = self.events
        for event in events.start(self.base):
            yield event
        watched = self.watch.watch(self.streams)
        chunks = self.view.stream(watched)
        try:
            async for chunk in chunks:
                for event in events.chunk(chunk):
                    yield event
        finally:  # closed early (the client went away): abort the engine request now
            await chunks.aclose()
            await watched.aclose()
        events.close_item()
        if events.chat_usage is None:
            raise RuntimeError("the chat stream ended without its usage chunk")
        reasoned = any(item["type"] == "reasoning" for item in events.items)
        usage = self._usage(events.chat_usage, reasoned)
        response = O.finished(self.base, events.items, usage, events.finish_reason)
        self.final = _with_metrics(response, events.metrics)
        for event in events.finish(self.final):
            yield event

    def _usage(self, chat_usage: dict[str, Any], reasoned: bool) -> dict[str, Any]:
        ids = self.watch.token_ids
        reasoning = O.reasoning_tokens(self.reasoning_parser, ids, reasoned)
        return O.usage(chat_usage, self.watch.cached_tokens, reasoning)

    def conversation_after(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages a response continuing this one starts from (an empty
        assistant turn for an output with no message and no call)."""
        answer = items_to_messages(response["output"]) or [{"role": "assistant", "content": ""}]
        return self.conversation + answer


def _with_metrics(response: dict[str, Any], metrics: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's per-request timing ``metrics`` (--enable-per-request-metrics), when on."""
    return response if metrics is None else {**response, "metrics": metrics}
