"""StructuredOutputsParams: one constraint on a request's output (vLLM's class and
field names), validated at construction; `SamplingParams.structured_outputs` holds
it. Pure Python, no jax."""

from __future__ import annotations

from dataclasses import dataclass

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's `StructuredOutputsParams`).

    Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` and
    `structural_tag` is set; the rest are options of that constraint. The grammar
    itself is checked (and compiled) by the engine's structured-output backend when
    the request arrives: a bad schema, regex or grammar is a ValueError there.
    """

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text) the output must follow."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: Lark or EBNF (GBNF) text."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    structural_tag: str | None = None
    """A structural tag (JSON text): free text with constrained tagged regions."""
    disable_fallback: bool = False
    """Do not fall back to another backend when the chosen one cannot compile this."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact output)."""
    disable_additional_properties: bool = False
    """JSON objects without `additionalProperties` allow no keys beyond `properties`."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace allowed between JSON tokens."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "You must use one kind of structured outputs constraint but "
                f"{'none' if not given else ', '.join(given)} were specified: set exactly one "
                f"of {', '.join(_CONSTRAINTS)}."
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                f"structured_outputs.json must be a dict or a string, got {self.json!r}."
            )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}.")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of strings, "
                f"got {self.choice!r}."
            )

    @property
    def kind(self) -> str:
        """The name of the one constraint that is set."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))
