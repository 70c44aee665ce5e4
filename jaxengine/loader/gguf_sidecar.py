"""A cache of the config and tokenizer derived from a GGUF file, kept as files.

A GGUF model's config and tokenizer are built from the file's metadata
(`gguf_config`, the way transformers builds them): 0.1-0.3 s for the config, and for
the tokenizer 0.3 s for SmolLM2 but 7 s for Gemma 3, whose merges are derived from
its 262k-token vocabulary, each time. `gguf_sidecar` keeps the result of such a build
in a folder under the models cache keyed by the file's path, size, modification time
and the transformers version (whose tables and converters the build uses), so later
loads read a ``config.json`` or ``tokenizer.json`` in milliseconds. The config
(`hf_config`) and the tokenizer (`jaxengine.tokenizer`) each keep their own entry and
build it independently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from jaxengine.loader.demo import models_cache_dir

logger = logging.getLogger(__name__)

T = TypeVar("T")


def gguf_sidecar(
    gguf_file: Path,
    what: str,
    *,
    build: Callable[[], T],
    save: Callable[[T, Path], None],
    load: Callable[[Path], T],
) -> T:
    """``build()``'s result for ``gguf_file``, cached as files in a sidecar folder.

    A hit calls ``load(folder)``; a miss calls ``build()`` and ``save(obj, tmp)`` into
    a temporary folder renamed into place, so a half-written entry is never read.
    Caching is skipped (with a debug log) if the cache cannot be written, and off
    when ``JAXENGINE_GGUF_SIDECAR=0``.
    """
    if not sidecar_enabled():
        return build()
    folder = sidecar_folder(gguf_file, what)
    if folder.is_dir():
        try:
            return load(folder)
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable GGUF sidecar cache %s: %s", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    obj = build()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{what}-", dir=folder.parent))
        try:
            save(obj, tmp)
            tmp.rename(folder)
        except OSError:  # another process won the race, or a full disk
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.debug("not caching GGUF %s of %s: %s", what, gguf_file, e)
    return obj


def sidecar_enabled() -> bool:
    """Whether the cache is on (``JAXENGINE_GGUF_SIDECAR`` is not "0")."""
    return os.environ.get("JAXENGINE_GGUF_SIDECAR", "1") != "0"


def sidecar_folder(gguf_file: Path, what: str) -> Path:
    """Where `gguf_sidecar` keeps ``what`` for ``gguf_file`` (it may not exist yet)."""
    return models_cache_dir() / ".gguf-sidecar" / _sidecar_key(gguf_file) / what


def _sidecar_key(gguf_file: Path) -> str:
    import transformers

    stat = gguf_file.stat()
    ident = f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return f"{gguf_file.stem[:60]}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
