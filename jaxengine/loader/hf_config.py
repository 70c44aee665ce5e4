"""The Hugging Face config and generation defaults of a model source.

For a folder the config is ``config.json``; for a GGUF file it is what transformers'
own GGUF support derives from the metadata (``AutoConfig.from_pretrained(folder,
gguf_file=...)``). That derivation parses the whole file header with
``gguf.GGUFReader`` and takes 5 s for SmolLM2 and 20 s for Gemma 3 (its 262k-token
vocabulary), so its result is kept in a sidecar cache (`gguf_sidecar`), keyed by the
file's path, size, modification time and the transformers version; later loads read
a ``config.json`` from there in milliseconds. The tokenizer uses the same cache, and
a cold config build fills the tokenizer's entry too, sharing one parse of the header
(`shared_gguf_reader`) where transformers would otherwise make three.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from jaxengine.loader.demo import models_cache_dir
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.sources import ModelSource, resolve_model

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Generation defaults a server may apply (vLLM's `--generation-config auto`).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_TOKEN_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")
# GGUF keys: general.sampling.* -> generation config fields.
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def as_source(source: ModelSource | str | os.PathLike) -> ModelSource:
    """``source`` itself, or the resolution of a model name or path."""
    return source if isinstance(source, ModelSource) else resolve_model(source)


def load_hf_config(
    source: ModelSource | str | os.PathLike,
    *,
    hf_overrides: Mapping[str, Any] | Callable[[Any], Any] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The model's ``transformers.PretrainedConfig``, with ``hf_overrides`` applied.

    ``hf_overrides`` is a mapping (nested mappings merge into dict attributes and
    sub-configs such as ``text_config``) or, as in vLLM, a function taking and
    returning the config. Unknown architectures are not checked here.
    """
    from transformers import AutoConfig

    src = as_source(source)
    try:
        if src.gguf_file is None:
            config = AutoConfig.from_pretrained(src.path, trust_remote_code=trust_remote_code)
        else:
            config = gguf_sidecar(
                src.gguf_file,
                "config",
                build=lambda: _build_gguf_config(src),
                save=lambda cfg, folder: cfg.save_pretrained(folder),
                load=lambda folder: AutoConfig.from_pretrained(folder),
            )
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{src.gguf_file or src.path}: cannot read the config: {e}") from e
    if callable(hf_overrides):
        return hf_overrides(config)
    if hf_overrides:
        apply_overrides(config, hf_overrides)
    return config


def _build_gguf_config(src: ModelSource) -> Any:
    """transformers' config for a GGUF file; fills the tokenizer's sidecar on the way."""
    from transformers import AutoConfig

    with shared_gguf_reader():
        config = AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file.name)
        if _sidecar_enabled() and not sidecar_folder(src.gguf_file, "tokenizer").is_dir():
            try:  # the engine asks for the tokenizer next: build it on the same parse
                from jaxengine.tokenizer.loader import get_tokenizer

                get_tokenizer(src)
            except Exception as e:  # best effort: get_tokenizer reports it when called
                logger.debug("could not pre-build the tokenizer of %s: %s", src.gguf_file, e)
    return config


_READER_LOCK = threading.RLock()


@contextlib.contextmanager
def shared_gguf_reader() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once.

    transformers creates a fresh ``gguf.GGUFReader`` for a GGUF model's config, again
    to pick its tokenizer class, and again for its tensors; each parse of Gemma 3's
    header takes some 20 s. Readers are read-only, so one per path is shared. The
    module attribute is patched for the block only (restored on exit), under a lock;
    nested blocks share the outer one. Parsed readers are dropped on exit.
    """
    import gguf

    with _READER_LOCK:
        original = gguf.GGUFReader
        if getattr(original, "_jaxengine_shared", False):
            yield
            return
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        reader._jaxengine_shared = True  # type: ignore[attr-defined]
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = original
            readers.clear()


def apply_overrides(config: Any, overrides: Mapping[str, Any]) -> None:
    """Sets ``overrides`` on ``config`` in place; nested mappings merge recursively."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and hasattr(current, "to_dict"):  # a sub-config
            apply_overrides(current, value)
        elif isinstance(value, Mapping) and isinstance(current, dict):
            setattr(config, key, _merged(current, value))
        else:
            setattr(config, key, value)


def _merged(base: dict, update: Mapping) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def load_generation_config(source: ModelSource | str | os.PathLike) -> dict[str, Any]:
    """Generation defaults: token ids (``eos_token_id`` an int or a list) and sampling.

    From ``generation_config.json`` when the folder has one, else ``config.json``;
    for GGUF from the metadata: ``tokenizer.ggml.eos_token_id`` plus the end-of-turn
    ids (``eot``/``eom``) a chat model stops on, and ``general.sampling.*``. Fields
    that are absent are left out (``SAMPLING_FIELDS`` lists the sampling ones).
    """
    src = as_source(source)
    if src.gguf_file is not None:
        return _gguf_generation_config(src.gguf_file)
    for name in ("generation_config.json", "config.json"):
        file = src.path / name
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except ValueError as e:
                raise CheckpointError(f"{file}: invalid JSON ({e})") from e
            if name == "config.json" and "eos_token_id" not in data:
                data = {**data.get("text_config", {}), **data}
            fields = (*_TOKEN_FIELDS, *SAMPLING_FIELDS)
            return {k: data[k] for k in fields if data.get(k) is not None}
    return {}


def _gguf_generation_config(gguf_file: Path) -> dict[str, Any]:
    from jaxengine.loader.gguf_io import gguf_metadata

    md = gguf_metadata(gguf_file)
    out: dict[str, Any] = {}
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                           "tokenizer.ggml.eom_token_id") if k in md]  # fmt: skip
    eos = list(dict.fromkeys(int(i) for i in eos))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, field in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{field}_token_id" in md:
            out[key] = int(md[f"tokenizer.ggml.{field}_token_id"])
    for key, field in _GGUF_SAMPLING.items():
        if key in md:
            out[field] = md[key]
    return out


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
    if not _sidecar_enabled():
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


def _sidecar_enabled() -> bool:
    return os.environ.get("JAXENGINE_GGUF_SIDECAR", "1") != "0"


def sidecar_folder(gguf_file: Path, what: str) -> Path:
    """Where `gguf_sidecar` keeps ``what`` for ``gguf_file`` (it may not exist yet)."""
    return models_cache_dir() / ".gguf-sidecar" / _sidecar_key(gguf_file) / what


def _sidecar_key(gguf_file: Path) -> str:
    import transformers

    stat = gguf_file.stat()
    ident = f"{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return f"{gguf_file.stem[:60]}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
