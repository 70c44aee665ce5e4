"""Helpers shared by the config dataclasses: field specs, docstrings and validation.

Every config class is a frozen dataclass whose fields are declared with `spec()`
(a thin wrapper over `dataclasses.field` that records numeric bounds and CLI hints
in the field metadata) and documented by a string literal on the line after the
field. `validate_config()` checks every field against its annotation and bounds in
`__post_init__`; `check_field()` runs the same check on one value, which is how
`EngineArgs` rejects a bad flag at parse time. Plain Python only: no jax here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

_MISSING = dataclasses.MISSING


def spec(
    default: Any = _MISSING,
    *,
    default_factory: Callable[[], Any] | Any = _MISSING,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    human_readable: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field with bounds and CLI hints kept in its metadata.

    `gt/ge/lt/le` bound numeric values (None values are not bounded);
    `human_readable` lets the flag take "1k"/"1K"-style integers; `aliases` are
    extra flag spellings such as "-tp".
    """
    meta = {"gt": gt, "ge": ge, "lt": lt, "le": le}
    meta.update(human_readable=human_readable, aliases=aliases)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Maps each field of `cls` to its attribute docstring (the string after it)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped (e.g. a .pyc-only install)
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            if isinstance(nxt.value.value, str):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type annotations of the dataclass fields of `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def config_field(cls: type, name: str) -> dataclasses.Field:
    """The `dataclasses.Field` called `name` of `cls` (KeyError if absent)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def field_default(cls: type, name: str) -> Any:
    """The default value of field `name` of `cls` (a fresh one for factories)."""
    f = config_field(cls, name)
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return f.default


def union_args(tp: Any) -> tuple[Any, ...]:
    """The members of a union type, or `(tp,)` for a non-union type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def literal_choices(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values if `tp` is a Literal (or Literal | None), else None."""
    choices: list[Any] = []
    for arg in union_args(tp):
        if typing.get_origin(arg) is Literal:
            choices.extend(typing.get_args(arg))
        elif arg is not type(None):
            return None
    return tuple(choices) or None


def _matches(value: Any, tp: Any) -> bool:
    """Whether `value` fits annotation `tp` (shallow for containers)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return isinstance(value, list | tuple) and all(_matches(v, item) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_field(cls: type, name: str, value: Any) -> None:
    """Raises ValueError naming `name` if `value` is not valid for that field.

    Checks the annotation (type, Literal choices) and the bounds given to `spec()`.
    Cross-field rules live in each class's `__post_init__`.
    """
    tp = field_types(cls)[name]
    choices = literal_choices(tp)
    if not _matches(value, tp):
        if choices is not None:
            raise ValueError(
                f"{name}={value!r} is invalid; choose from {', '.join(map(repr, choices))}"
            )
        raise ValueError(f"{name} must be of type {_type_name(tp)}, got {value!r}")
    if value is None or isinstance(value, bool):
        return
    meta = config_field(cls, name).metadata
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if not isinstance(v, int | float):
            continue
        for key, ok, word in (
            ("gt", lambda a, b: a > b, ">"),
            ("ge", lambda a, b: a >= b, ">="),
            ("lt", lambda a, b: a < b, "<"),
            ("le", lambda a, b: a <= b, "<="),
        ):
            bound = meta.get(key)
            if bound is not None and not ok(v, bound):
                raise ValueError(f"{name} must be {word} {bound}, got {v!r}")


def validate_config(obj: Any) -> None:
    """Runs `check_field` on every field of the dataclass instance `obj`."""
    for f in dataclasses.fields(obj):
        check_field(type(obj), f.name, getattr(obj, f.name))


def require(cond: bool, name: str, message: str) -> None:
    """Raises ValueError("<name>: <message>") unless `cond` holds."""
    if not cond:
        raise ValueError(f"{name}: {message}")
