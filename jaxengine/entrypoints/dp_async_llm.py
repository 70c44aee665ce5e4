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
(`entrypoints.dp_remote`) with the same interface, after the local ones in rank
order; their stats come back over the wire to ``stat_loggers[rank]``. New requests
avoid a dead replica while a live one is left (``/health`` still answers 503).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.core.dp_balancer import DPBalancer
from jaxengine.engine.data_parallel import DataParallelEngine
from jaxengine.engine.llm_engine import PreparedPrompt
from jaxengine.entrypoints.async_llm import AsyncLLM, StatLogger
from jaxengine.entrypoints.dp_remote import RemoteReplica
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import SamplingParams


class DPAsyncLLM:
    """Several `AsyncLLM`s (one per data-parallel replica) used as one."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        stat_loggers: Sequence[Sequence[StatLogger]] = (),
        engine: DataParallelEngine | None = None,
        remote: Sequence[RemoteReplica] = (),
    ) -> None:
        """``remote``: the replicas of the other nodes, ranks after the local ones."""
        self.engine = engine if engine is not None else DataParallelEngine(config)
        self.config = self.engine.config
        local = self.engine.replicas
        size = config.parallel_config.data_parallel_size
        ranks = list(range(len(local), size))
        if [r.rank for r in remote] != ranks:
            raise ValueError(
                f"{len(local)} local replicas need remote ranks {ranks}, got "
                f"{[r.rank for r in remote]}"
            )
        if stat_loggers and len(stat_loggers) != size:
            raise ValueError(f"{len(stat_loggers)} stat logger lists for {size} replicas")
        self.replicas: list[AsyncLLM | RemoteReplica] = [
            AsyncLLM(
                replica.config,
                engine=replica,
                stat_loggers=stat_loggers[i] if stat_loggers else (),
                thread_name=f"jaxengine-engine-{i}",
            )
            for i, replica in enumerate(local)
        ]
        for replica in remote:
            replica.stat_loggers = list(stat_loggers[replica.rank]) if stat_loggers else []
            self.replicas.append(replica)
        self.balancer = DPBalancer(size, block_size=self.config.cache_config.block_size or 16)
        self._owner: dict[str, int] = {}  # request id in flight -> replica index

    # ------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.replicas)

    def num_requests(self) -> int:
        """Requests in flight over every replica."""
        return sum(self.loads())

    def loads(self) -> list[int]:
        """Each replica's requests in flight (what the balancer weighs)."""
        return [r.num_requests() for r in self.replicas]

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

    def prepare(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """Tokenizes and validates (raises ValueError, nothing queued)."""
        return self.engine.prepare(prompt, params)

    async def generate(
        self,
        prompt: Any | PreparedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate` on the replica the balancer picks for this prompt."""
        prepared = prompt if isinstance(prompt, PreparedPrompt) else None
        if prepared is None:
            prepared = self.prepare(prompt, sampling_params)
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        index = self.balancer.choose(prepared.token_ids, self._routing_loads())
        self._owner[request_id] = index
        try:
            stream = self.replicas[index].generate(
                prepared, sampling_params, request_id, priority=priority
            )
            try:
                async for out in stream:
                    yield out
            finally:
                await stream.aclose()  # aborts the request if it did not finish
        finally:
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Aborts requests on the replicas that hold them (unknown ids: on every one)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            index = self._owner.get(rid)
            targets = self.replicas if index is None else [self.replicas[index]]
            for replica in targets:
                await replica.abort(rid)

    def shutdown(self, timeout: float = 10.0, *, shutdown_engine: bool = True) -> None:
        """Stops every replica's thread (and the remote nodes), and (unless told not to)
        releases the local engines."""
        for replica in self.replicas:
            replica.shutdown(timeout, shutdown_engine=False)
        if shutdown_engine:
            self.engine.shutdown()


def async_engine(
    config: EngineConfig,
    *,
    stat_loggers: Sequence[Sequence[StatLogger]] = (),
    engine: Any = None,
    remote: Sequence[RemoteReplica] = (),
) -> AsyncLLM | DPAsyncLLM:
    """An `AsyncLLM`, or a `DPAsyncLLM` when ``data_parallel_size`` > 1.

    ``stat_loggers[i]`` are replica ``i``'s (one list when there is one replica);
    ``remote`` the replicas on other nodes.
    """
    if config.parallel_config.data_parallel_size > 1:
        return DPAsyncLLM(config, stat_loggers=stat_loggers, engine=engine, remote=remote)
    return AsyncLLM(config, stat_loggers=stat_loggers[0] if stat_loggers else (), engine=engine)
