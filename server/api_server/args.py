"""`jaxengine serve` flags: the frontend's, with vLLM's names, beside the engine's.

The engine flags (`EngineArgs.add_cli_args`) already include ``--chat-template``,
``--served-model-name`` and ``--config``; this module adds the HTTP server's own.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from jaxengine.config.arg_utils import parse_json
from jaxengine.engine_args import EngineArgs
from server import envs
from server.api_server.drain import SHUTDOWN_TIMEOUT
from server.lora import check_lora_modules, parse_lora_module
from server.tracing import add_tracing_args, check_tracing_args

UVICORN_LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")
CONTENT_FORMATS = ("auto", "string", "openai")
H11_MAX_INCOMPLETE_EVENT_SIZE = 4194304  # vLLM's default (h11's own is 16 KiB)
H11_MAX_HEADER_COUNT = 256

logger = logging.getLogger("jaxengine.server")


def _json_list(text: str) -> list[str]:
    value = parse_json(text)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the frontend flags (group "Frontend") and the engine flags."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve (overrides --model; default: the demo SmolLM2-135M-Instruct)",
    )
    g = parser.add_argument_group("Frontend", "the OpenAI-compatible HTTP server")
    _add_http_args(g.add_argument)
    _add_process_args(g.add_argument)
    _add_tls_and_limit_args(g.add_argument)
    _add_shutdown_args(g.add_argument)
    _add_api_args(g.add_argument)
    _add_tool_args(g.add_argument)
    add_lora_args(g.add_argument)
    _add_logging_args(g.add_argument)
    add_tracing_args(parser)  # --otlp-traces-endpoint, --collect-detailed-traces
    EngineArgs.add_cli_args(parser)
    # seconds between the stats lines: $JAXENGINE_LOG_STATS_INTERVAL or $VLLM_LOG_STATS_INTERVAL
    parser.set_defaults(log_stats_interval=envs.log_stats_interval(), background_compile=True)
    return parser


NO_FRONTEND_PROCESS = (
    "vLLM: run the engine in the API server's process rather than its own. Always so "
    "here (see --api-server-count): accepted, it changes nothing"
)


def _add_http_args(add: Any) -> None:
    """Binding, CORS, auth and middleware."""
    add("--host", default=None, help="host name to bind (default: all interfaces)")
    add("--port", type=int, default=8000, help="port to bind (default: 8000)")
    add("--uds", default=None, help="Unix domain socket path; if set, host and port are ignored")
    add("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info", help="uvicorn's level")
    add("--disable-uvicorn-access-log", action="store_true", help="no per-request access log")
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add("--allowed-origins", type=_json_list, default=["*"], help="CORS origins (JSON list)")
    add("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list)")
    add("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list)")
    add(
        "--api-key",
        nargs="+",
        default=None,
        help="require one of these keys (Authorization: Bearer KEY) on the routes under "
        "/v1, /v2, /inference and /cohere, as vLLM (the others, e.g. /health, /metrics, "
        "/tokenize, /invocations, stay open); without the flag, one key is read from "
        "$JAXENGINE_API_KEY or $VLLM_API_KEY",
    )
    add(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="message content as a string, or as OpenAI's list of parts; auto detects "
        "it from the template",
    )
    add(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="use a chat template sent in a request (chat_template, or chat_template in "
        "chat_template_kwargs); without it such a request is refused and the server "
        "always renders with --chat-template or the tokenizer's template",
    )
    add("--root-path", default=None, help="FastAPI root_path behind a path-based proxy")
    add(
        "--middleware",
        action="append",
        default=[],
        help="extra middleware, as module.attribute (an ASGI class or an async http "
        "function); may be repeated",
    )
    add("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json")


def _add_process_args(add: Any) -> None:
    """How many API server processes front the engine (one: the engine is in-process)."""
    add(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="API server processes in front of the engine (vLLM: several frontend "
        "processes over one engine core process). Only 1: the engine runs inside the "
        "API server's process (stepped on a thread), so there is no separate engine "
        "process for several servers to share; more throughput comes from "
        "--data-parallel-size (more engines behind the one server)",
    )
    add("--disable-frontend-multiprocessing", action="store_true", help=NO_FRONTEND_PROCESS)


def _add_shutdown_args(add: Any) -> None:
    """Graceful drain on SIGTERM/SIGINT (`server.api_server.drain`)."""
    add(
        "--shutdown-timeout",
        type=_non_negative_seconds,
        default=SHUTDOWN_TIMEOUT,
        help="on SIGTERM or SIGINT, seconds the requests in flight get to finish before "
        'they are aborted (a stream then ends with finish_reason "abort", a '
        "non-streamed request gets its partial output); meanwhile new requests and "
        "/health get 503 with Retry-After. Then the server exits 0; a second signal "
        "stops at once. A --headless data parallel node drains its requests the same "
        "way (default: 0, as vLLM: abort at once)",
    )


def _add_tls_and_limit_args(add: Any) -> None:
    """TLS (uvicorn's settings, and refreshing them) and the h11 request limits."""
    add("--ssl-keyfile", default=None, help="TLS key file")
    add("--ssl-certfile", default=None, help="TLS certificate file")
    add("--ssl-ca-certs", default=None, help="CA certificates file")
    add("--ssl-cert-reqs", type=int, default=0, help="whether client certificates are required")
    add(
        "--enable-ssl-refresh",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reload the TLS certificate chain (and --ssl-ca-certs) when its files change, "
        "for new connections (needs --ssl-keyfile and --ssl-certfile)",
    )
    add(
        "--h11-max-incomplete-event-size",
        type=int,
        default=H11_MAX_INCOMPLETE_EVENT_SIZE,
        help="maximum size (bytes) of an incomplete HTTP event (header or body) for the h11 "
        "parser: a request still incomplete past it gets 400 (default: 4194304, 4 MB)",
    )
    add(
        "--h11-max-header-count",
        type=int,
        default=H11_MAX_HEADER_COUNT,
        help="maximum number of HTTP headers in a request; a request with more gets 431 "
        "(default: 256)",
    )


def _add_api_args(add: Any) -> None:
    """How the OpenAI endpoints answer."""
    add("--response-role", default="assistant", help="the role of chat replies")
    add(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob tokens as 'token_id:N' instead of their text",
    )
    add("--enable-request-id-headers", action="store_true", help="add X-Request-Id to responses")
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report prompt_tokens_details.cached_tokens in usage",
    )
    add(
        "--enable-server-load-tracking",
        action="store_true",
        help="count requests in flight and serve them at GET /load",
    )
    add(
        "--enable-force-include-usage",
        action="store_true",
        help="usage in every stream whatever its stream_options: on every chunk and in "
        "a last usage-only chunk",
    )
    add(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's configuration (its chat "
        "template and other settings may be exposed)",
    )
    add(
        "--enable-per-request-metrics",
        action="store_true",
        help="include per-request timing metrics in completions and chat completions "
        "responses: a `metrics` object (time_to_first_token_ms, generation_time_ms, "
        "queue_time_ms, mean_itl_ms, tokens_per_second) for a request with one prompt "
        "and n = 1; when streaming, in the final usage chunk",
    )
    add(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="how many /v1/responses responses (store: true, the default) the server "
        "keeps in memory for GET /v1/responses/{id}, previous_response_id and cancel; "
        "beyond it the least recently used finished response is dropped (default: "
        "1024; 0 stores none and refuses background responses)",
    )


def _add_tool_args(add: Any) -> None:
    """Tool calling (vLLM's flags)."""
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model decides to call tools, and '
        "--tool-call-parser finds the calls in its text",
    )
    add(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls (deepseek_v3, deepseek_v31, glm45, hermes, "
        "kimi_k2, llama3_json, llama4_pythonic, mistral, pythonic, qwen3_xml, or one "
        "registered by --tool-parser-plugin); needed by "
        "--enable-auto-tool-choice",
    )
    add("--tool-parser-plugin", default=None, help="a Python file that registers tool parsers")
    add(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt of a request with tool_choice "none"',
    )
    add(
        "--tool-server",
        default=None,
        help="vLLM's built-in tools (demo) or MCP tool servers (host:port,...) for "
        "/v1/responses: not supported yet (refused at start-up)",
    )


def add_lora_args(add: Any) -> None:
    """LoRA adapters served from start-up (vLLM's flag)."""
    add(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        action="extend",
        default=[],
        metavar="MODULE",
        help="LoRA adapters to serve (needs --enable-lora), each as name=path or as JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request selects one by '
        "its name in the model field. May be repeated",
    )


def _add_logging_args(add: Any) -> None:
    """Logs, stats and headless nodes."""
    add("--max-log-len", type=int, default=None, help="characters of prompt text to log")
    add("--disable-log-stats", action="store_true", help="no periodic stats lines")
    add(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's prompt and params",
    )
    add(
        "--disable-log-requests",
        "--no-disable-log-requests",
        action=DeprecatedNegation,
        dest="enable_log_requests",
        help="[DEPRECATED] the opposite of --enable-log-requests (request logging is off "
        "by default)",
    )
    add(
        "--enable-log-outputs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also log each generated sequence (text, token ids, finish reason; each "
        "delta of a stream too); needs --enable-log-requests",
    )
    add(
        "--log-error-stack",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log the stack trace of every error returned to a client",
    )
    add(
        "--log-config-file",
        default=envs.logging_config_path(),
        help="a JSON logging configuration (logging.config.dictConfig) for the jaxengine "
        "and uvicorn loggers, applied at start-up (default: $VLLM_LOGGING_CONFIG_PATH)",
    )
    add(
        "--headless",
        action="store_true",
        help="run a node without an API server: a follower of a multi-node engine "
        "(--nnodes, --node-rank > 0), which runs the steps that node 0 schedules, or "
        "data parallel replicas (--data-parallel-address, --data-parallel-start-rank, "
        "--data-parallel-size-local) that serve the head node's requests; either stops "
        "when the head stops",
    )


def check_server_args(args: argparse.Namespace) -> None:
    """Frontend flags that cannot work (ValueError), checked before the engine loads:
    several API server processes, auto tool choice without a parser, an unknown parser
    name, a broken plugin, ``--lora-modules`` without ``--enable-lora`` or with a name
    twice, ``--enable-per-request-metrics`` with ``--disable-log-stats`` (as vLLM), a
    negative ``--max-stored-responses``, and `check_http_and_logging_args`'s."""
    from server.serving import tool_parser_class

    check_api_server_count(getattr(args, "api_server_count", 1))
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")
    tool_parser_class(args.tool_call_parser, args.tool_parser_plugin)
    check_lora_modules(getattr(args, "lora_modules", []), getattr(args, "enable_lora", False))
    if getattr(args, "max_stored_responses", 0) < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if getattr(args, "enable_per_request_metrics", False) and args.disable_log_stats:
        raise ValueError(
            "--enable-per-request-metrics requires engine statistics logging; remove "
            "--disable-log-stats to enable per-request metrics."
        )
    check_http_and_logging_args(args)
    check_tracing_args(args)


def check_api_server_count(count: int) -> None:
    """ValueError unless ``count`` is 1: the engine lives in the API server's process
    (vLLM runs its engine core in a process of its own, which N API servers share)."""
    if count == 1:
        return
    if count < 1:
        raise ValueError(
            f"--api-server-count={count} is not supported: to run an engine without an "
            "API server, use --headless"
        )
    raise ValueError(
        f"--api-server-count={count} is not supported: jaxengine's engine runs inside "
        "its API server's process, not in a separate engine core process that several "
        "API servers could share. Use --api-server-count=1 (the default); "
        "--data-parallel-size adds engines behind the one API server."
    )


def check_http_and_logging_args(args: argparse.Namespace) -> None:
    """ValueError for ``--tool-server`` (no built-in or MCP tools yet),
    ``--enable-log-outputs`` without ``--enable-log-requests`` (as vLLM),
    ``--enable-ssl-refresh`` without a key and certificate to reload, and an h11 limit
    below 1."""
    if getattr(args, "tool_server", None):
        raise ValueError(
            f"--tool-server {args.tool_server} is not supported yet: jaxengine has no "
            "built-in tools (demo) and no MCP tool servers; /v1/responses serves function "
            "tools, which the client runs"
        )
    if getattr(args, "enable_log_outputs", False) and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs requires --enable-log-requests")
    if getattr(args, "enable_ssl_refresh", False) and not (args.ssl_keyfile and args.ssl_certfile):
        raise ValueError(
            "--enable-ssl-refresh requires --ssl-keyfile and --ssl-certfile: it reloads "
            "those files when they change"
        )
    for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
        value = getattr(args, name, 1)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


class DeprecatedNegation(argparse.Action):
    """A deprecated flag meaning the opposite of ``dest``'s own flag (vLLM's
    ``--disable-log-requests`` for ``--enable-log-requests``): ``--X`` sets ``dest``
    False, ``--no-X`` True, each with a deprecation warning; of several flags on one
    command line, the last wins, as for any flag and its ``--no-`` form."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = option_string.startswith("--no-")
        flag = "--" + self.dest.replace("_", "-")
        instead = flag if value else f"--no-{flag[2:]} (the default)"
        logger.warning("%s is deprecated, as in vLLM: use %s instead", option_string, instead)
        setattr(namespace, self.dest, value)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; a positional MODEL wins over ``--model``."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return EngineArgs.from_cli_args(args)
