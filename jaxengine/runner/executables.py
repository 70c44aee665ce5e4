"""Compiled step functions saved to disk, so a restart neither traces nor compiles.

JAX's persistent compilation cache skips XLA's compile on a restart, but every
bucket is still traced and lowered first: about two seconds per bucket for a
30-layer model on a CPU, most of a warm start. `ExecutableStore` keeps the compiled
executables themselves (`jax.experimental.serialize_executable`), one file per
function and shape, under ``<compilation_cache_dir>/executables``.

A stored executable is only reused by an engine that would have compiled the very
same program. The file name is a hash of:

- everything that shapes the program: the resolved `EngineConfig` (model, dtype,
  every flag), the parameters' shapes and dtypes, the function's name and static
  argument, and what changes tracing or compilation: the environment variables
  ``JAXENGINE_*``, ``JAX_*`` and ``XLA_FLAGS``, and JAX's
  ``jax_disable_most_optimizations`` however it was set;
- the code that traces it: the source of ``jaxengine``, ``pallas_kernels`` and
  ``sharding`` (so an edited checkout never runs a stale program);
- the runtime: jax and jaxlib versions, the platform and its devices.

A file that fails to load (truncated, other runtime) is compiled again and replaced.
The directory is kept under ``max_bytes`` (least recently used files go first: a
load touches its file), since every edit of the source starts a new set of files.
Only fresh compilations are stored: an executable JAX's persistent cache handed back
does not serialize whole again (XLA:CPU drops its kernels: the stored file loads, then
fails at its first run with "Function ... not found"). Such an executable also comes
back from JAX's in-memory cache when the same lowered module is compiled again, with
no event at all; so the store writes only after a backend compilation that was not a
cache hit, and otherwise the next start takes the persistent cache's path again.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pickle
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax

from jaxengine.runner.compile_guard import compile_counts

logger = logging.getLogger(__name__)

_SOURCE_PACKAGES = ("jaxengine", "pallas_kernels", "sharding")
MAX_BYTES = 2 << 30  # the store's size limit: about a hundred engine configurations
PROCESS_PROGRAMS = 256  # executables `process_shared` keeps (the least recently used go)


@functools.cache
def source_hash() -> str:
    """Hash of every Python file of the packages that trace the model."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in _SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def runtime_description() -> str:
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    env = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(("JAXENGINE_", "JAX_", "XLA_"))
    )
    runtime = (jax.__version__, jaxlib_version(), jax.default_backend(), kinds, len(devices))
    return repr((*runtime, env, jax.config.values.get("jax_disable_most_optimizations")))


class ExecutableStore:
    """Loads and saves the compiled functions of one engine configuration."""

    shareable = True  # its executables may be shared by the process's engines

    def __init__(
        self, directory: str | os.PathLike, program: str, max_bytes: int = MAX_BYTES
    ) -> None:
        """``program``: a description of everything that shapes the traced program
        (the resolved config and the parameters' shapes); the code and runtime are
        added here."""
        self.directory = Path(directory)
        base = "\n".join((program, source_hash(), runtime_description()))
        self._base = hashlib.sha256(base.encode()).hexdigest()
        self._warned = False
        _prune(self.directory, max_bytes)

    def _path(self, name: str, key: Any) -> Path:
        digest = hashlib.sha256(f"{self._base}\n{name}\n{key!r}".encode()).hexdigest()
        return self.directory / f"{name}-{digest[:40]}.bin"

    def load(self, name: str, key: Any):
        """The stored executable of function ``name`` at static ``key``, or None."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(name, key)
        if not path.exists():
            return None
        try:
            device_ids, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
            os.utime(path)  # recently used: pruned last
            return compiled
        except Exception as exc:  # a partial file, another runtime: compile again
            logger.warning("ignoring stored executable %s: %s", path.name, exc)
            return None

    def save(self, name: str, key: Any, compiled: Any) -> None:
        from jax.experimental.serialize_executable import serialize

        path = self._path(name, key)
        try:
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = pickle.dumps((devices, *serialize(compiled)))
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(blob)
            partial.replace(path)  # atomic: a reader never sees half a file
        except Exception as exc:  # a full disk or an unserializable program: only slower
            log = logger.debug if self._warned else logger.warning
            log("could not store executable %s in %s: %s", path.name, self.directory, exc)
            self._warned = True

    def compile(self, name: str, key: Any, lower) -> Any:
        """The stored executable, else ``lower().compile()`` (stored for next time)."""
        compiled = self.load(name, key)
        if compiled is None:
            compiles, hits = compile_counts()
            compiled = lower().compile()
            now_compiles, now_hits = compile_counts()
            if now_compiles > compiles and now_hits == hits:  # compiled here, not loaded
                self.save(name, key, compiled)
        return compiled


def compile_ahead(store: ExecutableStore | None, name: str, key: Any, lower) -> Any:
    """``lower().compile()``, through ``store`` when there is one."""
    if store is None:
        return lower().compile()
    return store.compile(name, key, lower)


_shared: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_shared_lock = threading.Lock()


def process_shared(key: Hashable, build: Callable[[], Any]) -> Any:
    """``build()``'s executable, built once per process for ``key`` and handed to every
    engine of the process that asks for the same key: a second `LLM` in a notebook,
    an RL loop's fresh engine, an engine's own restart skip tracing, lowering and the
    cache lookup of programs the first one compiled. ``key`` must name the whole
    program (function, shapes, placement); JAX's optimization setting is added here.
    An executable is immutable and runs on the devices it was compiled for, so
    engines can share it."""
    key = (key, jax.config.values.get("jax_disable_most_optimizations"))
    with _shared_lock:
        if (compiled := _shared.get(key)) is not None:
            _shared.move_to_end(key)
            return compiled
    compiled = build()
    with _shared_lock:
        _shared[key] = compiled
        while len(_shared) > PROCESS_PROGRAMS:
            _shared.popitem(last=False)
    return compiled


def _prune(directory: Path, max_bytes: int) -> None:
    """Deletes the least recently used files until the directory holds ``max_bytes``."""
    try:
        files = [(p.stat(), p) for p in directory.glob("*.bin")]
    except OSError:
        return
    total = sum(st.st_size for st, _ in files)
    for st, path in sorted(files, key=lambda f: f[0].st_mtime):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= st.st_size


def setup_compilation_cache(config: Any) -> None:
    """Turns on JAX's persistent compilation cache unless disabled (``config``: an
    `EngineConfig`)."""
    comp = config.compilation_config
    if not comp.enable_compilation_cache:
        return
    use_compilation_cache_dir(os.path.expanduser(comp.compilation_cache_dir))


def use_compilation_cache_dir(path: str) -> None:
    """Points JAX's persistent compilation cache at ``path`` for this process.

    JAX opens its cache once, at the first compilation after a directory is set, and
    keeps that one: a second engine in the process with another directory would
    read and write the first engine's. A changed directory therefore resets JAX's
    cache (it reopens at ``path`` on the next compilation)."""
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir not in (None, path):
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    # every executable, however quick to compile: a warm start then traces and loads
    # the sampler variants instead of compiling two dozen of them again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
