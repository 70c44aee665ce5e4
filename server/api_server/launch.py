"""Starting the server: the engine (loaded and compiled first), the app, uvicorn.

The engine is built before the socket opens, so a client that can connect can be
served at once; `/health` answers 200 from then on. SIGTERM or SIGINT drains the
server (`server/api_server/drain.py`, ``--shutdown-timeout``); then the engine shuts down and
`serve` returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from server import envs

if TYPE_CHECKING:
    from jaxengine.entrypoints.client import EngineClient
    from server.api_server.ssl_refresh import SSLCertRefresher

logger = logging.getLogger("jaxengine.server")


def setup_logging(
    level: str = "info",
    environ: Mapping[str, str] = os.environ,
    config: dict[str, Any] | None = None,
) -> None:
    """One handler for the ``jaxengine`` loggers (uvicorn configures its own), at
    ``$VLLM_LOGGING_LEVEL`` or INFO (DEBUG for a ``debug`` uvicorn level), each line
    after ``$VLLM_LOGGING_PREFIX``; nothing with ``$VLLM_CONFIGURE_LOGGING=0``. A
    ``--log-config-file`` ``config`` (`load_log_config`) replaces all of that."""
    if config is not None:
        logging.config.dictConfig(config)
        return
    if not envs.configure_logging(environ):
        return
    root = logging.getLogger("jaxengine")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = envs.logging_prefix(environ).replace("%", "%%")
        fmt = f"{prefix}%(levelname)s %(asctime)s %(name)s] %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
    root.setLevel(envs.logging_level(level, environ))
    root.propagate = False


def load_log_config(
    path: str | None, environ: Mapping[str, str] = os.environ
) -> dict[str, Any] | None:
    """The ``--log-config-file`` (or ``$VLLM_LOGGING_CONFIG_PATH``) JSON dictConfig, or
    None without one. ValueError, before anything starts, for a file that cannot be
    read or is not a JSON object, or with ``$VLLM_CONFIGURE_LOGGING=0`` (vLLM's rule:
    the file implies configuring the loggers)."""
    if not path:
        return None
    if not envs.configure_logging(environ):
        raise ValueError(
            "VLLM_CONFIGURE_LOGGING evaluated to false, but a logging config file was "
            f"given ({path}). A logging config file implies VLLM_CONFIGURE_LOGGING. Please "
            "enable VLLM_CONFIGURE_LOGGING or leave out --log-config-file and "
            "VLLM_LOGGING_CONFIG_PATH."
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"Could not load logging config from {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"Invalid logging config in {path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"Invalid logging config in {path}. Expected dict, got {type(config).__name__}."
        )
    return config


def build_engine(args: argparse.Namespace) -> tuple[EngineClient, Any, list[Any]]:
    """(engine client, prometheus stat logger, log stat loggers) from the flags
    (`entrypoints.factory.served_engine`: the single engine, or the data-parallel
    head with its replicas)."""
    from jaxengine.entrypoints.factory import served_engine
    from server.api_server.args import engine_args_from

    return served_engine(
        engine_args_from(args),
        log_stats=not args.disable_log_stats,
        log_stats_interval=args.log_stats_interval,
    )


def run_headless(args: argparse.Namespace) -> int:
    """`serve --headless`: a follower of a multi-node engine (``--nnodes`` > 1), or a
    node of data-parallel replicas serving the head's API (``--data-parallel-address``)."""
    from server.api_server.args import engine_args_from

    engine_args = engine_args_from(args)
    if engine_args.nnodes > 1:
        from jaxengine.executor.multihost import run_follower

        return run_follower(engine_args)
    if engine_args.data_parallel_address is not None:
        from jaxengine.entrypoints.dp_node import run_dp_node

        return run_dp_node(engine_args, args.shutdown_timeout)
    raise ValueError(
        "--headless runs either a follower node of one engine over several hosts "
        "(--nnodes > 1 --node-rank i) or data parallel replicas for a head node "
        "(--data-parallel-address, --data-parallel-start-rank, --data-parallel-size-local)"
    )


def uvicorn_config(app, args: argparse.Namespace, log_config: dict[str, Any] | None = None):
    """uvicorn's settings from the flags. HTTP/1.1 is parsed by h11 whatever else is
    installed, so ``--h11-max-incomplete-event-size`` always applies;
    ``--h11-max-header-count`` is the app's (`server/api_server/http_limits.py`): h11 has no such
    setting. ``log_config`` (``--log-config-file``) replaces uvicorn's own logging setup."""
    import uvicorn

    logging_setup = {} if log_config is None else {"log_config": log_config}
    return uvicorn.Config(
        app,
        http="h11",
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        **logging_setup,
        host=args.host or "0.0.0.0",
        port=args.port,
        uds=args.uds,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        timeout_keep_alive=envs.http_timeout_keep_alive(),  # $VLLM_HTTP_TIMEOUT_KEEP_ALIVE
        timeout_graceful_shutdown=5,
    )


async def _serve(
    server: Any,
    models: Any,
    lora_modules: Sequence[Any],
    where: str,
    refresher: SSLCertRefresher | None = None,
) -> None:
    """Adds the ``--lora-modules`` adapters (a bad one raises: no socket was opened),
    then serves until interrupted, with ``refresher`` (``--enable-ssl-refresh``)
    watching the certificate files meanwhile."""
    await models.add_static(lora_modules)
    logger.info("serving %s at %s", [card["id"] for card in models.cards()], where)
    watch = None if refresher is None else asyncio.create_task(refresher.run())
    try:
        await server.serve()
    finally:
        if watch is not None:
            watch.cancel()


def ssl_refresher(config: Any, args: argparse.Namespace) -> SSLCertRefresher | None:
    """``--enable-ssl-refresh``: a refresher of the SSL context uvicorn serves with
    (loading ``config`` builds it), else None."""
    if not args.enable_ssl_refresh:
        return None
    from server.api_server.ssl_refresh import SSLCertRefresher

    if not config.loaded:
        config.load()
    return SSLCertRefresher(config.ssl, args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)


def serve(args: argparse.Namespace) -> int:
    """Runs `jaxengine serve` until a signal's drain ends (`server/api_server/drain.py`); 0."""
    from server.api_server.app import build_app
    from server.api_server.args import check_server_args
    from server.api_server.drain import DrainingServer

    log_config = load_log_config(args.log_config_file)
    setup_logging(args.uvicorn_log_level, config=log_config)
    if getattr(args, "headless", False):  # no API server
        return run_headless(args)
    check_server_args(args)
    engine, metrics, stats_logs = build_engine(args)
    try:
        app = build_app(engine, args, metrics=metrics, stats_logs=stats_logs)
        config = uvicorn_config(app, args, log_config)
        refresher = ssl_refresher(config, args)
        scheme = "https" if args.ssl_certfile else "http"
        where = args.uds or f"{scheme}://{args.host or '0.0.0.0'}:{args.port}"
        modules = getattr(args, "lora_modules", [])
        server = DrainingServer(config, app.state.drain)  # SIGTERM drains, then stops
        asyncio.run(_serve(server, app.state.ctx.models, modules, where, refresher))
    finally:
        engine.shutdown()
    return 0
