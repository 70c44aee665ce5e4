"""MultiModalConfig: images in (vLLM's MultiModalConfig flags and the media paths)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxengine.config.utils import require, spec, validate_config

MODALITIES = ("image",)
"""The modalities the engine takes; vLLM's others (video, audio) are refused."""

DEFAULT_LIMIT_PER_PROMPT = 999
"""Items of one modality a prompt may carry when --limit-mm-per-prompt leaves it out
(vLLM V1's default)."""


@dataclass(frozen=True)
class MultiModalConfig:
    """How images reach a vision-language model, and how many a prompt may carry."""

    limit_mm_per_prompt: dict = spec(default_factory=dict)
    """The maximum number of input items allowed per prompt for each modality, e.g.
    {"image": 16}. A modality left out allows 999; 0 refuses it. Only images are
    supported. Should be a valid JSON string or JSON keys passed individually."""
    mm_processor_kwargs: dict | None = None
    """Arguments for the multimodal processor (transformers.AutoProcessor from the
    model folder), e.g. {"do_image_splitting": false}; a request's own
    mm_processor_kwargs are merged over them."""
    allowed_local_media_path: str = ""
    """Allow API requests to read local images from the directory at this path on
    the server (file:// URLs). This is a security risk: only enable it in trusted
    environments."""
    allowed_media_domains: list[str] | None = None
    """If set, only media URLs whose host is one of these domains may be fetched."""

    def __post_init__(self) -> None:
        validate_config(self)
        for modality, limit in self.limit_mm_per_prompt.items():
            require(
                modality in MODALITIES,
                "limit_mm_per_prompt",
                f"modality {modality!r} is not supported (supported: {', '.join(MODALITIES)})",
            )
            require(
                isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0,
                "limit_mm_per_prompt",
                f"the limit of {modality!r} must be a non-negative integer, got {limit!r}",
            )

    def limit(self, modality: str) -> int:
        """How many items of ``modality`` one prompt may carry."""
        return int(self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT))
