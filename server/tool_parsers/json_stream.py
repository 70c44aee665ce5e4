"""Following a JSON call object while it is being generated.

`JsonScanner` lexes the text incrementally and knows two safe cut points:

* `boundary`: just after the last `{`, `[`, `,`, `}` or `]` outside strings. The text
  up to it, closed by `partial_json_parser.ensure_json`, parses to values that are all
  complete (no half string, no number that may still grow);
* `safe`, while inside a string that is a value: the end of its complete characters
  (not in the middle of an escape, not after an unpaired high surrogate).

`JsonFollower` parses those prefixes (`settled`: up to `boundary`; `growing`: up to
`safe`, with the open string) and `stable_arguments` turns the partial arguments object
into a prefix of its final `json.dumps` text: dump it, strip the closing brackets that
later text may move, and the quote of a string that is still open. JSON string
encoding works character by character, so a partial string's dump is a prefix of the
full string's. (Duplicate keys can break this; the stream then sends the rest of the
arguments only if it still extends what was sent.)

Re-parsing a long prefix on every delta would be quadratic; snapshots are taken only
once the text has grown by 1/32 since the last one (or when forced at the end).

Pure Python: no jax.
"""

from __future__ import annotations

import json
from typing import Any

from partial_json_parser import ensure_json


def loads_lenient(text: str) -> Any:
    """json.loads allowing raw control characters in strings; None if not JSON."""
    try:
        return json.loads(text, strict=False)
    except ValueError:
        return None


def first_json_value(text: str) -> Any:
    """The JSON value that starts `text` (after whitespace), ignoring what follows it;
    None if there is none."""
    start = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder(strict=False).raw_decode(text, start)[0]
    except ValueError:
        return None


def parse_prefix(text: str) -> Any:
    """The value of a JSON prefix that ends at a safe cut point, None if there is none."""
    if not text.strip():
        return None
    try:
        return json.loads(ensure_json(text), strict=False)
    except Exception:  # partial_json_parser raises its own types on odd input
        return None


def stable_arguments(value: Any, open_string: bool) -> str:
    """A prefix of `json.dumps(final arguments)` known from a partial arguments value."""
    if not isinstance(value, dict):
        return ""  # not yet an object (or quoted arguments): sent whole at the end
    text = json.dumps(value, ensure_ascii=False).rstrip("}]")
    if open_string and text.endswith('"'):
        text = text[:-1]
    return text


def arguments_value(obj: Any) -> Any:
    """The arguments of a call object: "arguments", else "parameters" (Llama)."""
    if not isinstance(obj, dict):
        return None
    return obj["arguments"] if "arguments" in obj else obj.get("parameters")


class JsonScanner:
    """Incremental lexer over one JSON object or array (leading whitespace allowed)."""

    def __init__(self) -> None:
        self.text = ""
        self.boundary = 0
        self.safe = 0
        self.end: int | None = None  # just past the value, once it is closed
        self.bad = False  # the text is not one JSON object or array
        self._stack: list[str] = []
        self._key_next = False  # in an object, the next string is a key
        self._in_string = False
        self._value_string = False
        self._escape = False
        self._hex: str | None = None  # digits of a \uXXXX escape being read

    @property
    def in_value_string(self) -> bool:
        return self._in_string and self._value_string

    def feed(self, chunk: str) -> str:
        """Scans `chunk`; returns the text beyond the end of the value, or from the
        first character that breaks it ("" while the value is still open)."""
        if self.end is not None or self.bad:
            return chunk
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            if self._in_string:
                self._string_char(i, self.text[i])
            else:
                self._char(i, self.text[i])
            if self.bad:
                rest, self.text = self.text[i:], self.text[:i]
                return rest
            if self.end is not None:
                rest, self.text = self.text[self.end :], self.text[: self.end]
                return rest
        return ""

    def _char(self, i: int, c: str) -> None:
        if c in " \t\r\n":
            return
        if not self._stack and c not in "{[":
            self.bad = True
        elif c in "{[":
            self._stack.append(c)
            self._key_next = c == "{"
            self.boundary = i + 1
        elif c in "}]":
            if self._stack.pop() != ("{" if c == "}" else "["):
                self.bad = True
            self.boundary, self._key_next = i + 1, False
            if not self._stack:
                self.end = i + 1
        elif c == ",":
            self.boundary = i + 1
            self._key_next = self._stack[-1] == "{"
        elif c == ":":
            self._key_next = False
        elif c == '"':
            self._in_string, self._value_string = True, not self._key_next
            self.safe = i + 1

    def _string_char(self, i: int, c: str) -> None:
        if self._hex is not None:
            self._hex += c
            if len(self._hex) == 4:
                try:
                    code = int(self._hex, 16)
                except ValueError:
                    self.bad = True
                    return
                self._hex = None
                if not 0xD800 <= code < 0xDC00:  # a high surrogate waits for its pair
                    self.safe = i + 1
        elif self._escape:
            self._escape = False
            if c == "u":
                self._hex = ""
            else:
                self.safe = i + 1
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
        else:
            self.safe = i + 1


class JsonFollower:
    """A `JsonScanner` with throttled snapshots of the parsed prefix."""

    def __init__(self) -> None:
        self.scanner = JsonScanner()
        self.settled: Any = None  # every value complete
        self.growing: Any = None  # plus the open value string, if any
        self.open_string = False
        self._cut = (-1, -1)
        self._len_at = 0
        self._stable_key: tuple = ()
        self._stable = ""

    def feed(self, chunk: str) -> str:
        """Scans `chunk` and refreshes the snapshots; returns text beyond the value."""
        rest = self.scanner.feed(chunk)
        self.refresh(force=self.scanner.end is not None)
        return rest

    def refresh(self, force: bool = False) -> None:
        s = self.scanner
        cut = (s.boundary, s.safe if s.in_value_string else -1)
        if cut == self._cut or s.bad:
            return
        if not force and len(s.text) - self._len_at < len(s.text) // 32:
            return
        if cut[0] != self._cut[0]:
            self.settled = parse_prefix(s.text[: s.boundary])
        self.open_string = s.in_value_string
        self.growing = parse_prefix(s.text[: s.safe]) if self.open_string else self.settled
        self._cut, self._len_at = cut, len(s.text)

    def stable_arguments(self, value: Any) -> str:
        """`stable_arguments` of `value` (a part of `growing`), cached per snapshot."""
        key = (self._cut, id(value))  # the snapshot keeps `value` alive: ids are unique
        if key != self._stable_key:
            self._stable_key, self._stable = key, stable_arguments(value, self.open_string)
        return self._stable

    def value(self) -> Any:
        """The whole value once the scanner has seen its end, else None."""
        return loads_lenient(self.scanner.text) if self.scanner.end is not None else None
