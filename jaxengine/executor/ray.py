"""``--distributed-executor-backend ray``: the engine's device side as Ray actors.

The driver (this process: scheduler, tokenizer, API) connects to a Ray cluster
(``$RAY_ADDRESS``, else one started on this machine with ``ray start``, else a new
local one, as ``ray.init()`` decides) and starts one `RayWorker` actor per host
slice. The actors join one JAX cluster among themselves (`sharding.distributed`, the
coordinator on worker 0), and each builds the runner from the driver's config: worker
0 also returns the host parts (resolved config, tokenizer, KV-cache size, scheduler
limits), so the driver never loads the parameters. Each step the driver sends the
`SchedulerOutput` to every worker and keeps worker 0's `RunnerOutput`. The driver's
side is `RayExecutor`, an `Executor`.

How many workers: ``world_size / devices_per_worker``, where devices per worker is
``$JAXENGINE_RAY_DEVICES_PER_WORKER`` if set, else the GPU (or TPU) count of a Ray
node (one worker per host), else, on a CPU-only cluster, the whole world size (one
worker with that many virtual CPU devices). GPU workers ask Ray for that many GPUs,
TPU workers for that many ``TPU`` resources, CPU workers for one CPU.
"""

from __future__ import annotations

import logging
import os
import socket

from jaxengine.config import EngineConfig
from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.executor.abstract import DoneStep, refuse_rollout
from jaxengine.executor.multihost import check_spans_all_devices, without_host_swap
from jaxengine.runner.model_runner import ModelRunner
from jaxengine.worker.build import HostParts, build_worker

logger = logging.getLogger(__name__)

DEVICES_ENV = "JAXENGINE_RAY_DEVICES_PER_WORKER"


class RayWorker:
    """One JAX process of the engine (made a Ray actor by `RayExecutor`)."""

    def __init__(self, rank: int, num_workers: int, cpu_devices: int | None) -> None:
        self.rank = rank
        self.num_workers = num_workers
        self.cpu_devices = cpu_devices
        self.runner: ModelRunner | None = None

    def coordinator_address(self) -> str:
        """This node's address and a free port, for the JAX coordinator (worker 0)."""
        from ray.util import get_node_ip_address

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{get_node_ip_address()}:{port}"

    def join(self, coordinator: str) -> None:
        from sharding.distributed import initialize

        initialize(coordinator, self.num_workers, self.rank, local_device_count=self.cpu_devices)

    def build(self, config: EngineConfig) -> HostParts | None:
        """Builds the runner; worker 0 returns the host parts for the driver."""
        check_spans_all_devices(config)
        self.runner, host = build_worker(config)
        return host if self.rank == 0 else None

    def warmup(self, progress: bool) -> None:
        self.runner.warmup(progress=progress and self.rank == 0)

    def lora(self, method: str, *args: object) -> object:
        """``add``, ``remove``, ``list``, ``pin`` or ``unpin`` on this worker's adapter
        store."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return getattr(self.runner.lora.store, method)(*args)

    def execute(self, out: SchedulerOutput) -> RunnerOutput | None:
        result = self.runner.execute(out)
        return result if self.rank == 0 else None

    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def ping(self) -> bool:
        return self.runner is not None

    def close(self) -> None:
        if self.runner is not None:
            self.runner.release()
            self.runner = None


def worker_layout(world_size: int, nodes: list[dict]) -> tuple[int, dict, int | None]:
    """(devices per worker, Ray actor options, virtual CPU devices or None)."""
    env = os.environ.get(DEVICES_ENV)
    per, options, cpu_devices = None, {"num_cpus": 1}, None
    for kind in ("TPU", "GPU"):
        most = max((int(n["Resources"].get(kind, 0)) for n in nodes), default=0)
        if most:
            per = int(env) if env else min(most, world_size)
            options = {"num_gpus": per} if kind == "GPU" else {"resources": {"TPU": per}}
            break
    if per is None:
        per = int(env) if env else world_size
        cpu_devices = per
    if per < 1 or world_size % per:
        raise ValueError(
            f"{per} devices per Ray worker do not divide the world size {world_size} "
            f"(--tensor-parallel-size x --pipeline-parallel-size); set ${DEVICES_ENV}"
        )
    return per, options, cpu_devices


class RayExecutor:
    """The driver's `Executor`: every call runs on every worker."""

    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "--distributed-executor-backend ray needs Ray: pip install 'jaxengine[ray]'"
            ) from exc

        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("--distributed-executor-backend ray does not combine with -dp > 1 yet")
        config = without_host_swap(config)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # $RAY_ADDRESS, else a running local cluster, else a new one
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        world = config.parallel_config.world_size
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per, options, cpu_devices = worker_layout(world, nodes)
        num = world // per
        logger.info("starting %d Ray workers with %d devices each", num, per)
        actor = ray.remote(RayWorker).options(scheduling_strategy="SPREAD", **options)
        self.workers = [actor.remote(rank, num, cpu_devices) for rank in range(num)]
        coordinator = ray.get(self.workers[0].coordinator_address.remote())
        ray.get([w.join.remote(coordinator) for w in self.workers])
        self.host: HostParts = ray.get([w.build.remote(config) for w in self.workers])[0]

    def _all(self, method: str, *args: object) -> list:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def warmup(self, progress: bool = True) -> None:
        self._all("warmup", progress)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        import ray

        return self._all("execute", ray.put(scheduler_output))[0]

    def submit(self, scheduler_output: SchedulerOutput) -> DoneStep:
        """Runs the step now: every worker steps in lockstep."""
        return DoneStep(self.execute(scheduler_output))

    def add_lora(self, lora_request) -> bool:
        return self._all("lora", "add", lora_request)[0]

    def remove_lora(self, lora_id: int) -> bool:
        return self._all("lora", "remove", lora_id)[0]

    def list_loras(self) -> set[int]:
        return self._all("lora", "list")[0]

    def pin_lora(self, lora_request) -> None:
        self._all("lora", "pin", lora_request)

    def unpin_lora(self, lora_id: int) -> None:
        self._all("lora", "unpin", lora_id)

    sleep = wake_up = update_weights = refuse_rollout("with --distributed-executor-backend ray yet")
    is_sleeping = False
    sleep_level = 0

    def check_health(self) -> None:
        """Raises when a worker has died (Ray raises for a dead actor)."""
        if not self.workers:
            raise RuntimeError("the executor is shut down")
        self._all("ping")

    @property
    def compiles_after_warmup(self) -> int:
        """The most compilations any worker saw after warm-up (0 when none did)."""
        return max(self._all("compiles_after_warmup"))

    def shutdown(self) -> None:
        import ray

        if not self.workers:
            return
        try:
            self._all("close")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []
            if self._owns_ray:
                ray.shutdown()
