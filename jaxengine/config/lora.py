"""LoRAConfig: serving many LoRA adapters over one base model (vLLM's LoRA flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxengine.config.utils import require, spec, validate_config

LoRADType = Literal["auto", "float16", "bfloat16", "float32"]


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters: slots on the device, adapters kept on the host."""

    enable_lora: bool = False
    """If True, enable handling of LoRA adapters."""
    max_loras: int = spec(1, ge=1)
    """Max number of LoRAs in a single batch: the device holds this many adapter
    slots, and a request whose adapter would be one more waits."""
    max_lora_rank: int = spec(16, ge=1)
    """Max LoRA rank: every slot holds this rank (smaller adapters are padded with
    zeros); an adapter of a larger rank is refused."""
    max_cpu_loras: int | None = spec(None, ge=1)
    """Maximum number of LoRAs to store in CPU memory (least recently used are
    dropped and read again when needed). Must be >= max_loras. Default: max_loras."""
    lora_dtype: LoRADType = "auto"
    """Data type for LoRA. If auto, will default to base model dtype."""
    fully_sharded_loras: bool = False
    """By default, only half of the LoRA computation is sharded with tensor
    parallelism (B's output columns of q/k/v/gate/up, A's input rows of o/down).
    Enabling this shards A's slot columns of q/k/v/gate/up too, gathering the small
    rank-wide activations instead of holding A whole on every device."""

    def __post_init__(self) -> None:
        validate_config(self)
        if self.max_cpu_loras is not None:
            require(
                self.max_cpu_loras >= self.max_loras,
                "max_cpu_loras",
                f"({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
            )

    @property
    def cpu_loras(self) -> int:
        """Adapters kept on the host (`max_cpu_loras`, default `max_loras`)."""
        return self.max_cpu_loras or self.max_loras
