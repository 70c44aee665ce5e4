"""Loading a model's Hugging Face tokenizer, from a folder or from a GGUF file.

A GGUF file carries its vocabulary, merges and chat template in its metadata;
`jaxengine.loader.gguf_config.gguf_tokenizer` turns them into the fast tokenizer
transformers would build (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``),
without torch. That conversion is slow for large vocabularies (7 s for Gemma 3's 262k
tokens, whose merges are derived from the vocabulary), so its result is saved once in
the GGUF sidecar cache (`jaxengine.loader.gguf_sidecar`) and reloaded from there
afterwards. The model's config keeps its own entry there; neither builds the other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxengine.loader.sources import ModelSource

# `jaxengine.loader` is imported inside the functions: its package imports jax, and
# the tokenizer is host-side code (server processes, detokenization) that need not.

TOKENIZER_MODES = ("auto", "hf", "slow")


def get_tokenizer(
    source: ModelSource | str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    tokenizer_mode: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The ``transformers`` tokenizer of ``source``, or of ``tokenizer`` when given.

    ``tokenizer`` (vLLM's ``--tokenizer``) and a ``source`` given as a name are
    resolved like a model (local path, demo name, hub id at ``revision``).
    ``tokenizer_mode``: ``auto``/``hf`` (fast tokenizer) or ``slow``.
    """
    from jaxengine.loader.errors import CheckpointError
    from jaxengine.loader.sources import ModelSource, resolve_model

    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode {tokenizer_mode!r} is not supported; use one of {TOKENIZER_MODES}"
        )
    if tokenizer is not None:
        src = resolve_model(tokenizer, revision=revision)
    elif isinstance(source, ModelSource):
        src = source
    else:
        src = resolve_model(source, revision=revision)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if tokenizer_mode == "slow":
        kwargs["use_fast"] = False
    try:
        return _load(src, kwargs)
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        where = src.gguf_file or src.path
        raise CheckpointError(f"{where}: cannot load the tokenizer: {e}") from e


def _load(src: ModelSource, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    from jaxengine.loader.gguf_config import gguf_tokenizer
    from jaxengine.loader.gguf_sidecar import gguf_sidecar

    if src.gguf_file is None:
        return AutoTokenizer.from_pretrained(src.path, **kwargs)
    gguf_file = src.gguf_file
    return gguf_sidecar(
        gguf_file,
        "tokenizer" if "use_fast" not in kwargs else "tokenizer-slow",
        build=lambda: gguf_tokenizer(gguf_file, **kwargs),
        save=lambda tok, folder: tok.save_pretrained(folder),
        load=lambda folder: AutoTokenizer.from_pretrained(folder, **kwargs),
    )
