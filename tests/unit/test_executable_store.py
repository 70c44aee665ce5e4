"""`ExecutableStore`: compiled functions saved, loaded without tracing, keyed by program."""

from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.executables import ExecutableStore

# A constant new to this run: JAX's persistent cache (which an engine built earlier in
# the session may have pointed at a directory that outlives it) cannot hand the
# function back as a cache hit, which the store rightly does not save.
OFFSET = 3.0 + (time.time_ns() % 1000) / 1024


def test_store_saves_loads_without_tracing_and_recompiles_a_corrupt_file(tmp_path):
    fn = jax.jit(lambda acc, x: acc * x + OFFSET, donate_argnums=(0,))
    x = jnp.arange(5.0)
    lowered = []

    def lower():
        lowered.append(1)
        return fn.lower(jax.ShapeDtypeStruct((5,), jnp.float32), x)

    first = ExecutableStore(tmp_path, "program A").compile("fn", 5, lower)
    assert len(lowered) == 1 and len(list(tmp_path.iterdir())) == 1
    again = ExecutableStore(tmp_path, "program A").compile("fn", 5, lower)
    assert len(lowered) == 1  # loaded: neither traced nor compiled
    for compiled in (first, again):
        acc = jnp.full(5, 2.0)
        np.testing.assert_allclose(compiled(acc, x), 2.0 * np.arange(5.0) + OFFSET)
        assert acc.is_deleted()  # donation survives the round trip

    ExecutableStore(tmp_path, "program B").compile("fn", 5, lower)  # another program
    ExecutableStore(tmp_path, "program A").compile("fn", 6, lower)  # another shape key
    assert len(lowered) == 3

    for path in tmp_path.iterdir():
        path.write_bytes(b"not an executable")
    compiled = ExecutableStore(tmp_path, "program A").compile("fn", 5, lower)
    assert len(lowered) == 4
    np.testing.assert_allclose(compiled(jnp.ones(5), x), np.arange(5.0) + OFFSET)


def test_the_optimization_level_is_part_of_a_stored_programs_identity(tmp_path):
    """A program stored at JAX's minimal optimization is not loaded by an engine that
    would compile it fully optimized (tests/xla_effort.py switches between the two)."""
    from tests.xla_effort import optimized

    names = {}
    for level, context in (("as set", contextlib.nullcontext), ("optimized", optimized)):
        with context():
            names[level] = ExecutableStore(tmp_path, "program A")._path("fn", 5)
    assert jax.config.values["jax_disable_most_optimizations"]  # the tests' default, restored
    assert names["as set"] != names["optimized"]


def test_store_keeps_its_directory_under_its_size_limit(tmp_path):
    for i, age in enumerate((300, 100, 200)):  # seconds ago
        path = tmp_path / f"step-{i}.bin"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age, time.time() - age))
    ExecutableStore(tmp_path, "program", max_bytes=2000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1.bin", "step-2.bin"]


def test_a_second_cache_directory_takes_effect(tmp_path):
    """JAX opens its persistent cache once per process; an engine pointed at another
    directory must still write there (`use_compilation_cache_dir` reopens it)."""
    from jaxengine.runner.executables import use_compilation_cache_dir

    first, second = tmp_path / "first", tmp_path / "second"
    for path, scale in ((first, 3.0), (second, 5.0)):
        use_compilation_cache_dir(str(path))
        jax.jit(lambda x, s=scale: x * s + OFFSET)(jnp.arange(7.0)).block_until_ready()
        assert path.is_dir() and any(path.iterdir()), path


def test_store_saves_nothing_it_did_not_compile(tmp_path):
    """An executable handed back by JAX's persistent cache, then again by its
    in-memory cache (the same lowered module compiled twice, with no event), does not
    serialize whole: stored, it would load and then fail at its first run."""
    from jaxengine.runner.executables import use_compilation_cache_dir

    use_compilation_cache_dir(str(tmp_path / "xla"))
    x = jnp.linspace(0.0, 1.0, 6)

    def make():  # the same program, traced anew: no in-memory hit between them
        return jax.jit(lambda v: jnp.argmax(jnp.sin(v) + OFFSET * v))

    make().lower(x).compile()  # compiled: written to JAX's persistent cache
    fn = make()
    fn.lower(x).compile()  # a persistent-cache hit
    store_dir = tmp_path / "executables"
    compiled = ExecutableStore(store_dir, "program").compile("fn", 6, lambda: fn.lower(x))
    assert not store_dir.exists() or not any(store_dir.iterdir())
    assert int(compiled(x)) == 5


def test_listeners_survive_another_library_clearing_them(tmp_path):
    """Tunix's metrics logger clears every jax.monitoring listener when it closes: the
    store must still see its fresh compilations, and a compile guard still count."""
    from jaxengine.runner.compile_guard import CompileGuard

    guard = CompileGuard()
    jax.monitoring.clear_event_listeners()
    fn = jax.jit(lambda v: jnp.cos(v) * OFFSET - 1.0)
    x = jnp.linspace(0.0, 1.0, 7)
    with guard.watching():
        ExecutableStore(tmp_path, "program").compile("fn", 7, lambda: fn.lower(x))
    assert guard.total == 1 and len(list(tmp_path.iterdir())) == 1


def test_process_shared_builds_once_per_key_and_optimization_level(monkeypatch):
    from jaxengine.runner import executables
    from tests.xla_effort import optimized

    monkeypatch.setattr(executables, "_shared", type(executables._shared)())
    monkeypatch.setattr(executables, "PROCESS_PROGRAMS", 2)
    built = []

    def build(name):
        built.append(name)
        return object()

    first = executables.process_shared("a", lambda: build("a"))
    assert executables.process_shared("a", lambda: build("a again")) is first
    with optimized():  # tests run at the minimal level (tests/xla_effort.py)
        assert executables.process_shared("a", lambda: build("a other level")) is not first
    executables.process_shared("b", lambda: build("b"))  # the oldest entry goes
    assert executables.process_shared("a", lambda: build("a evicted")) is not first
    assert built == ["a", "a other level", "b", "a evicted"]
