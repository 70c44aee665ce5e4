"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

    parser = get_reasoning_parser("deepseek_r1")(tokenizer)
    reasoning, content = parser.extract(text)          # a whole output
    stream = parser.stream()                           # one per streamed choice
    r_delta, c_delta = stream.feed(delta_text); ...; stream.finish()

`REASONING_PARSERS` is the live name -> class dict; `--reasoning-parser-plugin FILE`
imports a file whose `@register_reasoning_parser(name)` classes join it.

Pure Python: no jax.
"""

from __future__ import annotations

from jaxengine.reasoning.base import (
    REGISTRY,
    ReasoningParser,
    ReasoningStream,
    register_reasoning_parser,
)
from jaxengine.reasoning.think import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    Qwen3ReasoningParser,
    ThinkingParser,
)

REASONING_PARSERS = REGISTRY.parsers
"""Registered names -> parser classes (built-ins and plugins)."""


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the known ones."""
    return REGISTRY.get(name)


def import_reasoning_parser_plugin(path: str) -> None:
    """Imports a `.py` file (or module name) whose decorators register parsers."""
    REGISTRY.import_plugin(path)


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Glm45ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "ThinkingParser",
    "get_reasoning_parser",
    "import_reasoning_parser_plugin",
    "register_reasoning_parser",
]
