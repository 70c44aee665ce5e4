"""Host swap space: KV-cache pages copied out to host memory and back.

The scheduler's swap preemption (``--preemption-mode swap``) moves a request's pages
to host pages (`SchedulerOutput.blocks_to_swap_out`) and later back into free device
pages (`blocks_to_swap_in`). Copies go through the program's gather and scatter in
chunks of a fixed number of pages (padded with ids past the cache's end, which
scatter drops), so they compile once.
"""

from __future__ import annotations

import numpy as np

from jaxengine.runner.program import Caches, StageProgram


class HostSwapSpace:
    """``num_host_blocks`` host pages per layer, and the copies to and from them."""

    def __init__(
        self,
        page_shape: tuple,
        dtype: np.dtype,
        num_layers: int,
        num_host_blocks: int,
        chunk: int,
        num_device_blocks: int,
    ) -> None:
        self.pages = [np.zeros((num_host_blocks, *page_shape), dtype) for _ in range(num_layers)]
        self.chunk = chunk
        self.num_device_blocks = num_device_blocks

    def _padded(self, ids: list[int]) -> np.ndarray:
        padded = max(-(-len(ids) // self.chunk), 1) * self.chunk
        out = np.full(padded, self.num_device_blocks, np.int32)  # past the end: dropped
        out[: len(ids)] = ids
        return out

    def swap_out(self, program: StageProgram, caches: Caches, pairs: list[tuple[int, int]]) -> None:
        """Copies device pages to host pages, for each (device, host) pair."""
        device_ids = self._padded([d for d, _ in pairs])
        parts = [
            program.gather(caches, device_ids[i : i + self.chunk])
            for i in range(0, len(device_ids), self.chunk)
        ]
        host_ids = [h for _, h in pairs]
        for layer, host in enumerate(self.pages):
            if host_ids:
                host[host_ids] = np.concatenate([p[layer] for p in parts])[: len(host_ids)]

    def swap_in(
        self, program: StageProgram, caches: Caches, pairs: list[tuple[int, int]]
    ) -> Caches:
        """Copies host pages into device pages, for each (host, device) pair."""
        host_ids = [h for h, _ in pairs]
        device_ids = self._padded([d for _, d in pairs])
        full = []
        for host in self.pages:
            f = np.zeros((len(device_ids), *host.shape[1:]), host.dtype)
            f[: len(host_ids)] = host[host_ids]
            full.append(f)
        for i in range(0, len(device_ids), self.chunk):
            caches = program.scatter(
                caches, device_ids[i : i + self.chunk], [f[i : i + self.chunk] for f in full]
            )
        return caches

    def warm(self, program: StageProgram, caches: Caches) -> Caches:
        """Compiles both copies (on padding only)."""
        self.swap_out(program, caches, [])
        return self.swap_in(program, caches, [])
