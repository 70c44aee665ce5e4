"""Every config field is read by the engine or refused: no flag parses and does nothing.

Walks every field of every config dataclass (recursively from `EngineConfig`) and
requires one of:

* a read outside `jaxengine/config/` (and outside `engine_args.py`, which only copies
  fields by name) in `jaxengine/`, `server/`, `sharding/` or `torch_fallback/`: an
  attribute access ``holder.field`` where ``holder`` is known to hold that config
  class: its `EngineConfig` field name (``cache_config``), a name assigned from one
  (``cc = config.cache_config``), or a name annotated with the class
  (``parallel: ParallelConfig``). A public property or method of the class that
  reads the field (``served_model_names``, ``cache_dtype(...)``) counts as a read of
  it when it is itself read that way. A field name on any other object
  (``params.seed``, ``self.tokenizer``) does not count;
* a row of `config/unsupported.py`'s UNSUPPORTED table for its flag whose getter
  returns the field (probed with a sentinel value);
* an entry of `ALLOWED` below, with the reason and the text it must find.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxengine.config import EngineConfig
from jaxengine.config.unsupported import UNSUPPORTED
from jaxengine.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("jaxengine", "server", "sharding", "torch_fallback")
NOT_SCANNED = (ROOT / "jaxengine" / "config", ROOT / "jaxengine" / "engine_args.py")

ALLOWED: dict[str, tuple[str, str, str]] = {
    "master_port": (
        "sharding/distributed.py",
        "args.master_port",
        "initialize_for(args) reads the multi-node flags from a ParallelConfig or an "
        "EngineArgs, so its parameter is untyped",
    ),
}
"""field -> (file, text it must contain, why the scan cannot see the read)."""


def config_classes() -> dict[type, str]:
    """Every config dataclass reachable from EngineConfig -> the field name holding it."""
    found: dict[type, str] = {EngineConfig: "config"}
    todo = [EngineConfig]
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for tp in _members(hints[f.name]):
                if dataclasses.is_dataclass(tp) and tp not in found:
                    found[tp] = f.name
                    todo.append(tp)
    return found


def _members(tp: typing.Any) -> tuple:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def all_fields() -> list[tuple[type, str]]:
    return [(cls, f.name) for cls in config_classes() for f in dataclasses.fields(cls)]


# --- which names of a class read which fields -------------------------------------


@functools.cache
def accessors(cls: type) -> dict[str, set[str]]:
    """field -> the attribute names whose read reads it: the field itself and the
    public properties/methods of ``cls`` that read it (transitively)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    reads: dict[str, set[str]] = {}
    for node in tree.body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            reads[node.name] = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            }
    names = {f.name: {f.name} for f in dataclasses.fields(cls)}
    changed = True
    while changed:
        changed = False
        for member, attrs in reads.items():
            for via in names.values():
                if member not in via and via & attrs:
                    via.add(member)
                    changed = True
    return names


# --- reads in the source ---------------------------------------------------------


def _terminal(node: ast.AST) -> str | None:
    """The last name of an expression: ``a.b.c`` -> "c", ``x`` -> "x", ``a[0]`` -> "a"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _terminal(node.value)
    return None


def _annotated_with(annotation: ast.AST | None, class_name: str) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if _terminal(node) == class_name:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if class_name in node.value.replace("|", " ").split():
                return True
    return False


def _pairs(target: ast.AST, value: ast.AST | None) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """(target, value) pairs of an assignment, element-wise for tuples."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        if len(target.elts) == len(value.elts):
            yield from zip(target.elts, value.elts, strict=True)
            return
    yield target, value


def holders(tree: ast.AST, cls: type, canonical: str) -> set[str]:
    """Names that hold a ``cls`` in this module (see the module docstring)."""
    names = {canonical}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _annotated_with(node.annotation, cls.__name__):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign):
            if _annotated_with(node.annotation, cls.__name__):
                names.add(_terminal(node.target) or "")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for t, v in _pairs(target, node.value):
                    if v is not None and _terminal(v) == canonical:
                        names.add(_terminal(t) or "")
    names.discard("")
    return names


def reads_in_source(source: str) -> set[tuple[str, str]]:
    """(config class name, field) pairs that ``source`` reads through a holder."""
    tree = ast.parse(source)
    found = set()
    for cls, canonical in config_classes().items():
        names = holders(tree, cls, canonical)
        by_attr: dict[str, set[str]] = {}
        for field, via in accessors(cls).items():
            for attr in via:
                by_attr.setdefault(attr, set()).add(field)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in by_attr:
                if _terminal(node.value) in names:
                    found |= {(cls.__name__, f) for f in by_attr[node.attr]}
    return found


def _scanned_files() -> Iterator[Path]:
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not any(path == p or p in path.parents for p in NOT_SCANNED):
                yield path


@functools.cache
def reads_in_project() -> frozenset[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in _scanned_files():
        found |= reads_in_source(path.read_text())
    return frozenset(found)


# --- refusals --------------------------------------------------------------------


def refused_fields() -> set[tuple[str, str]]:
    """(class name, field) of the table rows whose getter returns that field."""
    sentinel = object()
    refused = set()
    for flag, get, _ in UNSUPPORTED:
        name = flag.removeprefix("--").partition(".")[0].replace("-", "_")
        for cls, canonical in config_classes().items():
            if cls is EngineConfig or name not in {f.name for f in dataclasses.fields(cls)}:
                continue
            probe = types.SimpleNamespace(**{canonical: types.SimpleNamespace(**{name: sentinel})})
            try:
                if get(probe) is sentinel:
                    refused.add((cls.__name__, name))
            except AttributeError:  # the row reads something else (e.g. an option key)
                pass
    return refused


def _allowed(field: str) -> bool:
    if field not in ALLOWED:
        return False
    file, text, _ = ALLOWED[field]
    return text in (ROOT / file).read_text()


# --- tests -----------------------------------------------------------------------


def test_every_config_field_is_read_or_refused():
    reads, refused = reads_in_project(), refused_fields()
    idle = [
        f"{cls.__name__}.{name}"
        for cls, name in all_fields()
        if (cls.__name__, name) not in reads | refused and not _allowed(name)
    ]
    assert not idle, (
        f"config fields that parse but are never read outside jaxengine/config/: {idle}. "
        "Read them, or add a row to jaxengine/config/unsupported.py"
    )


def test_the_walk_reaches_every_config_class():
    names = {cls.__name__ for cls in config_classes()}
    assert {"ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig"} <= names
    walked = {name for cls, name in all_fields() if cls is not EngineConfig}
    assert walked == {f.name for f in dataclasses.fields(EngineArgs)}


def test_allow_list_entries_are_still_needed_and_true():
    reads = {name for _, name in reads_in_project()}
    for field, (file, text, _) in ALLOWED.items():
        assert text in (ROOT / file).read_text(), f"{field}: {text!r} gone from {file}"
        assert field not in reads, f"{field} is now seen by the scan: drop it from ALLOWED"


SAMPLE = """
def run(config, params, tokenizer, mc: "ModelConfig", parallel: ParallelConfig | None):
    cc, sc = config.cache_config, config.scheduler_config
    self.options = config.structured_outputs_config
    params.seed, tokenizer.tokenizer, self.model.dtype  # not config reads
    cc.block_size, sc.max_num_seqs, mc.max_logprobs
    config.model_config.served_model_names  # a property: reads two fields
    parallel.world_size
    self.options.reasoning_parser_name
    cc.cache_dtype("bfloat16")
"""


def test_the_scan_sees_reads_through_holders_only():
    found = reads_in_source(SAMPLE)
    assert found == {
        ("EngineConfig", "cache_config"),
        ("EngineConfig", "scheduler_config"),
        ("EngineConfig", "structured_outputs_config"),
        ("EngineConfig", "model_config"),
        ("CacheConfig", "block_size"),
        ("CacheConfig", "kv_cache_dtype"),
        ("SchedulerConfig", "max_num_seqs"),
        ("ModelConfig", "max_logprobs"),
        ("ModelConfig", "served_model_name"),
        ("ModelConfig", "model"),
        ("ParallelConfig", "tensor_parallel_size"),
        ("ParallelConfig", "pipeline_parallel_size"),
        ("StructuredOutputsConfig", "reasoning_parser"),
        ("StructuredOutputsConfig", "structured_outputs_config"),
    }


def test_refusals_are_probed_through_their_getters():
    refused = refused_fields()
    assert ("ModelConfig", "code_revision") in refused
    assert ("ModelConfig", "quantization") in refused
    assert ("CacheConfig", "kv_cache_dtype") in refused  # its value fp8_inc
    # the row for a key of structured_outputs_config does not refuse the whole field
    assert ("StructuredOutputsConfig", "structured_outputs_config") not in refused


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--code-revision", "x"], "--code-revision x is not supported yet"),
        (["--num-lookahead-slots", "2"], "--num-lookahead-slots 2 is not supported yet"),
    ],
)
def test_refused_flags_raise_naming_the_flag(argv, message):
    from jaxengine.config.arg_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    with pytest.raises(NotImplementedError, match=message):
        args.create_engine_config()
