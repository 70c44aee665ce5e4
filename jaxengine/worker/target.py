"""A compile target: an engine built to be compiled for devices it will not run on.

``jaxengine tpu-check`` builds the engine as ``serve`` would, on a TPU slice's devices
that libtpu describes on a machine without one, and compiles every program the
engine compiles at start-up. `build_worker` takes a `CompileTarget` for that: the
parameters are placed shapes (no weights read), the KV cache is sized from the
chip's memory instead of a measurement, and every compile goes through the target's
``store`` (the check's recorder, with the `ExecutableStore`'s ``compile(name, key,
lower)``), which keeps what XLA says of each program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class CompileStore(Protocol):
    """Where a compile-only engine's programs are compiled (`runner.executables`)."""

    shareable: bool  # False: every compile reaches it (none shared across engines)

    def compile(self, name: str, key: Any, lower) -> Any: ...


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What `build_worker` needs to build a compile-only engine."""

    store: CompileStore
    hbm_bytes: int  # memory of one device, from the chip's sheet (`jaxengine.hardware`)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree``'s placed arrays or shapes (each leaf's shard;
    a replicated leaf whole; an unplaced one whole)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
