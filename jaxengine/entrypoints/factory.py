"""The one engine factory: flags -> config (resolved once, here) -> engine -> front.

Every way an engine is built goes through this module: the offline `LLM`
(`offline_engine`), the API server (`served_engine`: the single engine, or the
data-parallel head with its local replicas and the remote ones of its ``--headless``
nodes), `run-batch` (`async_engine_from_args`) and a headless data-parallel node
(`engine_config` + `build_engine`). It also makes their stat loggers.

- `engine_config`: `EngineArgs` -> `EngineConfig` on this process's JAX backend,
  its defaults fitted to the model (a pooling model's: `worker.pooling.is_pooling_model`).
  `EngineArgs.create_engine_config` runs once. ``--logits-processors`` classes are
  imported and checked here, before any model loads.
- `build_engine`: an `LLMEngine`, or a `DataParallelEngine` with
  ``data_parallel_size`` > 1 (both are `engine.protocol.Engine`s).
- `async_engine`: the server's `EngineClient` over it: an `AsyncLLM`, or a
  `DPAsyncLLM` over N replicas (the one place that imports both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxengine.config import EngineConfig, ParallelConfig
from jaxengine.engine.data_parallel import DataParallelEngine
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine_args import EngineArgs
from jaxengine.entrypoints.async_llm import AsyncLLM
from jaxengine.entrypoints.client import EngineClient, StatLogger
from jaxengine.entrypoints.dp_async_llm import DPAsyncLLM
from jaxengine.logits_processor import resolve_logits_processors

if TYPE_CHECKING:
    from jaxengine.entrypoints.dp_head import DPHead
    from jaxengine.entrypoints.dp_remote import RemoteReplica
    from jaxengine.metrics.loggers import LoggingStatLogger, PrometheusStatLogger


def engine_config(args: EngineArgs) -> EngineConfig:
    """``args``' config on this process's JAX backend, its defaults fitted to the
    model (a pooling model's, `is_pooling_model`)."""
    import jax

    from jaxengine.worker.pooling import is_pooling_model

    resolve_logits_processors(args.logits_processors)  # a bad class: refused at start-up
    return args.create_engine_config(jax.default_backend(), pooling=is_pooling_model(args))


def build_engine(
    config: EngineConfig, *, warmup: bool = True, allow_remote: bool = False
) -> LLMEngine | DataParallelEngine:
    """An `LLMEngine`, or a `DataParallelEngine` when ``data_parallel_size`` > 1.

    Replicas on other nodes (``data_parallel_size_local`` < ``data_parallel_size``)
    are the API server's and its nodes' (``allow_remote``); elsewhere they raise
    ValueError.
    """
    parallel = config.parallel_config
    if parallel.has_remote_replicas and not allow_remote:
        raise ValueError(
            f"--data-parallel-size-local {parallel.local_data_parallel_size} < "
            f"--data-parallel-size {parallel.data_parallel_size} puts replicas on other "
            "nodes, which only `jaxengine serve` (the head and its --headless nodes) runs"
        )
    if parallel.data_parallel_size > 1:
        return DataParallelEngine(config, warmup=warmup)
    return LLMEngine(config, warmup=warmup)


def offline_engine(
    args: EngineArgs, log_stats: bool
) -> tuple[LLMEngine | DataParallelEngine, PrometheusStatLogger | None]:
    """The offline `LLM`'s engine (N replicas behind one interface with
    ``data_parallel_size=N``) and, with ``log_stats``, its metrics."""
    from sharding.distributed import initialize_for

    initialize_for(args)  # a multi-node driver joins its JAX cluster before any JAX call
    engine = build_engine(engine_config(args))
    return engine, (prometheus_logger(engine, args.model) if log_stats else None)


def prometheus_logger(engine: LLMEngine | DataParallelEngine, model_name: str):
    """The `PrometheusStatLogger` of ``engine``: one ``engine="i"`` label per
    data-parallel rank (local or remote), with the hidden deprecated families that
    ``--show-hidden-metrics-for-version`` shows."""
    from jaxengine.metrics.families import engine_cache_config_info
    from jaxengine.metrics.loggers import PrometheusStatLogger

    observability_config = engine.config.observability_config
    return PrometheusStatLogger(
        model_name,
        max_model_len=engine.max_model_len,
        engine_indexes=range(engine.config.parallel_config.data_parallel_size),
        cache_config_info=engine_cache_config_info(engine),
        show_hidden_metrics_for_version=observability_config.show_hidden_metrics_for_version,
    )


def log_stat_loggers(num_replicas: int, interval: float) -> list[LoggingStatLogger]:
    """One stats log line per replica (labelled by its index when there are several)."""
    from jaxengine.metrics.loggers import LoggingStatLogger

    return [
        LoggingStatLogger(interval=interval, engine_index=i if num_replicas > 1 else None)
        for i in range(num_replicas)
    ]


def served_engine(
    engine_args: EngineArgs, *, log_stats: bool, log_stats_interval: float
) -> tuple[EngineClient, PrometheusStatLogger, list[LoggingStatLogger]]:
    """(engine client, prometheus stat logger, log stat loggers) of the API server.

    The engine is an `AsyncLLM`, or with ``--data-parallel-size N`` > 1 a `DPAsyncLLM`
    over N replicas, each reporting its metrics as ``engine="i"`` and logging its own
    stats line. The log stat loggers are empty without ``log_stats``. With
    ``--data-parallel-size-local L`` < N this is the head: it listens on
    ``--data-parallel-address``/``--data-parallel-rpc-port`` before building its L
    replicas, then waits for the ``--headless`` nodes to register the other ranks
    (their streams go in one `StreamTable`, which the `DPAsyncLLM` then shares).
    """
    import prometheus_client

    from sharding.distributed import initialize_for

    prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created
    initialize_for(engine_args)  # a multi-node driver joins its JAX cluster before any JAX call
    config = engine_config(engine_args)
    head = start_dp_head(config.parallel_config)
    try:
        engine = build_engine(config, allow_remote=True)
        remote = head.wait(engine.max_model_len, engine.vocab_size) if head else []
    except BaseException:
        if head is not None:
            head.close()
        raise
    num_replicas = config.parallel_config.data_parallel_size
    metrics = prometheus_logger(engine, engine.config.model_config.served_model_names[0])
    logs = log_stat_loggers(num_replicas, log_stats_interval) if log_stats else []
    loggers = [[metrics.for_engine(i), *logs[i : i + 1]] for i in range(num_replicas)]
    client = async_engine(engine.config, engine=engine, stat_loggers=loggers, remote=remote)
    metrics.watch_admission(client.admission_rejections)
    return client, metrics, logs


def start_dp_head(parallel: ParallelConfig) -> DPHead | None:
    """The head's listener for the remote data-parallel ranks (None when all are here)."""
    if parallel.data_parallel_rank_start != 0:
        raise ValueError(
            f"--data-parallel-start-rank {parallel.data_parallel_start_rank} is for "
            "--headless nodes: the head, which serves the API, holds ranks 0.."
        )
    if not parallel.has_remote_replicas:
        return None
    from jaxengine.entrypoints.dp_head import DPHead

    return DPHead(parallel)


def async_engine(
    config: EngineConfig,
    *,
    stat_loggers: Sequence[Sequence[StatLogger]] = (),
    engine: LLMEngine | DataParallelEngine | None = None,
    remote: Sequence[RemoteReplica] = (),
) -> EngineClient:
    """An `AsyncLLM`, or a `DPAsyncLLM` when ``data_parallel_size`` > 1.

    ``stat_loggers[i]`` are replica ``i``'s (one list when there is one replica);
    ``remote`` the replicas on other nodes; ``engine`` the `LLMEngine` or
    `DataParallelEngine` already built for ``config`` (built here when None).
    """
    if config.parallel_config.data_parallel_size > 1:
        if isinstance(engine, LLMEngine):
            raise TypeError("data_parallel_size > 1 needs a DataParallelEngine")
        return DPAsyncLLM(config, stat_loggers=stat_loggers, engine=engine, remote=remote)
    if isinstance(engine, DataParallelEngine):
        raise TypeError("data_parallel_size 1 needs an LLMEngine")
    return AsyncLLM(config, stat_loggers=stat_loggers[0] if stat_loggers else (), engine=engine)


def async_engine_from_args(engine_args: EngineArgs, **kwargs: Any) -> EngineClient:
    """`async_engine` for the config of ``engine_args`` on this platform; ``kwargs``
    go to `async_engine`."""
    return async_engine(engine_config(engine_args), **kwargs)
