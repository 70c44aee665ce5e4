"""Tool-call parsers: a model's output -> OpenAI `tool_calls`, whole or streamed.

    parser = get_tool_parser("hermes")(tokenizer)
    request = parser.adjust_request(request)            # may keep special tokens
    result = parser.extract_tool_calls(text, request)   # ExtractedToolCalls
    stream = parser.stream(request)                     # one per streamed choice
    delta = stream.feed(delta_text); ...; delta = stream.finish()

Built in (vLLM's names): `deepseek_v3`, `deepseek_v31`, `glm45`, `hermes`, `kimi_k2`,
`llama3_json`, `mistral`, `pythonic`, `qwen3_xml`.
`TOOL_PARSERS` is the live name -> class dict; `--tool-parser-plugin FILE` imports a
file whose `@register_tool_parser(name)` classes join it.

Pure Python: no jax.
"""

from __future__ import annotations

from server.tool_parsers import (
    glm45,
    hermes,
    llama3_json,
    mistral,
    pythonic,
    qwen3_xml,
    sectioned,
)
from server.tool_parsers.base import REGISTRY, ToolParser, register_tool_parser
from server.tool_parsers.calls import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    make_tool_call_id,
)
from server.tool_parsers.stream import ToolCallStream

TOOL_PARSERS = REGISTRY.parsers
"""Registered names -> parser classes (built-ins and plugins)."""

BUILTIN_PARSERS = (glm45, hermes, llama3_json, mistral, pythonic, qwen3_xml, sectioned)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones."""
    return REGISTRY.get(name)


def import_tool_parser_plugin(path: str) -> None:
    """Imports a `.py` file (or module name) whose decorators register parsers."""
    REGISTRY.import_plugin(path)


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "import_tool_parser_plugin",
    "make_tool_call_id",
    "register_tool_parser",
]
