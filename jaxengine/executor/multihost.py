"""One engine over several hosts with the "mp" backend: a driver and its followers.

Every node runs one JAX process of one cluster (`sharding.distributed`). Node 0, the
driver, owns the scheduler, the tokenizer and the API; nodes 1.. are followers
(`jaxengine serve --headless --node-rank i`). All build the same runner from the
driver's config, so every process holds the same compiled functions and its own
shards of the parameters and KV cache. Each step the driver sends its
`SchedulerOutput` to the followers before running it itself; everyone runs the same
`ModelRunner.execute` (host packing is deterministic given the same sequence of
`SchedulerOutput`s), the compiled step's collectives meet across hosts, and only the
driver's `RunnerOutput` is used (the sampled ids are replicated, so all agree). The
driver's side is `DriverExecutor`, an `Executor`.

The control channel is a `multiprocessing.connection` socket from each follower to
the driver, authenticated with a random key; the driver publishes its address and the
key in the JAX coordinator's key-value store, so the only port to agree on is
``--master-port``. Messages are the typed dataclasses of `jaxengine.messages`: the
follower says `FollowerHello` (with its protocol version; a mismatch is refused with
both versions named), the driver answers `DriverWelcome` with its config, then sends
`Warmup`, `ExecuteStep` and finally `Shutdown`.

Startup order, driver: join the cluster, accept every follower and send it the
config, build. Follower: join, connect, receive the config, build, then follow.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from multiprocessing.connection import Client, Connection, Listener

from jaxengine.config import EngineConfig
from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.engine_args import EngineArgs
from jaxengine.executor.abstract import DoneStep, refuse_rollout
from jaxengine.executor.local import LocalExecutor
from jaxengine.messages import (
    DriverWelcome,
    ExecuteStep,
    FollowerHello,
    Refused,
    Shutdown,
    Warmup,
    check_version,
    dumps,
    loads,
)
from jaxengine.runner.model_runner import ModelRunner
from jaxengine.worker.build import HostParts, build_worker

logger = logging.getLogger(__name__)

DRIVER_KEY = "jaxengine/driver"  # "host:port:authkey-hex" in the coordinator's store


def check_spans_all_devices(config: EngineConfig) -> None:
    """A multi-host engine must use every device of every process: a process with no
    device in the mesh could not run its computations."""
    import jax

    parallel = config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        # pipeline stages on different hosts need cross-host activation transfers and
        # the last stage's samples on the driver; neither is wired up yet
        raise ValueError(
            "multi-node engines do not combine with --data-parallel-size or "
            "--pipeline-parallel-size > 1 yet"
        )
    if parallel.world_size != jax.device_count():
        raise ValueError(
            f"a multi-node engine spans every device of every node: --tensor-parallel-size "
            f"x --pipeline-parallel-size = {parallel.world_size}, but the {jax.process_count()} "
            f"nodes have {jax.device_count()} devices"
        )


def without_host_swap(config: EngineConfig) -> EngineConfig:
    """``--swap-space 0``: swapping pages to host memory would fetch KV-cache pages that
    live on other hosts, so a multi-host engine preempts by recomputation instead."""
    cache = config.cache_config
    if not cache.swap_space:
        return config
    logger.warning(
        "--swap-space %s ignored: a multi-host engine preempts by recomputation", cache.swap_space
    )
    return dataclasses.replace(config, cache_config=dataclasses.replace(cache, swap_space=0))


class FollowerLinks:
    """The driver's connections to its followers (one per node 1..nnodes-1)."""

    def __init__(self, config: EngineConfig) -> None:
        from sharding.distributed import publish

        parallel = config.parallel_config
        authkey = os.urandom(32)
        listener = Listener((parallel.master_addr, 0), authkey=authkey)
        host, port = listener.address
        publish(DRIVER_KEY, f"{host}:{port}:{authkey.hex()}")
        self.conns: list[Connection] = []
        try:
            for _ in range(parallel.nnodes - 1):
                self._accept(listener.accept(), config)
        finally:
            listener.close()

    def _accept(self, conn: Connection, config: EngineConfig) -> None:
        hello = loads(conn.recv_bytes())
        if not isinstance(hello, FollowerHello):
            raise ValueError(f"a follower opened with {type(hello).__name__}, not FollowerHello")
        try:
            check_version(hello.version, f"follower node {hello.node_rank}")
        except RuntimeError as e:
            conn.send_bytes(dumps(Refused(str(e))))
            conn.close()
            raise
        conn.send_bytes(dumps(DriverWelcome(config)))
        self.conns.append(conn)
        logger.info("follower node %d connected", hello.node_rank)

    def send(self, message: object) -> None:
        data = dumps(message)
        for conn in self.conns:
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(dumps(Shutdown()))
            except OSError:
                pass
            conn.close()
        self.conns = []


class DriverExecutor(LocalExecutor):
    """Node 0's `Executor`: each call reaches the followers first, then runs here."""

    def __init__(self, runner: ModelRunner, host: HostParts, links: FollowerLinks) -> None:
        super().__init__(runner)
        self.host = host
        self.links = links

    @classmethod
    def start(cls, config: EngineConfig) -> DriverExecutor:
        """Joins the cluster (unless joined), waits for every follower, builds."""
        from sharding.distributed import initialize_for

        initialize_for(config.parallel_config)
        check_spans_all_devices(config)
        config = without_host_swap(config)
        links = FollowerLinks(config)
        runner, host = build_worker(config)
        return cls(runner, host, links)

    def warmup(self, progress: bool = True) -> None:
        self.links.send(Warmup(False))
        super().warmup(progress)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.check_health()
        self.links.send(ExecuteStep(scheduler_output))
        return super().execute(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> DoneStep:
        """Runs the step now: the followers step in lockstep with this host."""
        return DoneStep(self.execute(scheduler_output))

    sleep = wake_up = update_weights = refuse_rollout("with --nnodes > 1 yet")
    is_sleeping = False
    sleep_level = 0

    def shutdown(self) -> None:
        if not self.closed:
            self.links.close()
        super().shutdown()


def connect_to_driver(node_rank: int) -> tuple[Connection, EngineConfig]:
    """A follower's connection to the driver, and the driver's config."""
    from sharding.distributed import lookup

    host, port, key = lookup(DRIVER_KEY).rsplit(":", 2)
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    conn.send_bytes(dumps(FollowerHello(node_rank)))
    answer = loads(conn.recv_bytes())
    if isinstance(answer, Refused):
        conn.close()
        raise RuntimeError(f"the driver refused node {node_rank}: {answer.reason}")
    return conn, answer.config


def follow(runner: ModelRunner, conn: Connection) -> None:
    """Runs the driver's calls on ``runner`` until it says shut down (or goes away)."""
    while True:
        try:
            message = loads(conn.recv_bytes())
        except EOFError:
            logger.warning("the driver closed the connection; stopping")
            break
        if isinstance(message, ExecuteStep):
            runner.execute(message.scheduler_output)
        elif isinstance(message, Warmup):
            runner.warmup(progress=message.progress)
        elif isinstance(message, Shutdown):
            break
        else:
            raise ValueError(f"unknown message from the driver: {type(message).__name__}")
    runner.release()
    conn.close()


def run_follower(engine_args: EngineArgs) -> int:
    """`jaxengine serve --headless`: joins as node ``node_rank`` > 0 and follows the
    driver's steps until it shuts down. Opens no HTTP port."""
    import jax

    from sharding.distributed import initialize_for

    if engine_args.nnodes <= 1 or engine_args.node_rank == 0:
        raise ValueError("--headless needs --nnodes > 1 and a --node-rank > 0")
    initialize_for(engine_args)
    engine_args.create_engine_config(platform=jax.default_backend())  # validates the flags
    conn, config = connect_to_driver(engine_args.node_rank)
    check_spans_all_devices(config)
    logger.info("node %d following the driver", engine_args.node_rank)
    runner, _ = build_worker(config)
    follow(runner, conn)
    return 0
