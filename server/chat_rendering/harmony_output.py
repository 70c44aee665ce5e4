"""A harmony completion's token ids -> reasoning, content and tool calls.

gpt-oss writes messages ``<|channel|>CHANNEL [to=RECIPIENT]<|message|>...<|end|>``;
the special tokens are not in the detokenized text, so this parser reads token ids,
through openai-harmony's `StreamableParser`, one token at a time:

- the ``analysis`` channel is ``reasoning_content``;
- a message to ``functions.NAME`` (on any channel; gpt-oss uses ``commentary``) is a
  tool call, its content the arguments (reported as content when ``tool_choice`` is
  "none");
- ``final`` and anything else (e.g. a commentary preamble) is ``content``.

The whole message is the sum of the stream's deltas: `message_of` feeds every token to
one `HarmonyStream` and adds up what it returns, so streamed and whole answers agree
by construction. A stream cut by ``max_tokens`` keeps what it had (no error).
"""

from __future__ import annotations

from typing import Any

from server.chat_rendering.output import ChatOutputParser, Delta
from server.tool_calls import ToolChoice

TOOL_PREFIX = "functions."


class HarmonyOutputParser(ChatOutputParser):
    """`ChatOutputParser` for harmony: same messages and deltas, read from token ids."""

    def __init__(self, request: Any, choice: ToolChoice, encoding: Any, make_id: Any) -> None:
        super().__init__(request, choice, None, None, make_id)
        self.encoding = encoding
        self.show_reasoning = bool(request.include_reasoning)
        self.calls_tools = choice.mode != "none"

    @property
    def plain(self) -> bool:
        return False

    def message_of(self, seq: Any, role: str, prefix: str = "") -> tuple[dict[str, Any], bool]:
        stream = self.stream()
        whole = stream.feed_output(seq).add(stream.finish())
        calls = _merged_calls(whole.tool_calls)
        if not self.parallel:
            calls = calls[:1]
        content = prefix + whole.content if (prefix or whole.content) else None
        message: dict[str, Any] = {"role": role, "content": content}
        if self.show_reasoning:
            message["reasoning_content"] = message["reasoning"] = whole.reasoning or None
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)


class HarmonyStream:
    """One choice's harmony parser: `feed_output` each engine output, `finish` once."""

    def __init__(self, parser: HarmonyOutputParser) -> None:
        import openai_harmony as oh

        self.parser = parser
        self._harmony = oh.StreamableParser(parser.encoding, oh.Role.ASSISTANT)
        self._calls = 0  # tool calls started
        self._call_message = -1  # the harmony message index of the open call

    def feed_output(self, seq: Any) -> Delta:
        """The delta of an output's new token ids (``seq.token_ids``)."""
        delta = Delta()
        for token in seq.token_ids:
            delta = delta.add(self._token(token))
        return delta

    def feed(self, text: str) -> Delta:  # noqa: ARG002 - harmony cannot parse text
        raise TypeError("harmony output is parsed from token ids: use feed_output")

    def finish(self) -> Delta:
        """Nothing is held back: every token's delta was sent as it came."""
        return Delta()

    def _token(self, token: int) -> Delta:
        h = self._harmony
        try:
            h.process(token)
        except Exception:  # noqa: BLE001 - malformed harmony: the token is not parsed
            return Delta()
        text = h.last_content_delta or ""
        recipient = h.current_recipient or ""
        if recipient.startswith(TOOL_PREFIX) and self.parser.calls_tools:
            return self._call_delta(recipient[len(TOOL_PREFIX) :], text)
        if not text:
            return Delta()
        if h.current_channel == "analysis":
            return Delta(reasoning=text)
        return Delta(content=text)

    def _call_delta(self, name: str, arguments: str) -> Delta:
        """The open call's header (the first time its message is seen) and arguments."""
        calls = []
        message = len(self._harmony.messages)
        if message != self._call_message:
            self._call_message, self._calls = message, self._calls + 1
            function = {"name": name, "arguments": ""}
            header = {"index": self._calls - 1, "id": self.parser.make_id(), "type": "function"}
            calls.append({**header, "function": function})
        if arguments:
            calls.append({"index": self._calls - 1, "function": {"arguments": arguments}})
        if not self.parser.parallel:
            calls = [c for c in calls if c["index"] == 0]
        return Delta(tool_calls=calls)

    @property
    def tools_called(self) -> bool:
        return self._calls > 0


class HarmonyReasoningCount:
    """The reasoning-parser methods the Responses API counts ``reasoning_tokens`` with
    (`server/responses/output.py: reasoning_tokens`): harmony's reasoning is the tokens of
    its analysis messages' content (with their ``<|message|>``: the parser knows the
    channel from there)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def is_reasoning_end(self, token_ids: Any) -> bool:  # noqa: ARG002
        return True  # analysis messages are counted wherever they are

    def content_token_ids(self, token_ids: Any) -> list[int]:
        """The ids that are not in an analysis message."""
        import openai_harmony as oh

        parser = oh.StreamableParser(self.encoding, oh.Role.ASSISTANT)
        kept = []
        for token in token_ids:
            try:
                parser.process(token)
            except Exception:  # noqa: BLE001 - malformed harmony counts as content
                kept.append(token)
                continue
            if parser.current_channel != "analysis":
                kept.append(token)
        return kept


def _merged_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas as whole calls (OpenAI's ``message.tool_calls``)."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if "id" in d:
            function = {"name": d["function"]["name"], "arguments": ""}
            calls.append({"id": d["id"], "type": "function", "function": function})
        calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return calls
