"""`DPAsyncLLM`: the server's engine with ``--data-parallel-size N`` > 1.

One `AsyncLLM` per replica of a `DataParallelEngine`, each stepping its replica on
its own thread, behind the interface the server uses of one `AsyncLLM`. `generate`
sends each request to the replica `DPBalancer` picks from the replicas' loads (their
requests in flight: queued for the engine thread, waiting or running) and the
prompt's leading blocks; `abort`, `check_health`, `num_requests` and `shutdown` cover
every replica. A replica that dies makes the whole engine unhealthy (`/health` 503),
as in vLLM.

Stat loggers are per replica: replica ``i`` reports to ``stat_loggers[i]`` (e.g. a
`PrometheusStatLogger.for_engine(i)`, so `/metrics` labels it ``engine="i"``).

Replicas on other nodes (``--data-parallel-size-local`` < N) are `RemoteReplica`s
(`entrypoints.dp_remote`), after the local ones in rank order; their stats come back
over the wire to ``stat_loggers[rank]``. New requests avoid a dead replica while a
live one is left (``/health`` still answers 503).

Every replica, local or remote, is a `ReplicaClient` whose streams live in ONE
`StreamTable` shared with this front (owner: the replica's rank): the balancer's
loads are the table's counts per owner, and `abort` finds a request's replica as the
table's ``owner_of``.

Admission control (``--max-num-queued-reqs``, ``--max-num-queued-tokens``:
`entrypoints.admission`) is this front's: each request is checked once, before the
balancer routes it, against the whole table (every replica's requests together), as
vLLM's API server counts its in-flight requests before a rank is chosen. The
replicas, sharing the table, check nothing themselves; a remote replica's
first-token reports reach the table with its stats.

`entrypoints.factory.async_engine` builds the server's `EngineClient`: an
`AsyncLLM`, or a `DPAsyncLLM` when ``data_parallel_size`` > 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.core.dp_balancer import DPBalancer
from jaxengine.engine.data_parallel import DataParallelEngine
from jaxengine.entrypoints.admission import AdmissionControl, num_seqs
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.client import EngineFront, ReplicaClient, StatLogger
from jaxengine.entrypoints.dp_remote import RemoteReplica
from jaxengine.entrypoints.streams import StreamTable
from jaxengine.inputs import PreparedPrompt
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams


class DPAsyncLLM(EngineFront):
    """Several replicas (an `AsyncLLM` per local one) used as one `EngineClient`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        stat_loggers: Sequence[Sequence[StatLogger]] = (),
        engine: DataParallelEngine | None = None,
        remote: Sequence[RemoteReplica] = (),
    ) -> None:
        """``remote``: the replicas of the other nodes, ranks after the local ones, all
        on one `StreamTable` (`DPHead.wait`'s), which this front then shares."""
        self.engine = engine if engine is not None else DataParallelEngine(config)
        self.config = self.engine.config
        size = config.parallel_config.data_parallel_size
        if stat_loggers and len(stat_loggers) != size:
            raise ValueError(f"{len(stat_loggers)} stat logger lists for {size} replicas")
        self.streams = _shared_table(remote)
        self.admission = AdmissionControl.of(self.config.scheduler_config)
        local = self.engine.replicas
        _check_remote_ranks(len(local), size, remote)
        self.replicas: list[ReplicaClient] = [
            AsyncLLM(
                replica.config,
                engine=replica,
                stat_loggers=stat_loggers[i] if stat_loggers else (),
                thread_name=f"jaxengine-engine-{i}",
                rank=i,
                streams=self.streams,
            )
            for i, replica in enumerate(local)
        ]
        for replica in remote:
            replica.stat_loggers = list(stat_loggers[replica.rank]) if stat_loggers else []
            self.replicas.append(replica)
        self.balancer = DPBalancer(size, block_size=self.config.cache_config.block_size)

    # ------------------------------------------------------------------ properties

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    def num_requests(self) -> int:
        """Requests in flight over every replica."""
        return self.streams.count()

    def loads(self) -> list[int]:
        """Each replica's requests in flight (what the balancer weighs)."""
        counts = self.streams.counts()
        return [counts.get(rank, 0) for rank in range(len(self.replicas))]

    def _routing_loads(self) -> list[int]:
        """`loads`, with a dead replica weighing more than any live one could."""
        loads = self.loads()
        worst = max(loads) + self.balancer.margin + 1
        return [worst if r.errored else load for r, load in zip(self.replicas, loads, strict=True)]

    async def check_health(self) -> None:
        """Raises `EngineDeadError` when any replica's engine thread has stopped."""
        for replica in self.replicas:
            await replica.check_health()

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: Any | PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate` on the replica the balancer picks for this prompt, once
        admission control (over every replica's requests) lets it in."""
        prepared = prompt if isinstance(prompt, PreparedPrompt) else None
        if prepared is None:
            prepared = self.prepare(prompt, sampling_params, lora_request)
        self.check_admission(num_seqs(prepared.params))
        if self.streams.owner_of(request_id) is not None:
            raise ValueError(f"duplicate request id {request_id!r}")
        rank = self.balancer.choose(prepared.token_ids, self._routing_loads())
        stream = self.replicas[rank].generate(
            prepared, sampling_params, request_id, priority=priority
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # aborts the request if it did not finish

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests on the replicas that hold them (unknown ids: on every one)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            rank = self.streams.owner_of(rid)
            targets = self.replicas if rank is None else [self.replicas[rank]]
            for replica in targets:
                await replica.abort(rid)

    async def abort_all(self) -> None:
        """Every replica's `abort_all` (a remote node aborts its requests, sends their
        last outputs and stops: the head only asks it when the server shuts down)."""
        await asyncio.gather(*(replica.abort_all() for replica in self.replicas))

    # ------------------------------------------------------------------ RL rollouts

    @property
    def is_sleeping(self) -> bool:
        """Whether a local replica sleeps (replicas on other nodes cannot: refused)."""
        return any(r.is_sleeping for r in self.replicas if isinstance(r, AsyncLLM))

    async def pause_generation(self, mode: str = "abort") -> None:
        for replica in self._local("pause_generation"):
            await replica.pause_generation(mode)

    async def resume_generation(self) -> None:
        for replica in self._local("resume_generation"):
            await replica.resume_generation()

    async def is_paused(self) -> bool:
        return all([await r.is_paused() for r in self._local("is_paused")])

    async def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """The call on every replica, in rank order (one result each)."""
        results = []
        for replica in self._local("collective_rpc"):
            results += await replica.collective_rpc(method, args, kwargs)
        return results

    def _local(self, what: str) -> list[AsyncLLM]:
        if len(self.replicas) > len(self.engine.replicas):
            raise NotImplementedError(f"{what} is not supported with replicas on other nodes yet")
        return self.replicas  # type: ignore[return-value]

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stops every replica's thread (and the remote nodes), and (unless told not to)
        releases the local engines."""
        for replica in self.replicas:
            replica.shutdown(timeout, shutdown_engine=False)
        if shutdown_engine:
            self.engine.shutdown()


def _shared_table(remote: Sequence[RemoteReplica]) -> StreamTable:
    """The remote replicas' one table (a new table when there are none)."""
    tables = {id(r.streams): r.streams for r in remote}
    if len(tables) > 1:
        raise ValueError("the remote replicas must share one StreamTable (DPHead.wait's)")
    return next(iter(tables.values())) if tables else StreamTable()


def _check_remote_ranks(num_local: int, size: int, remote: Sequence[RemoteReplica]) -> None:
    ranks = list(range(num_local, size))
    if [r.rank for r in remote] != ranks:
        raise ValueError(
            f"{num_local} local replicas need remote ranks {ranks}, got {[r.rank for r in remote]}"
        )
