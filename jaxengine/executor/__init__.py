"""The execution layer: how an engine runs its model (`Executor`) and where.

`create_executor` is the one place that picks the implementation from the parallel
config: `RayExecutor` for ``--distributed-executor-backend ray``, `DriverExecutor`
when this process is node 0 of ``--nnodes`` > 1, `LocalExecutor` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.executor.abstract import Executor
from jaxengine.worker.build import HostParts


def create_executor(
    config: EngineConfig, devices: Sequence[Any] | None = None
) -> tuple[Executor, HostParts]:
    """The executor for ``config`` (its model loaded, its KV cache allocated) and the
    host parts. ``devices``: this replica's, when data parallelism splits them."""
    parallel = config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        from jaxengine.executor.ray import RayExecutor

        executor = RayExecutor(config)
        return executor, executor.host
    if parallel.nnodes > 1:
        if parallel.node_rank != 0:
            raise ValueError(
                f"--node-rank {parallel.node_rank} is a follower: start it with "
                "`jaxengine serve --headless`"
            )
        from jaxengine.executor.multihost import DriverExecutor

        executor = DriverExecutor.start(config)
        return executor, executor.host
    from jaxengine.executor.local import LocalExecutor
    from jaxengine.worker.build import build_worker

    runner, host = build_worker(config, devices)
    background = config.compilation_config.background_compile
    return LocalExecutor(runner, background_compile=background), host


__all__ = ["Executor", "HostParts", "create_executor"]
