"""Multi-host bootstrap: JAX's multi-controller runtime under one engine.

One engine can span several hosts. Every host runs one JAX process; after
`initialize`, ``jax.devices()`` lists the devices of every process (process 0's
first), so the engine's mesh (`sharding.mesh`) spans them all and every compiled
function runs on all processes at once, each feeding and computing its own shards.
That is JAX's multi-controller model: the same program, in the same order, on every
process. The engine keeps it by running its scheduler on process 0 only and sending
each step's `SchedulerOutput` to the others (`jaxengine.executor.multihost`,
`jaxengine.executor.ray`).

`initialize` must run before any other JAX call of the process (JAX refuses to join
a cluster once a backend is up). On CPU the collectives between processes go through
gloo, and ``local_device_count`` sets how many virtual CPU devices this process has.

The coordinator's key-value store (`publish`, `lookup`) lets process 0 tell the others
where to reach it without another well-known port; it is as trusted as the
coordinator itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 300


class DistributedError(RuntimeError):
    """The multi-host runtime could not start, or started with other settings."""


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_count: int | None = None,
    timeout_s: int = INIT_TIMEOUT_S,
) -> None:
    """Joins this process to a JAX cluster of ``num_processes`` as ``process_id``.

    Process 0 hosts the coordinator on ``coordinator_address`` ("host:port"); every
    process blocks here until all have joined (at most ``timeout_s``). Calling it
    again with the same settings does nothing. ``local_device_count`` sets the number
    of virtual CPU devices of this process (CPU only; other platforms use theirs).
    """
    import jax

    if jax.distributed.is_initialized():
        _check_same(num_processes, process_id)
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        )
    except RuntimeError as exc:
        if "must be called before" in str(exc):
            raise DistributedError(
                "the multi-host runtime must start before any other JAX call in this "
                "process: call sharding.distributed.initialize_for(engine_args) first"
            ) from exc
        raise
    logger.info(
        "joined JAX cluster at %s as process %d of %d: %d local, %d global devices",
        coordinator_address,
        process_id,
        num_processes,
        jax.local_device_count(),
        jax.device_count(),
    )


def initialize_for(args: Any, local_device_count: int | None = None) -> bool:
    """`initialize` from the multi-node flags of ``args`` (a `ParallelConfig` or
    `EngineArgs`: ``nnodes``, ``node_rank``, ``master_addr``, ``master_port``).

    Does nothing on one node. Returns whether this process is (now) one of several.
    A Ray driver runs no model: it must not take the accelerator memory that JAX
    preallocates when the driver probes its platform (the workers on the same host
    need it), so preallocation is turned off for it.
    """
    if getattr(args, "distributed_executor_backend", None) == "ray":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.nnodes <= 1:
        return False
    initialize(
        f"{args.master_addr}:{args.master_port}",
        args.nnodes,
        args.node_rank,
        local_device_count=local_device_count,
    )
    return True


def is_initialized() -> bool:
    import jax

    return jax.distributed.is_initialized()


def _state() -> Any:
    # JAX exposes the coordinator's key-value store only through its private state.
    from jax._src import distributed

    return distributed.global_state


def _check_same(num_processes: int, process_id: int) -> None:
    state = _state()
    if (state.num_processes, state.process_id) != (num_processes, process_id):
        raise DistributedError(
            f"this process already joined a JAX cluster as process {state.process_id} of "
            f"{state.num_processes}, not {process_id} of {num_processes}"
        )


def publish(key: str, value: str) -> None:
    """Stores ``value`` under ``key`` in the coordinator's key-value store."""
    _state().client.key_value_set(key, value)


def lookup(key: str, timeout_s: int = INIT_TIMEOUT_S) -> str:
    """The value under ``key``, waiting up to ``timeout_s`` for it to be published."""
    return _state().client.blocking_key_value_get(key, timeout_s * 1000)
