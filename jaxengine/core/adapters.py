"""What the scheduler needs from the LoRA adapters' host store (`AdapterPins`), as a
Protocol.

A request's adapter is read when the request is queued (`LLMEngine.prepare`), but
the host keeps only ``--max-cpu-loras`` adapters, so it may be dropped again while
the request waits. The scheduler pins the adapter when it first admits the request
and unpins it when the request finishes: a pinned adapter stays on the host, and
every step finds its requests' adapters in memory. Pinning reads the adapter again
if it was dropped; when that fails (its folder is gone) only that request fails.
The implementation is the engine's executor (`pin_lora`, `unpin_lora`, over
`jaxengine.lora.store.AdapterStore`); `core/` holds only this interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class AdapterPins(Protocol):
    def pin_lora(self, lora_request: Any) -> None:
        """Keeps the adapter on the host until as many `unpin_lora` calls; raises
        ValueError (`LoRAAdapterError`) when it cannot be read."""
        ...

    def unpin_lora(self, lora_id: int) -> None:
        """Takes back one `pin_lora` of adapter ``lora_id``."""
        ...


def lora_counts(requests: Iterable[Any]) -> dict[str, int]:
    """Requests per adapter name (requests of the base model left out)."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_request is not None:
            counts[req.lora_name] = counts.get(req.lora_name, 0) + 1
    return counts
