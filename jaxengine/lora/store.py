"""The host side of multi-LoRA: adapters read from disk, and which slot holds which.

`AdapterStore` keeps up to ``--max-cpu-loras`` adapters' weights in host memory
(least recently used dropped first; read again from their folder when needed) and
assigns the device's ``--max-loras`` slots (`models.layers.lora`). Each step,
`assign` gives every request its adapter's slot: adapters already resident keep
theirs, a new one takes a free slot or the least recently used one that no request
of this step needs, and the caller writes it there before the step runs. Slot 0 is
the base model. Thread-safe: the API server validates adapters (`add`) while the
engine thread steps.

Pins: the scheduler pins a request's adapter when it first admits the request
(`pin`, which reads it again if it was dropped: the one disk read that can fail,
and then only that request fails) and unpins it when the request finishes. A pinned
adapter is never dropped from the host, not even by `remove`, so `assign` finds
every scheduled request's adapter in memory and never reads a folder inside a step
(which may be gone by then). Pinned adapters may hold the host above
``--max-cpu-loras`` for as long as their requests live.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence

from jaxengine.lora.peft import Weights, read_adapter
from jaxengine.lora.request import LoRAAdapterError, LoRAAdapterNotFoundError, LoRARequest


class AdapterStore:
    """Adapters on the host and their device slots (see module doc)."""

    def __init__(
        self,
        targets: Mapping[str, tuple[int, int]],
        max_rank: int,
        max_loras: int,
        max_cpu_loras: int,
    ) -> None:
        self.targets = dict(targets)
        self.max_rank = max_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._host: collections.OrderedDict[int, tuple[LoRARequest, Weights]] = (
            collections.OrderedDict()
        )
        self._registered: dict[int, LoRARequest] = {}
        self._pins: collections.Counter[int] = collections.Counter()  # adapter id -> pins
        self._slot_ids: list[int | None] = [None] * max_loras  # slot s + 1 -> adapter id
        self._last_use = [0] * max_loras
        self._clock = 0

    # ------------------------------------------------------------------ adapters

    def add(self, request: LoRARequest) -> bool:
        """Reads and checks ``request``'s adapter (`LoRAAdapterError` if it cannot be
        served); False when that id is registered already."""
        with self._lock:
            known = self._registered.get(request.lora_int_id)
            if known is not None and known != request:
                raise LoRAAdapterError(
                    f"LoRA id {request.lora_int_id} is {known.lora_name!r} already"
                )
            self._weights(request)
            self._registered[request.lora_int_id] = request
            return known is None

    def remove(self, lora_id: int) -> bool:
        """Forgets an adapter (the requests that pinned it keep its host copy)."""
        with self._lock:
            if not self._pins[lora_id]:
                self._host.pop(lora_id, None)
            for i, held in enumerate(self._slot_ids):
                if held == lora_id:
                    self._slot_ids[i] = None
            return self._registered.pop(lora_id, None) is not None

    def pin(self, request: LoRARequest) -> None:
        """Keeps ``request``'s adapter on the host until as many `unpin` calls (read
        again if it was dropped; `LoRAAdapterError` if that fails)."""
        with self._lock:
            self._weights(request, pin=True)

    def unpin(self, lora_id: int) -> None:
        with self._lock:
            self._pins[lora_id] -= 1
            if self._pins[lora_id] <= 0:
                del self._pins[lora_id]
                if lora_id not in self._registered:  # removed while pinned
                    self._host.pop(lora_id, None)
                self._evict()

    def list(self) -> set[int]:
        with self._lock:
            return set(self._registered)

    def _weights(self, request: LoRARequest, pin: bool = False) -> Weights:
        """The adapter's weights, read if not held, pinned once more if ``pin`` (the
        lock is held)."""
        lora_id = request.lora_int_id
        held = self._host.get(lora_id)
        if held is None or held[0].lora_path != request.lora_path:
            held = (request, self._read(request))
            self._host[lora_id] = held
        self._host.move_to_end(lora_id)
        if pin:
            self._pins[lora_id] += 1
        self._evict()
        return held[1]

    def _read(self, request: LoRARequest) -> Weights:
        if not request.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} has no lora_path")
        try:
            return read_adapter(request.lora_path, self.targets, self.max_rank)
        except LoRAAdapterNotFoundError:  # vLLM's wording (its server answers 404)
            raise LoRAAdapterNotFoundError(
                f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}"
            ) from None

    def _evict(self) -> None:
        """Drops the least recently used unpinned adapters past ``max_cpu_loras``."""
        spare = [i for i in self._host if not self._pins[i]]  # least recent first
        for lora_id in spare[: max(len(self._host) - self.max_cpu_loras, 0)]:
            del self._host[lora_id]

    # ------------------------------------------------------------------ slots

    def assign(
        self, requests: Sequence[LoRARequest | None]
    ) -> tuple[list[int], list[tuple[int, Weights]]]:
        """Each request's slot (0 without an adapter) and the ``(slot, weights)`` to
        write before the step. Raises RuntimeError if the step mixes more adapters
        than slots (the scheduler never schedules that)."""
        with self._lock:
            self._clock += 1
            wanted = {r.lora_int_id: r for r in requests if r is not None}
            if len(wanted) > self.max_loras:
                raise RuntimeError(
                    f"a step mixes {len(wanted)} LoRA adapters; --max-loras is {self.max_loras}"
                )
            writes, slot_of = [], {}
            for lora_id, request in wanted.items():
                if lora_id in self._slot_ids:
                    i = self._slot_ids.index(lora_id)
                else:
                    i = self._free_slot(set(wanted))
                    writes.append((i + 1, self._weights(request)))
                    self._slot_ids[i] = lora_id
                self._last_use[i] = self._clock
                slot_of[lora_id] = i + 1
            slots = [0 if r is None else slot_of[r.lora_int_id] for r in requests]
            return slots, writes

    def _free_slot(self, needed: set[int]) -> int:
        if None in self._slot_ids:
            return self._slot_ids.index(None)
        free = [i for i, held in enumerate(self._slot_ids) if held not in needed]
        return min(free, key=lambda i: self._last_use[i])
