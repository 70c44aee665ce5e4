"""The environment variables the server reads: vLLM's names, beside jaxengine's own.

Only variables whose meaning exists here are read (vLLM's ``VLLM_HOST_IP`` and
``VLLM_PORT``, say, name its internal communication address, not the API server's,
and have no counterpart):

- ``VLLM_API_KEY`` (or ``JAXENGINE_API_KEY``, which is read first): the API key when
  ``--api-key`` is not given; the flag wins, as in vLLM.
- ``VLLM_LOG_STATS_INTERVAL`` (or ``JAXENGINE_LOG_STATS_INTERVAL``): seconds between
  the stats log lines (10).
- ``VLLM_CONFIGURE_LOGGING``: 0 leaves the ``jaxengine`` loggers as they are (1).
- ``VLLM_LOGGING_LEVEL``: the level of the ``jaxengine`` loggers (default: INFO, or
  DEBUG with ``--uvicorn-log-level debug``/``trace``).
- ``VLLM_LOGGING_PREFIX``: text put before every ``jaxengine`` log line ("").
- ``VLLM_LOGGING_CONFIG_PATH``: the default of ``--log-config-file``, a JSON
  ``logging.config.dictConfig`` file for the ``jaxengine`` and uvicorn loggers.
- ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: seconds an idle HTTP connection stays open (5).

- ``VLLM_SERVER_DEV_MODE``: 1 turns on the development routes (`server/dev/routes.py`).
- ``VLLM_IMAGE_FETCH_TIMEOUT``, ``JAXENGINE_MAX_IMAGE_BYTES``: the image URLs' fetch
  timeout and size cap (`jaxengine/multimodal/media.py`).

Read elsewhere: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (`server/lora.py`) and
``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (`jaxengine/worker/build.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = environ.get(name)
        if value:
            return value
    return None


def api_keys(flag: str | list[str] | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys a request may carry (one of them): ``--api-key``'s, else
    ``$JAXENGINE_API_KEY``, else ``$VLLM_API_KEY``; empty (no key needed) when none
    is set."""
    keys = [flag] if isinstance(flag, str) else [k for k in flag or [] if k]
    if keys:
        return keys
    key = _first(environ, "JAXENGINE_API_KEY", "VLLM_API_KEY")
    return [key] if key else []


def log_stats_interval(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between stats log lines."""
    return float(_first(environ, "JAXENGINE_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL") or 10)


def configure_logging(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the server configures the ``jaxengine`` loggers (``$VLLM_CONFIGURE_LOGGING``)."""
    return environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() != "0"


def logging_level(uvicorn_level: str, environ: Mapping[str, str] = os.environ) -> str:
    """The ``jaxengine`` loggers' level name: ``$VLLM_LOGGING_LEVEL``, else from
    ``--uvicorn-log-level``."""
    level = environ.get("VLLM_LOGGING_LEVEL")
    if level:
        return level.strip().upper()
    return "DEBUG" if uvicorn_level in ("debug", "trace") else "INFO"


def logging_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """Text put before every log line (``$VLLM_LOGGING_PREFIX``)."""
    return environ.get("VLLM_LOGGING_PREFIX", "")


def logging_config_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """The JSON logging configuration file (``$VLLM_LOGGING_CONFIG_PATH``), or None."""
    return environ.get("VLLM_LOGGING_CONFIG_PATH") or None


def http_timeout_keep_alive(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds an idle keep-alive connection stays open (``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE``)."""
    return int(environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))


def dev_mode(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the development routes are on (``$VLLM_SERVER_DEV_MODE=1``): sleep and
    wake, pause and resume, prefix-cache reset, weight updates, ``/collective_rpc``
    (`server/dev/routes.py`). They let any client take the engine down: off by
    default."""
    return environ.get("VLLM_SERVER_DEV_MODE", "0").strip() in ("1", "true", "True")
