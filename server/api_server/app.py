"""The FastAPI app: every API's routes, tokenization, health, metrics, and middleware.

`build_app(engine, args)` wires the handlers to an `EngineClient` (an `AsyncLLM`, or
a `DPAsyncLLM` with ``--data-parallel-size`` > 1); `server/api_server/launch.py` adds
the ``--lora-modules`` adapters (`server/lora.py`) and serves it with uvicorn. Each API
registers its own routes (``add_*_routes`` in its folder's ``routes.py``); this module
is where they meet (`server/api_server/` is the one folder that imports the API
folders; the modules the APIs share import none of them). Every
error leaves the app in OpenAI's error shape (see `server/errors.py`), Anthropic's on
its /v1/messages routes (`server/messages/errors.py`); none of them stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import inspect
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.engine.rollout import EngineSleepingError
from jaxengine.entrypoints.admission import AdmissionRejectedError
from jaxengine.entrypoints.client import EngineClient, EngineDeadError, EngineDrainingError
from jaxengine.multimodal.media import media_settings
from jaxengine.version import __version__
from server import envs
from server.api_server.drain import SHUTDOWN_TIMEOUT, Drain, DrainMiddleware
from server.api_server.http_limits import HeaderCountLimitMiddleware
from server.batch.routes import add_batch_routes
from server.chat.routes import add_chat_routes
from server.chat.serving import ChatHandler
from server.completions.routes import add_completions_routes
from server.completions.serving import CompletionHandler
from server.decisions.routes import add_decisions_routes
from server.dev.extra_routes import add_extra_routes
from server.dev.routes import add_dev_routes
from server.disconnect import DisconnectMiddleware
from server.errors import APIError, error_response, log_error_stacks, validation_message
from server.lora import add_lora_routes, runtime_updating_allowed
from server.messages.errors import anthropic_error_response, is_messages_path
from server.messages.routes import add_messages_routes
from server.pooling.embedding import EmbeddingHandler
from server.pooling.routes import add_pooling_routes
from server.pooling.score import ScoreHandler
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.responses.routes import add_responses_routes
from server.serving import ServerOptions, ServingContext
from server.tracing import RequestTracer, TraceHeadersMiddleware, request_tracer

logger = logging.getLogger("jaxengine.server")


def server_options(args: Any, engine: EngineClient) -> ServerOptions:
    """The handler options from parsed `serve` flags (and the engine's reasoning parser
    and media flags)."""
    so = engine.config.structured_outputs_config
    return ServerOptions(
        served_model_names=tuple(engine.config.model_config.served_model_names),
        response_role=args.response_role,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_per_request_metrics=getattr(args, "enable_per_request_metrics", False),
        enable_log_requests=args.enable_log_requests,
        enable_log_outputs=getattr(args, "enable_log_outputs", False),
        max_log_len=args.max_log_len,
        log_error_stack=getattr(args, "log_error_stack", False),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        exclude_tools_when_tool_choice_none=getattr(
            args, "exclude_tools_when_tool_choice_none", False
        ),
        tool_parser_plugin=getattr(args, "tool_parser_plugin", None),
        reasoning_parser=so.reasoning_parser_name or "",
        reasoning_parser_plugin=so.reasoning_parser_plugin or "",
        media=media_settings(engine.config.multimodal_config),
    )


def build_app(
    engine: EngineClient,
    args: Any,
    metrics: Any = None,
    stats_logs: Sequence[Any] = (),
) -> FastAPI:
    """The app for ``engine``; ``args`` holds the `serve` flags (server/api_server/args.py).

    ``stats_logs``: `LoggingStatLogger`s (one per data-parallel replica) to log from
    every ``--log-stats-interval``.
    """
    options = server_options(args, engine)
    tracer = request_tracer(args, options.served_model_names[0])  # --otlp-traces-endpoint
    ctx = ServingContext(engine, options, tracer=tracer)
    docs = not args.disable_fastapi_docs
    app = FastAPI(
        title="jaxengine OpenAI-compatible API",
        version=__version__,
        root_path=args.root_path or "",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        lifespan=_lifespan(stats_logs, args, tracer),
    )
    app.state.ctx = ctx
    app.state.metrics = metrics  # also read for the ORCA load header (server/respond.py)
    app.state.server_load = 0
    # SIGTERM's drain (server/api_server/drain.py): launch.py's DrainingServer signals it
    app.state.drain = Drain(engine, getattr(args, "shutdown_timeout", SHUTDOWN_TIMEOUT))
    _add_exception_handlers(app)
    if args.log_error_stack:
        log_error_stacks(app)
    _add_middleware(app, args)
    _add_routes(app, ctx, metrics, args)
    return app


def _lifespan(stats_logs: Sequence[Any], args: Any, tracer: RequestTracer | None):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if stats_logs:
            task = asyncio.create_task(_log_stats(stats_logs, args.log_stats_interval))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            if tracer is not None:  # the spans still queued go out before the exit
                await asyncio.to_thread(tracer.shutdown)

    return lifespan


async def _log_stats(stats_logs: Sequence[Any], interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for stats_log in stats_logs:
            stats_log.log()


# ---------------------------------------------------------------------- routes


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: Any, args: Any) -> None:
    """Every API's routes (each API folder's ``routes.py``), then the server's own."""
    chat = ChatHandler(ctx)
    _add_generation_routes(app, ctx, chat, args)
    add_messages_routes(app, ctx, chat, _check_awake)  # Anthropic's /v1/messages, over chat
    add_pooling_routes(app, ctx, chat)  # a pooling model's: embeddings, score, Cohere
    _add_token_routes(app, ctx, chat)
    _add_status_routes(app, ctx, metrics, args)
    handlers = {
        "chat": chat,
        "completions": CompletionHandler(ctx),
        "embeddings": EmbeddingHandler(ctx, chat),
        "scores": ScoreHandler(ctx),
    }
    add_batch_routes(app, chat)  # /v1/chat/completions/batch
    add_extra_routes(app, ctx, handlers, args)  # /invocations, /ping, /tokenizer_info
    if envs.dev_mode():
        add_dev_routes(app, ctx.engine)  # /sleep, /pause, /collective_rpc, ...
    if runtime_updating_allowed():
        if ctx.engine.config.lora_config.enable_lora:
            add_lora_routes(app, ctx.models)
        else:
            logger.warning("runtime LoRA updating is allowed, but LoRA is off (--enable-lora)")


def _add_generation_routes(app: FastAPI, ctx: ServingContext, chat: ChatHandler, args: Any) -> None:
    """The OpenAI endpoints: completions, chat completions, models, responses, decisions."""
    add_completions_routes(app, ctx, _check_awake)
    add_chat_routes(app, ctx, chat, _check_awake)

    @app.get("/v1/models")
    async def show_models():
        return {"object": "list", "data": ctx.models.cards()}

    stored = getattr(args, "max_stored_responses", 1024)
    add_responses_routes(app, ctx, chat, stored, _check_awake)  # /v1/responses, over chat
    add_decisions_routes(app, ctx, chat, _check_awake)  # /v1/decisions: next-token reads


def _check_awake(ctx: ServingContext) -> None:
    """503 while the engine sleeps (`/sleep`), before any stream starts."""
    if ctx.engine.is_sleeping:
        raise APIError("the engine is asleep (sleep mode): POST /wake_up first", 503)


def _add_token_routes(app: FastAPI, ctx: ServingContext, chat: ChatHandler) -> None:
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        ctx.check_model(request.model)
        if request.messages is not None:
            ids = chat.render(request)
        else:
            ids = ctx.tokenize(request.prompt, request.add_special_tokens)["prompt_token_ids"]
        strs = None
        if request.return_token_strs:
            strs = ctx.need_tokenizer().convert_ids_to_tokens(ids)
        return {
            "count": len(ids),
            "max_model_len": ctx.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,  # vLLM always sends the key (null unless asked for)
        }

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        ctx.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < ctx.engine.vocab_size]
        if bad:
            raise APIError(
                f"token id {bad[0]} is out of vocabulary (size {ctx.engine.vocab_size})",
                param="tokens",
            )
        return {"prompt": ctx.need_tokenizer().decode(request.tokens)}


def _add_status_routes(app: FastAPI, ctx: ServingContext, metrics: Any, args: Any) -> None:
    """/health, /version, /metrics and (with --enable-server-load-tracking) /load."""

    @app.get("/health")
    async def health():
        try:
            await ctx.engine.check_health()
        except EngineDeadError as e:
            return error_response(str(e), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def show_metrics():
        from jaxengine.metrics.loggers import render_metrics

        if metrics is None:
            raise APIError("metrics are off", 404)
        body, content_type = render_metrics(metrics.registry)
        return Response(body, media_type=content_type)

    if args.enable_server_load_tracking:

        @app.get("/load")
        async def load():
            return {"server_load": app.state.server_load}


# ---------------------------------------------------------------------- errors


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError):
        return error_response(str(exc), 400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError):
        return error_response(str(exc), 500)

    @app.exception_handler(EngineDrainingError)  # a headless node that is draining
    async def engine_draining(_: Request, exc: EngineDrainingError):
        return error_response(str(exc), 503)

    @app.exception_handler(EngineSleepingError)
    async def engine_sleeping(_: Request, exc: EngineSleepingError):
        return error_response(str(exc), 503)

    @app.exception_handler(AdmissionRejectedError)  # over --max-num-queued-reqs/-tokens
    async def admission_rejected(_: Request, exc: AdmissionRejectedError):
        return error_response(str(exc), 503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if is_messages_path(_path(request.scope)):  # e.g. a GET: Anthropic's shape there
            return anthropic_error_response(str(exc.detail), exc.status_code)
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        logger.exception("request failed")
        return error_response(f"internal error: {exc!r}", 500)


# ---------------------------------------------------------------------- middleware


def _add_middleware(app: FastAPI, args: Any) -> None:
    # Pure ASGI middleware (not BaseHTTPMiddleware): it passes `receive` through
    # untouched, so handlers still see the client's disconnect.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    keys = envs.api_keys(args.api_key)  # the flag's, else $JAXENGINE_API_KEY or $VLLM_API_KEY
    if keys:
        app.add_middleware(AuthMiddleware, keys=keys)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if args.enable_server_load_tracking:
        app.add_middleware(LoadTrackingMiddleware, state=app.state)
    for path in args.middleware or []:
        _add_user_middleware(app, path)
    if getattr(args, "otlp_traces_endpoint", None):
        app.add_middleware(TraceHeadersMiddleware)  # each request's traceparent, for spans
    app.add_middleware(DisconnectMiddleware)  # a client gone: no answer, no error log
    app.add_middleware(HeaderCountLimitMiddleware, max_count=args.h11_max_header_count)
    # outermost: while draining, a new request is refused before anything else runs
    app.add_middleware(DrainMiddleware, drain=app.state.drain)


GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""The paths ``--api-key`` guards: vLLM's ``AuthenticationMiddleware`` prefixes. As in
vLLM, the rest (/health, /ping, /load, /version, /metrics, /tokenize, /detokenize,
/tokenizer_info, /invocations, /pooling, /score, /rerank, /classify, the docs) stays
open."""


class AuthMiddleware:
    """401 for a request under `GUARDED_PREFIXES` (but a CORS preflight, OPTIONS)
    without ``Authorization: Bearer <key>`` (the scheme in any case, as vLLM) or
    Anthropic's ``x-api-key: <key>`` for one of ``keys``; in Anthropic's error shape
    on its /v1/messages routes."""

    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self.expected = [key.encode() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path = _path(scope)
        if path.startswith(GUARDED_PREFIXES) and not self._authorized(scope):
            message = "Unauthorized: a valid API key is required"
            response = (
                anthropic_error_response(message, 401)
                if is_messages_path(path)
                else error_response(message, 401)
            )
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        given = [bearer] if scheme.lower() == b"bearer" else []
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"])
        # every pair compared, so the time does not tell which key came close
        return any([hmac.compare_digest(g, key) for g in given for key in self.expected])


class RequestIdMiddleware:
    """Echoes ``X-Request-Id`` (or a new id) in the response headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


class LoadTrackingMiddleware:
    """Counts `/v1/*` requests in flight (streams included) for ``GET /load``."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _is_api(scope):
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


def _is_api(scope) -> bool:
    return _path(scope).startswith("/v1")


def _path(scope) -> str:
    """The request's path below ``--root-path``."""
    return scope["path"].removeprefix(scope.get("root_path", "") or "")


def _add_user_middleware(app: FastAPI, path: str) -> None:
    """``--middleware module.attr``: a class (ASGI middleware) or an http function."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r}: give it as module.attribute")
    obj = getattr(importlib.import_module(module_name), attr)
    if inspect.isclass(obj):
        app.add_middleware(obj)
    elif inspect.iscoroutinefunction(obj):
        app.middleware("http")(obj)
    else:
        raise ValueError(f"--middleware {path!r} is neither a class nor an async function")
