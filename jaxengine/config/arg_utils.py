"""argparse helpers for vLLM-style flags: human-readable ints, JSON flags, --config.

`FlexibleArgumentParser` rewrites its argv before argparse sees it:
- `--max_num_seqs 8` is read as `--max-num-seqs 8` (underscores in flag names);
- `--config file.yaml` is replaced by the file's flags, placed first so that flags
  given explicitly on the command line override the file;
- `--hf-overrides.a.b 1 --hf-overrides.c+ x` become one `--hf-overrides '{...}'`
  (merged into a JSON value given with the plain flag, if any).
It also runs post-parse checks (cross-field validation) and reports their
ValueErrors as ordinary argparse errors (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT]?)$")
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_human_int(text: str) -> int:
    """Parses "1k" -> 1000, "1K" -> 1024, "25.6k" -> 25600, "2M" -> 2097152, "512" -> 512.

    Lowercase suffixes are decimal (powers of 1000), uppercase binary (of 1024).
    """
    match = _HUMAN_INT.match(text.strip())
    if not match:
        raise ValueError(f"invalid integer {text!r}; use e.g. 4096, 4k or 4K")
    number, suffix = match.groups()
    if suffix.isupper():
        mult = 1024 ** (" KMGT".index(suffix))
    else:
        mult = _MULTIPLIERS[suffix]
    value = float(number) * mult if "." in number else int(number) * mult
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def parse_json(text: str) -> Any:
    """Parses a JSON flag value; a readable error when it is not valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON {text!r}: {e.msg}") from None


def _parse_scalar(text: str) -> Any:
    """A dotted-flag value: JSON when it parses (1, true, [..]), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(target: dict, keys: list[str], value: str, append: bool) -> None:
    """Sets target[k0][k1]... = value, or appends comma-split items if `append`."""
    for key in keys[:-1]:
        node = target.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set key {key!r}: it already holds {node!r}")
        target = node
    last = keys[-1]
    if not append:
        target[last] = _parse_scalar(value)
        return
    items = target.setdefault(last, [])
    if not isinstance(items, list):
        raise ValueError(f"cannot append to key {last!r}: it holds {items!r}")
    items.extend(_parse_scalar(v) for v in value.split(","))


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser with vLLM's conveniences (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._post_parse_checks: list[Callable[[argparse.Namespace], None]] = []

    def add_post_parse_check(self, check: Callable[[argparse.Namespace], None]) -> None:
        """Registers `check(namespace)`; a ValueError it raises becomes a parse error."""
        self._post_parse_checks.append(check)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        try:
            argv = self._expand_config_file(self._normalize_flags(argv))
            argv = self._merge_dotted_json(argv)
        except ValueError as e:
            self.error(str(e))
        namespace, extras = super().parse_known_args(argv, namespace)
        for check in self._post_parse_checks:
            try:
                check(namespace)
            except ValueError as e:
                self.error(str(e))
        return namespace, extras

    def error(self, message: str) -> typing.NoReturn:
        """Prints the error and a pointer to --help (not the long usage); exits 2."""
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for the options)\n")

    def _owns(self, flag: str) -> bool:
        return flag in self._option_string_actions

    def _normalize_flags(self, argv: list[str]) -> list[str]:
        """`--a_b.c_d=v` -> `--a-b.c_d=v`: underscores only in the flag's own name."""
        out = []
        for arg in argv:
            if arg == "--":
                out.extend(argv[len(out) :])
                break
            if arg.startswith("--"):
                name, sep, rest = arg[2:].partition("=")
                head, dot, tail = name.partition(".")
                arg = "--" + head.replace("_", "-") + dot + tail + sep + rest
            out.append(arg)
        return out

    def _expand_config_file(self, argv: list[str]) -> list[str]:
        """Replaces `--config PATH` by the YAML file's flags, put before the others."""
        if not self._owns("--config"):
            return argv
        path, rest, i = None, [], 0
        while i < len(argv):
            arg = argv[i]
            if arg == "--config" and i + 1 < len(argv):
                path, i = argv[i + 1], i + 2
                continue
            if arg.startswith("--config="):
                path = arg.split("=", 1)[1]
            else:
                rest.append(arg)
            i += 1
        if path is None:
            return argv
        return self._config_file_args(path) + rest

    def _config_file_args(self, path: str) -> list[str]:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--config: cannot read {path!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {path!r} must hold a mapping of flag names to values")
        args: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            if not self._owns(flag):
                raise ValueError(f"--config: unknown option {key!r} in {path!r}")
            action = self._option_string_actions[flag]
            if isinstance(value, bool):
                if isinstance(action, argparse.BooleanOptionalAction):
                    args.append(flag if value else "--no-" + flag[2:])
                elif value:
                    args.append(flag)
            elif isinstance(value, dict):
                args += [flag, json.dumps(value)]
            elif isinstance(value, list) and action.nargs in ("+", "*"):
                args += [flag, *map(str, value)]
            elif value is not None:
                args += [flag, json.dumps(value) if isinstance(value, list) else str(value)]
        return args

    def _merge_dotted_json(self, argv: list[str]) -> list[str]:
        """Folds `--x.key v` / `--x.key+ v` into one `--x JSON` at the first x's place."""
        merged: dict[str, dict] = {}
        out: list[Any] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg == "--":
                out.extend(argv[i:])
                break
            name, has_eq, inline = arg.partition("=")
            flag = name.partition(".")[0]
            if not (arg.startswith("--") and self._owns(flag) and self._is_json_flag(flag)):
                out.append(arg)
                i += 1
                continue
            if has_eq:
                value, i = inline, i + 1
            else:
                value, i = (argv[i + 1] if i + 1 < len(argv) else None), i + 2
            target = merged.get(flag)
            if target is None:
                target = merged[flag] = {}
                out.append(("json", flag))
            self._fold(flag, name, value, target)
        flat: list[str] = []
        for item in out:
            flat += [item[1], json.dumps(merged[item[1]])] if isinstance(item, tuple) else [item]
        return flat

    def _is_json_flag(self, flag: str) -> bool:
        return getattr(self._option_string_actions[flag], "type", None) is parse_json_flag

    def _fold(self, flag: str, name: str, value: str | None, target: dict) -> None:
        if value is None:
            raise ValueError(f"argument {flag}: expected a value")
        if "." not in name:
            try:
                parsed = parse_json(value)
            except ValueError as e:
                raise ValueError(f"argument {flag}: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"argument {flag}: expected a JSON object, got {value!r}")
            target.update(parsed)
            return
        keys = name.split(".")[1:]
        append = keys[-1].endswith("+")
        keys[-1] = keys[-1].removesuffix("+")
        if not all(keys):
            raise ValueError(f"argument {flag}: empty key in {name!r}")
        try:
            _set_dotted(target, keys, value, append)
        except ValueError as e:
            raise ValueError(f"argument {flag}: {e}") from None


def parse_json_flag(text: str) -> Any:
    """argparse `type` for dict-valued flags (marks them for dotted-key merging)."""
    try:
        return parse_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
