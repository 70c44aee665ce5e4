"""LoadConfig: how and from where model weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

# vLLM's load formats. All parse; unsupported.py rejects those jaxengine lacks.
LoadFormat = Literal[
    "auto",
    "safetensors",
    "gguf",
    "dummy",
    "pt",
    "npcache",
    "tensorizer",
    "runai_streamer",
    "bitsandbytes",
    "sharded_state",
    "mistral",
]


@dataclass(frozen=True)
class LoadConfig:
    """Configuration for loading the model weights."""

    load_format: LoadFormat = "auto"
    """The format of the model weights to load. "auto" picks safetensors, or GGUF
    when the model is a .gguf file. "safetensors" loads safetensors files. "gguf"
    loads a GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
    "dummy" initializes the weights with random values, mainly for profiling.
    vLLM's other formats (pt, npcache, tensorizer, runai_streamer, bitsandbytes,
    sharded_state, mistral) are not supported yet."""
    download_dir: str | None = None
    """Directory to download and load the weights into. Defaults to the Hugging Face
    cache directory."""
    ignore_patterns: list[str] = spec(default_factory=lambda: ["original/**/*"])
    """The list of patterns to ignore when loading the model. Defaults to
    "original/**/*" to avoid repeated loading of llama's checkpoints. Each is a glob
    matched as the Hugging Face hub client does (fnmatch on a file's path inside the
    model folder; "*" also matches "/"): matching files are not downloaded from the
    hub, nor picked as weight files (.safetensors, .gguf)."""

    def __post_init__(self) -> None:
        validate_config(self)
        require(all(bool(p) for p in self.ignore_patterns), "ignore_patterns", "empty pattern")
