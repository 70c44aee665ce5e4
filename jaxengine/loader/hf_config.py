"""The Hugging Face config and generation defaults of a model source.

For a folder the config is ``config.json``; for a GGUF file it is what transformers'
GGUF support derives from the metadata (``AutoConfig.from_pretrained(folder,
gguf_file=...)``), built without torch by `gguf_config.gguf_hf_config`. Its result is
kept in the GGUF sidecar cache (`gguf_sidecar`); later loads read a ``config.json``
from there. Reading a config builds nothing else: the tokenizer (`jaxengine.tokenizer`)
keeps its own sidecar entry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxengine.loader.demo import card_generation_config
from jaxengine.loader.errors import CheckpointError
from jaxengine.loader.gguf_sidecar import gguf_sidecar
from jaxengine.loader.sources import ModelSource, resolve_model

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
            from jaxengine.loader.gguf_config import gguf_hf_config

            config = gguf_sidecar(
                src.gguf_file,
                "config",
                build=lambda: gguf_hf_config(src.gguf_file),
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
    that are absent are left out (``SAMPLING_FIELDS`` lists the sampling ones). A demo
    model adds the sampling its model card recommends (`demo.card_generation_config`),
    which stands in for the ``generation_config.json`` its hub folder has.
    """
    src = as_source(source)
    return {**_file_generation_config(src), **card_generation_config(src.kind, src.name)}


def _file_generation_config(src: ModelSource) -> dict[str, Any]:
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
