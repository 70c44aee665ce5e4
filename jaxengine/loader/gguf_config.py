"""A GGUF file's Hugging Face config and fast tokenizer, built from its metadata without torch.

transformers derives both from the file (``AutoConfig.from_pretrained(folder,
gguf_file=...)``, the same for ``AutoTokenizer``) in ``load_gguf_checkpoint``, which
refuses to run without torch although it reads no tensor. Here the same derivation
runs on the header `gguf_io.read_gguf_header` parses (0.1 s for SmolLM2, 0.3 s for
Gemma 3's 262k-token vocabulary, against 4 s and 11 s through ``gguf.GGUFReader``),
with transformers' own tables and converters, none of which needs torch:

- config: each metadata key is renamed with ``GGUF_CONFIG_MAPPING`` (under
  ``<architecture>.``, ``general.`` and ``tokenizer.``), over the architecture's
  ``GGUF_CONFIG_DEFAULTS_MAPPING``; then load_gguf_checkpoint's adjustments for these
  architectures: llama.cpp's ``qwen3moe`` is transformers' ``qwen3_moe`` (in keys and
  string values), a ``llama`` file named ``mistral`` is ``mistral``, embeddings are
  tied when the file has no ``output.weight``, a Gemma 3 file holds the text model
  only (``gemma3_text``), and a file with no ``vocab_size`` takes its token count.
- tokenizer: the ``tokenizer.*`` fields are grouped with ``GGUF_TOKENIZER_MAPPING``
  (special tokens by their ids, BOS added by default to a sentencepiece vocabulary, as
  llama.cpp does) and ``convert_gguf_tokenizer`` builds the backend; the class is the
  one AutoTokenizer picks for the config's model type.

tests/unit/test_gguf_config.py checks both equal transformers' on the real SmolLM2
and Gemma 3 files and on small files of the other architectures. Only the file is
read: files beside it (a ``tokenizer.json``) are not, where transformers' GGUF path
would let them in. Architectures outside `BUILT_ARCHS`, and a transformers older than
its ``integrations.gguf`` tokenizer module, take transformers' own path, which needs
torch (`jaxengine.extras.require_torch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxengine.extras import require_torch
from jaxengine.loader.gguf_io import SUPPORTED_GGUF_ARCHS, GGUFHeader, read_gguf_header

BUILT_ARCHS = SUPPORTED_GGUF_ARCHS
"""The architectures built here: the ones jaxengine loads from GGUF."""
# llama.cpp's architecture name -> transformers' (load_gguf_checkpoint's renames)
_HF_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# model types whose GGUF file holds the text model only
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
# tokenizer fields naming a special token -> the metadata key of its id
_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_hf_config(gguf_file: Path) -> Any:
    """The ``PretrainedConfig`` transformers derives from ``gguf_file``.

    Raises ValueError for an architecture transformers' tables do not cover (as
    transformers does), ImportError for one outside `BUILT_ARCHS` without torch.
    """
    header = read_gguf_header(gguf_file)
    if header.architecture not in BUILT_ARCHS:
        require_torch(f"the config of a GGUF file of architecture {header.architecture!r}")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    from transformers import CONFIG_MAPPING

    config = gguf_config_dict(header)
    if config["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"transformers has no config class for {config['model_type']!r}")
    return CONFIG_MAPPING[config["model_type"]].from_dict(
        config, name_or_path=str(gguf_file.parent)
    )


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The config dict of load_gguf_checkpoint for this header (module docstring)."""
    from transformers.integrations import ggml

    md, arch = header.metadata, header.architecture
    # transformers compares the whole name (`"mistral" in [name]`)
    hf_arch = "mistral" if arch == "llama" and md.get("general.name") == "mistral" else arch
    hf_arch = _HF_ARCHS.get(arch, hf_arch)
    if arch not in ggml.GGUF_CONFIG_MAPPING and hf_arch not in ggml.GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF model with architecture {arch} is not supported by transformers")
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)
    }
    defaults = getattr(ggml, "GGUF_CONFIG_DEFAULTS_MAPPING", {})
    for key, value in defaults.get(hf_arch, defaults.get(arch) or {}).items():
        config.setdefault(key, value)
    config.update(_renamed(md, arch, hf_arch, ggml.GGUF_CONFIG_MAPPING))
    config["model_type"] = _TEXT_MODEL_TYPES.get(config["model_type"], config["model_type"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    return config


def _renamed(md: dict[str, Any], arch: str, hf_arch: str, table: dict) -> dict[str, Any]:
    """Metadata values under their config names: ``prefix.key`` looked up in ``table``
    after the architecture's renaming; a one-element array is its element."""
    out = {}
    for key, value in md.items():
        prefix, _, field = key.replace(arch, hf_arch).partition(".")
        name = table.get(prefix, {}).get(field)
        if name is None or name == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, hf_arch)
        out[name] = value
    return out


def gguf_tokenizer(gguf_file: Path, **transformers_kwargs: Any) -> Any:
    """The fast tokenizer transformers builds from ``gguf_file``.

    ``transformers_kwargs`` (``use_fast``, ``trust_remote_code``) reach transformers
    only where it builds the tokenizer itself (module docstring); one built here is
    the fast tokenizer, which transformers 5 builds whatever ``use_fast`` says.
    """
    header = read_gguf_header(gguf_file)
    converter = _tokenizer_converter()
    if header.architecture not in BUILT_ARCHS or converter is None:
        require_torch(f"the tokenizer of a GGUF file of architecture {header.architecture!r}")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, **transformers_kwargs
        )
    fields, init_kwargs = _tokenizer_fields(header.metadata, converter.GGUF_TOKENIZER_MAPPING)
    backend, extra = converter.convert_gguf_tokenizer(header.architecture, fields)
    cls = _tokenizer_class(gguf_config_dict(header)["model_type"])
    # is_local: a local folder, which transformers then never looks up on the hub
    return cls(
        tokenizer_object=backend,
        name_or_path=str(gguf_file.parent),
        is_local=True,
        **init_kwargs,
        **extra,
    )


def _tokenizer_converter() -> Any:
    """transformers' GGUF tokenizer module, or None where it has none (before 5)."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping
    except ImportError:
        return None
    return gguf_tokenizer_mapping


def _tokenizer_fields(md: dict[str, Any], mapping: dict) -> tuple[dict, dict]:
    """(the fields ``convert_gguf_tokenizer`` takes, the tokenizer's init kwargs)."""
    groups = {
        group: {name: md[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in md}
        for group, renames in mapping.items()
    }  # fmt: skip
    fields, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if fields.get("tokenizer_type") == "llama":  # sentencepiece: llama.cpp's default
        init_kwargs.setdefault("add_bos_token", True)
    tokens = fields.get("tokens") or []
    for name, key in _SPECIAL_TOKENS.items():
        init_kwargs[name] = tokens[md[key]] if md.get(key) is not None else None
    return fields, init_kwargs


def _tokenizer_class(model_type: str) -> type:
    """The class AutoTokenizer picks for ``model_type`` (no tokenizer files given)."""
    from transformers import CONFIG_MAPPING, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    # without a mistral-format tokenizer file AutoTokenizer takes the generic class
    if cls is None or cls.__name__ == "MistralCommonBackend":
        return TokenizersBackend
    return cls
