"""The engine's host side, pure Python (numpy at most, never jax).

- `request`: Request and RequestStatus, stop checks.
- `kv_cache/`: block pool, prefix cache, KVCacheManager.
- `scheduler`: Scheduler (`schedule() -> SchedulerOutput`,
  `update(SchedulerOutput, RunnerOutput) -> list[EngineCoreOutput]`).
- `sched_output`: the frozen dataclasses exchanged with the runner.
- `policy`: waiting-queue order, preemption victim, partial-prefill limiter.
- `limits`: SchedulerLimits, resolved from SchedulerConfig + CacheConfig.

A test imports this package in a subprocess and checks `jax` stays out of sys.modules.
"""

from jaxengine.core.kv_cache import KVCacheManager
from jaxengine.core.limits import SchedulerLimits, num_host_blocks_for
from jaxengine.core.request import Request, RequestStatus
from jaxengine.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from jaxengine.core.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "KVCacheManager",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RunnerOutput",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOutput",
    "SchedulerStats",
    "num_host_blocks_for",
]
