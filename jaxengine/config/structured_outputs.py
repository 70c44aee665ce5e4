"""StructuredOutputsConfig: the grammar backend of constrained decoding, and reasoning.

vLLM's surface: `--structured-outputs-config '{"backend": "auto", ...}'` (JSON, or
`--structured-outputs-config.backend guidance`) and `--reasoning-parser NAME`. The
JSON keys are validated here, so a typo fails at parse time naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxengine.config.utils import validate_config

STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar", "outlines")
"""vLLM's backend names; `unsupported.py` refuses those jaxengine does not run yet."""

_OPTION_DEFAULTS: dict[str, Any] = {
    "backend": "auto",
    "disable_fallback": False,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "enable_in_reasoning": False,
    "reasoning_parser": "",
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (JSON schema, regex, choice, grammar) and reasoning."""

    structured_outputs_config: dict = field(default_factory=dict)
    """Structured outputs options as JSON: "backend" ("auto", "guidance", "xgrammar",
    "outlines"; auto picks llguidance), "disable_fallback", "disable_any_whitespace"
    (compact JSON), "disable_additional_properties" (JSON objects without an
    additionalProperties keyword allow no extra keys), "enable_in_reasoning" (apply the
    constraint inside the reasoning section too), "reasoning_parser"."""
    reasoning_parser: str = ""
    """Reasoning parser of the model ("deepseek_r1", "qwen3", "glm45", or one registered by
    --reasoning-parser-plugin): the server returns the text between the think
    markers as `reasoning_content`, and structured outputs apply after it."""
    reasoning_parser_plugin: str = ""
    """A Python file (or module) that registers further reasoning parsers."""

    def __post_init__(self) -> None:
        validate_config(self)
        options = self.structured_outputs_config
        unknown = sorted(set(options) - set(_OPTION_DEFAULTS))
        if unknown:
            raise ValueError(
                f"structured_outputs_config: unknown key(s) {unknown}; "
                f"known: {sorted(_OPTION_DEFAULTS)}"
            )
        backend = options.get("backend", "auto")
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"structured_outputs_config: backend {backend!r} is not one of "
                f"{list(STRUCTURED_OUTPUT_BACKENDS)}"
            )
        for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(options.get(key, False), bool):
                raise ValueError(f"structured_outputs_config: {key} must be true or false")
        flag, key = self.reasoning_parser, options.get("reasoning_parser", "")
        if flag and key and flag != key:
            raise ValueError(
                f"--reasoning-parser {flag} and structured_outputs_config.reasoning_parser "
                f"{key} disagree"
            )

    def option(self, key: str) -> Any:
        """One option of `structured_outputs_config`, or its default."""
        return self.structured_outputs_config.get(key, _OPTION_DEFAULTS[key])

    @property
    def backend(self) -> str:
        """The backend to run: "auto" means llguidance."""
        backend = self.option("backend")
        return "guidance" if backend == "auto" else backend

    @property
    def reasoning_parser_name(self) -> str:
        """The reasoning parser from the flag or the JSON options ("" = none)."""
        return self.reasoning_parser or self.option("reasoning_parser")
