"""Starting the server: the engine (loaded and compiled first), the app, uvicorn.

The engine is built before the socket opens, so a client that can connect can be
served at once; `/health` answers 200 from then on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

logger = logging.getLogger("jaxengine.server")


def setup_logging(level: str = "info") -> None:
    """One INFO handler for the ``jaxengine`` loggers (uvicorn configures its own)."""
    root = logging.getLogger("jaxengine")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if level in ("debug", "trace") else logging.INFO)
    root.propagate = False


def build_engine(args: argparse.Namespace):
    """(AsyncLLM, prometheus stat logger, log stat logger or None) from the flags."""
    import jax
    import prometheus_client

    from jaxengine.engine.llm_engine import LLMEngine
    from jaxengine.entrypoints.async_llm import AsyncLLM
    from jaxengine.metrics import LoggingStatLogger, PrometheusStatLogger
    from server.args import engine_args_from

    prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created
    config = engine_args_from(args).create_engine_config(platform=jax.default_backend())
    engine = LLMEngine(config)
    model_config = engine.config.model_config
    metrics = PrometheusStatLogger(
        model_name=model_config.served_model_names[0], max_model_len=engine.max_model_len
    )
    loggers: list = [metrics]
    stats_log = None
    if not args.disable_log_stats:
        stats_log = LoggingStatLogger(interval=args.log_stats_interval)
        loggers.append(stats_log)
    return AsyncLLM(engine.config, engine=engine, stat_loggers=loggers), metrics, stats_log


def uvicorn_config(app, args: argparse.Namespace):
    import uvicorn

    return uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",
        port=args.port,
        uds=args.uds,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        timeout_graceful_shutdown=5,
    )


def serve(args: argparse.Namespace) -> int:
    """Runs `jaxengine serve` until interrupted."""
    import uvicorn

    from server.app import build_app

    setup_logging(args.uvicorn_log_level)
    engine, metrics, stats_log = build_engine(args)
    try:
        app = build_app(engine, args, metrics=metrics, stats_log=stats_log)
        server = uvicorn.Server(uvicorn_config(app, args))
        where = args.uds or f"http://{args.host or '0.0.0.0'}:{args.port}"
        logger.info("serving %s at %s", engine.config.model_config.served_model_names, where)
        asyncio.run(server.serve())
    finally:
        engine.shutdown()
    return 0
