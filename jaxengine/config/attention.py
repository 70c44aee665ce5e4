"""AttentionConfig: which attention implementation the engine runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import validate_config

AttentionBackendName = Literal["auto", "pallas", "reference"]


@dataclass(frozen=True)
class AttentionConfig:
    """Configuration for the attention kernels."""

    attention_backend: AttentionBackendName = "auto"
    """Attention implementation. "auto" picks by platform: the Pallas TPU kernel on
    TPU, the Pallas GPU (Triton) kernel on GPU, the pure-JAX reference on CPU.
    "pallas" forces the Pallas kernels (on CPU the GPU kernels run in interpret mode:
    slow, for testing). "reference" forces the pure-JAX reference everywhere. The choice is
    logged at start-up."""

    def __post_init__(self) -> None:
        validate_config(self)
