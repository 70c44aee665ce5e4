"""LoRA adapters, host side: the request type, PEFT folders, the host adapter store.

Nothing here imports JAX. The device side is `models.layers.lora` (the batched
matmul over adapter slots) and `runner.lora_slots` (writing adapters into slots).
"""

from jaxengine.lora.request import LoRAAdapterError, LoRAAdapterNotFoundError, LoRARequest

__all__ = ["LoRAAdapterError", "LoRAAdapterNotFoundError", "LoRARequest"]
