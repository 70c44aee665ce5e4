"""vLLM's deprecated ``--guided-decoding-*`` flags, as ``--structured-outputs-config`` keys.

vLLM 0.10.2 folded them into ``--structured-outputs-config`` (and removes them in
v0.12.0); it still reads them, with a deprecation warning:

    --guided-decoding-backend B                    -> --structured-outputs-config.backend B
    --guided-decoding-disable-fallback             -> ...disable_fallback true
    --guided-decoding-disable-any-whitespace       -> ...disable_any_whitespace true
    --guided-decoding-disable-additional-properties -> ...disable_additional_properties true

The three boolean flags take no value (true), or one (``true``/``false``), as their
older and newer vLLM spellings do. Each is warned about once, when it is parsed;
`with_guided_decoding` merges the values into the JSON options (`EngineArgs.from_cli_args`),
refusing one that contradicts a key given there too. The merged options are validated
as any (`StructuredOutputsConfig`), so an unknown backend fails the same way.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger("jaxengine.config")

GUIDED_DECODING_FLAGS: dict[str, str] = {
    "guided_decoding_backend": "backend",
    "guided_decoding_disable_fallback": "disable_fallback",
    "guided_decoding_disable_any_whitespace": "disable_any_whitespace",
    "guided_decoding_disable_additional_properties": "disable_additional_properties",
}
"""Namespace attribute of each deprecated flag -> its structured_outputs_config key."""

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE + _FALSE:
        return lowered in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _DeprecatedKey(argparse.Action):
    """Stores the value and warns that the flag is ``--structured-outputs-config.KEY``."""

    def __init__(self, option_strings: list[str], dest: str, key: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.key = key

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        logger.warning(
            "%s is deprecated, as in vLLM (removed in v0.12.0): use "
            "--structured-outputs-config.%s instead",
            option_string,
            self.key,
        )
        setattr(namespace, self.dest, values)


def add_guided_decoding_flags(group: Any) -> None:
    """Adds the four deprecated flags to ``group`` (an argparse group or parser)."""
    for dest, key in GUIDED_DECODING_FLAGS.items():
        flag = "--" + dest.replace("_", "-")
        if key == "backend":
            value: dict[str, Any] = {"type": str, "metavar": "BACKEND"}
        else:
            value = {"type": _bool, "nargs": "?", "const": True, "metavar": "BOOL"}
        group.add_argument(
            flag,
            dest=dest,
            default=None,
            action=_DeprecatedKey,
            key=key,
            help=f"[DEPRECATED] --structured-outputs-config.{key}",
            **value,
        )


def with_guided_decoding(options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``options`` (``--structured-outputs-config``) with the deprecated flags found
    on ``args`` merged in; ValueError when one disagrees with the same key in
    ``options``."""
    merged = dict(options)
    for dest, key in GUIDED_DECODING_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if key in options and options[key] != value:
            raise ValueError(
                f"structured_outputs_config: --{dest.replace('_', '-')} {value} and "
                f"--structured-outputs-config.{key} {options[key]} disagree"
            )
        merged[key] = value
    return merged
