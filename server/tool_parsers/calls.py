"""What the tool-call parsers produce: whole calls, and the fragments of a stream.

A leaf module of plain dataclasses (no parser logic), so that the parser interface
(`base`) and the streaming state (`stream`) both build on it without importing each
other. Pure Python: no jax.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """A fresh OpenAI-style call id: "chatcmpl-tool-" + 32 hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass
class ToolCall:
    """One complete call; `arguments` is a JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    """What `extract_tool_calls` found; `content` is None when empty."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaToolCall:
    """One streamed fragment of call `index`; id and name only on its first fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's `choices[].delta.tool_calls[]` item."""
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = function
        return out


@dataclass
class DeltaMessage:
    """What one `feed` produced: a content delta and call fragments (either may be empty)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
