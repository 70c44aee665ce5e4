"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request`)."""

from __future__ import annotations

import dataclasses


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: unreadable, of the wrong shapes or modules,
    or of a rank above ``--max-lora-rank``. Nothing else is affected."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the path: no ``adapter_config.json`` there (vLLM's
    `LoRAAdapterNotFoundError`; the server answers 404, not 400)."""


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, integer id (> 0, unique per adapter) and folder.

    ``lora_path`` is a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``). ``base_model_name`` is what `/v1/models` lists as
    the adapter's parent (the served model's name when None)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
