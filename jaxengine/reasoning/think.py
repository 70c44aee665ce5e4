"""`<think>...</think>` reasoning parsers: `deepseek_r1`, `qwen3` and `glm45`.

Text rules (the same in `extract` and in the concatenated stream deltas):

* A `<think>` at the very start of the output is dropped.
* Reasoning is the text up to `</think>`, with newlines stripped at both ends; content
  is the text after `</think>` with its leading newlines stripped (the templates write
  `</think>\\n\\n`). Nothing else is stripped; an empty part is None.
* `deepseek_r1`: the start marker is normally in the prompt, so without `</think>` the
  whole output is reasoning (content None).
* `qwen3`: an output starting with `<think>` is reasoning up to `</think>` (all of it
  if the output was cut before `</think>`). An output without a leading `<think>` is
  content (thinking disabled) -- except that `extract` still splits it at a `</think>`
  (models whose template opens the think block in the prompt). The stream cannot take
  that text back once sent as content: it streams such an output verbatim as content.
  This is the one case where stream and `extract` differ; use `deepseek_r1` for models
  whose prompt opens the think block (as Qwen recommends for its -Thinking models).
* `glm45` (GLM-4.5 / 4.6): `qwen3`'s rules, except that newlines before the leading
  `<think>` are dropped with it (GLM writes `\n<think>` after `<|assistant|>`); an output
  whose first other character is not `<think>` keeps its leading newlines as content.
  With thinking off, GLM's template closes an empty think block in the prompt, and
  the output is content.

Token side: the reasoning has ended when the last think marker among the ids is
`</think>`. Pass the prompt ids too (prompt + output) to see a think block that the
chat template closed in the prompt (Qwen3 with `enable_thinking=False`).

Pure Python: no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxengine.reasoning.base import (
    ReasoningParser,
    ReasoningStream,
    partial_marker_len,
    register_reasoning_parser,
    vocab_token_id,
)

START, END = "<think>", "</think>"


def _none(text: str) -> str | None:
    return text or None


class ThinkStream(ReasoningStream):
    """Streaming state of a `ThinkingParser` (modes: start, reasoning, content, plain)."""

    def __init__(self, implicit: bool, newlines_before_start: bool = False) -> None:
        self._implicit = implicit  # no leading <think>: reasoning (True) or content
        self._skip = "\n" if newlines_before_start else ""  # dropped before a <think>
        self._mode = "start"
        self._buf = ""  # text not yet classified (a partial marker at most)
        self._newlines = ""  # trailing newlines of the reasoning, held back
        self._reasoning_started = False
        self._content_started = False

    def feed(self, delta_text: str) -> tuple[str, str]:
        self._buf += delta_text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        progress = True
        while progress:
            if self._mode == "start":
                progress = self._start(final)
            elif self._mode == "reasoning":
                text, progress = self._reason(final)
                reasoning.append(text)
            else:
                content.append(self._content())
                progress = False
        return "".join(reasoning), "".join(content)

    def _start(self, final: bool) -> bool:
        """Decides the mode from the first characters; False to wait for more."""
        head = self._buf.lstrip(self._skip) if self._skip else self._buf
        if head.startswith(START):
            self._buf = head[len(START) :]
            self._mode = "reasoning"
        elif START.startswith(head) and not final:
            return False  # "", "<", "<th", ... (after newlines) may still become <think>
        else:
            self._mode = "reasoning" if self._implicit else "plain"
        return True

    def _reason(self, final: bool) -> tuple[str, bool]:
        """(reasoning text of the buffer, whether `</think>` closed it)."""
        pos = self._buf.find(END)
        if pos >= 0:
            text, self._buf = self._buf[:pos], self._buf[pos + len(END) :]
            self._mode = "content"
        else:
            keep = 0 if final else partial_marker_len(self._buf, (END,))
            cut = len(self._buf) - keep
            text, self._buf = self._buf[:cut], self._buf[cut:]
        closing = pos >= 0 or final
        text = self._newlines + text
        self._newlines = ""
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        body = text.rstrip("\n")
        if not closing:
            self._newlines = text[len(body) :]  # may be followed by more reasoning
        return body, pos >= 0

    def _content(self) -> str:
        text, self._buf = self._buf, ""
        if self._mode == "content" and not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


class ThinkingParser(ReasoningParser):
    """`<think>`/`</think>` parser; `implicit` says whether an output without a leading
    `<think>` is reasoning (the prompt opened the block) or content."""

    implicit: bool = True
    newlines_before_start: bool = False
    """Newlines before a leading `<think>` are dropped with it (`glm45`)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.start_token_id: int | None = None
        self.end_token_id: int | None = None
        if tokenizer is not None:
            self.start_token_id = vocab_token_id(tokenizer, START)
            self.end_token_id = vocab_token_id(tokenizer, END)
            if self.end_token_id is None:
                raise ValueError(
                    f"reasoning parser {self.name!r}: the tokenizer has no single {END!r} "
                    "token; this parser needs a model that emits it as one token"
                )

    def _last_marker(self, ids: Sequence[int]) -> int:
        """Index of the last think marker in `ids` if it is `</think>`, else -1."""
        if self.end_token_id is None:
            raise ValueError(f"reasoning parser {self.name!r} was built without a tokenizer")
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == self.end_token_id:
                return i
            if ids[i] == self.start_token_id:
                return -1
        return -1

    def is_reasoning_end(self, output_token_ids: Sequence[int]) -> bool:
        return self._last_marker(output_token_ids) >= 0

    def content_token_ids(self, output_token_ids: Sequence[int]) -> list[int]:
        end = self._last_marker(output_token_ids)
        return list(output_token_ids[end + 1 :]) if end >= 0 else []

    def extract(self, text: str) -> tuple[str | None, str | None]:
        head = text.lstrip("\n") if self.newlines_before_start else text
        thinking = head.startswith(START)
        body = head[len(START) :] if thinking else text
        pos = body.find(END)
        if pos < 0:
            if thinking or self.implicit:
                return _none(body.strip("\n")), None
            return None, _none(body)
        return _none(body[:pos].strip("\n")), _none(body[pos + len(END) :].lstrip("\n"))

    def stream(self) -> ThinkStream:
        return ThinkStream(self.implicit, self.newlines_before_start)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkingParser):
    """DeepSeek-R1 (and its distills): the template opens `<think>` in the prompt."""

    name = "deepseek_r1"
    implicit = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkingParser):
    """Qwen3 hybrid models: a thinking turn starts its output with `<think>`."""

    name = "qwen3"
    implicit = False


@register_reasoning_parser("glm45")
class Glm45ReasoningParser(ThinkingParser):
    """GLM-4.5 / 4.6: a thinking turn starts its output with `\n<think>`."""

    name = "glm45"
    implicit = False
    newlines_before_start = True
