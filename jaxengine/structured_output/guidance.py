"""The llguidance backend: JSON schema, regex, choice, Lark/GBNF grammar, structural tags.

llguidance compiles lazily (its lexer and parser are built as tokens arrive), so a
compile is cheap and `validate` is llguidance's own grammar check with the model's
tokenizer: the same errors a compile would raise, before anything is queued.
The tokenizer view (`LLTokenizer`) is built once per engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxengine.structured_params import StructuredOutputsParams


class GuidanceGrammar:
    """One request's `llguidance.LLMatcher` (the `Grammar` protocol)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        return bool(self.matcher.consume_tokens(list(token_ids)))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return int(self.matcher.validate_tokens(list(token_ids)))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.matcher.deep_copy())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GuidanceBackend:
    """`GrammarBackend` on llguidance."""

    name = "guidance"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, options: dict
    ) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ImportError(
                "structured outputs backend 'guidance' needs the llguidance package "
                "(pip install llguidance)"
            ) from e
        self._ll = llguidance
        self.options = options
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_id
        )
        self._executor = llguidance.LLExecutor()

    # ------------------------------------------------------------------ grammars

    def grammar_key(self, params: StructuredOutputsParams) -> str:
        M = self._ll.LLMatcher
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = _schema(params) if kind == "json" else {"type": "object"}
            return M.grammar_from_json_schema(schema, defaults=self._json_options(params))
        if kind == "regex":
            return M.grammar_from_regex(params.regex)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        if kind == "grammar":
            text = params.grammar
            if "::=" in text:  # GBNF / EBNF (llama.cpp's and xgrammar's notation)
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    text = gbnf_to_lark(text)
                except Exception as e:  # noqa: BLE001 - the library's parse error
                    raise ValueError(f"invalid structured_outputs.grammar: {e}") from None
            return M.grammar_from_lark(text)
        return M.grammar_from_lark(self._structural_tag(params.structural_tag))

    def _json_options(self, params: StructuredOutputsParams) -> dict:
        compact = params.disable_any_whitespace or self.options.get("disable_any_whitespace")
        options: dict[str, Any] = {"whitespace_flexible": not compact}
        if compact:
            options.update(item_separator=",", key_separator=":")
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return options

    def _structural_tag(self, text: str) -> str:
        """vLLM's {"structures": [{"begin", "schema", "end"}], "triggers": [...]} as Lark."""
        try:
            spec = json.loads(text)
            tags = []
            for s in spec["structures"]:
                trigger = next(t for t in spec["triggers"] if s["begin"].startswith(t))
                tags.append(
                    self._ll.StructTag(
                        trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]
                    )
                )
            return self._ll.StructTag.to_grammar(tags)
        except (ValueError, KeyError, TypeError, StopIteration, AssertionError) as e:
            raise ValueError(
                "invalid structured_outputs.structural_tag: expected JSON "
                '{"structures": [{"begin", "schema", "end"}], "triggers": [...]} where each '
                f"begin starts with a trigger ({type(e).__name__}: {e})"
            ) from None

    def validate(self, key: str) -> None:
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(key, self.tokenizer)
        if is_error:
            raise ValueError(messages[0])

    def compile(self, key: str) -> GuidanceGrammar:
        matcher = self._ll.LLMatcher(self.tokenizer, key)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher)

    def fill_bitmasks(
        self, grammars: Sequence[tuple[GuidanceGrammar, int]], bitmask: np.ndarray
    ) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        pairs = [(g.matcher, row) for g, row in grammars]
        fill_next_token_bitmask_par(self._executor, pairs, bitmask)


def _schema(params: StructuredOutputsParams) -> dict:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON object, got {schema!r}")
    if params.disable_additional_properties:
        schema = close_objects(schema)
    return schema


_SUBSCHEMA = ("items", "contains", "not", "if", "then", "else", "additionalProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def close_objects(schema: Any) -> Any:
    """A copy where every object schema without `additionalProperties` allows none."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
