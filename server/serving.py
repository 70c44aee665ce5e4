"""What the OpenAI handlers share: the engine, the served names, prompt preparation,
merging several requests' streams, and aborting when the client goes away.

A request with several prompts (or ``n`` > 1) becomes one engine request per prompt,
``{request_id}-{i}``; every prompt is prepared (tokenized, validated) before any is
queued, so a bad one fails the whole request with nothing left running. Admission
control (``--max-num-queued-reqs/-tokens``) is checked for the whole request before its
response starts, so a refused request is an HTTP 503, streamed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from jaxengine.entrypoints.admission import AdmissionRejectedError, num_seqs
from jaxengine.entrypoints.client import EngineClient
from jaxengine.inputs import PreparedPrompt
from jaxengine.lora import LoRAAdapterNotFoundError, LoRARequest
from jaxengine.multimodal.media import MediaSettings
from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from server.disconnect import ClientDisconnected
from server.errors import APIError, error_body, log_error_stack
from server.lora import ServingModels
from server.output_log import logged_outputs
from server.protocol import GENERATION_CONFIG_DEFAULTS
from server.response_fields import per_request_metrics
from server.tracing import RequestTracer

logger = logging.getLogger("jaxengine.server")

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The frontend flags the handlers read."""

    served_model_names: tuple[str, ...]
    response_role: str = "assistant"
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_per_request_metrics: bool = False
    """Add vLLM's per-request timing ``metrics`` to completions and chat responses."""
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    """Log each generated sequence (`server/output_log.py`); with enable_log_requests."""
    max_log_len: int | None = None
    log_error_stack: bool = False
    """Log the stack trace of every error answered (in a stream's error event too)."""
    trust_request_chat_template: bool = False
    """Render with a request's own chat template; refused otherwise (vLLM)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    tool_parser_plugin: str | None = None
    reasoning_parser: str = ""
    """The engine's --reasoning-parser ("" = none)."""
    reasoning_parser_plugin: str = ""
    media: MediaSettings = MediaSettings()
    """Where chat's image URLs may point, and the fetch limits (`jaxengine/multimodal/media.py`)."""


class ServingContext:
    """The engine (one, or several data-parallel replicas) and options behind every
    handler, and the model names (served names and LoRA adapters) requests address."""

    def __init__(
        self,
        engine: EngineClient,
        options: ServerOptions,
        models: ServingModels | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = engine
        self.options = options
        self.tracer = tracer
        """Spans each finished engine request (--otlp-traces-endpoint); None: off."""
        self.models = models or ServingModels(engine, options.served_model_names)
        self.tokenizer = engine.tokenizer
        gen = engine.generation_config or {}
        self.default_sampling = {
            k: gen[k] for k in GENERATION_CONFIG_DEFAULTS if gen.get(k) is not None
        }
        self.structured_config = engine.config.structured_outputs_config
        self._tool_parser_cls = tool_parser_class(
            options.tool_call_parser, options.tool_parser_plugin
        )
        self._reasoning_parser_cls = reasoning_parser_class(options)
        self._tool_parser: Any = None
        self._reasoning_parser: Any = None

    @property
    def auto_tool_choice(self) -> bool:
        """Whether "auto" tool choice is on (a parser finds the calls in the text)."""
        return self.options.enable_auto_tool_choice and self._tool_parser_cls is not None

    def tool_parser(self) -> Any:
        """The tool parser (None without --tool-call-parser). Built once: parsers hold
        no per-request state (that lives in the streams they make)."""
        if self._tool_parser is None and self._tool_parser_cls is not None:
            self._tool_parser = self._tool_parser_cls(self.need_tokenizer())
        return self._tool_parser

    def reasoning_parser(self) -> Any:
        """The reasoning parser (None without --reasoning-parser), built once: its
        marker ids come from a vocabulary lookup that need not run per request."""
        if self._reasoning_parser is None and self._reasoning_parser_cls is not None:
            self._reasoning_parser = self._reasoning_parser_cls(self.need_tokenizer())
        return self._reasoning_parser

    @property
    def model_name(self) -> str:
        return self.options.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name a request addresses (a served name or a LoRA adapter's); 404 for
        an unknown one."""
        return self.models.resolve(name)[0]

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to echo, the LoRA adapter it runs with or None); 404 if unknown."""
        return self.models.resolve(name)

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("this server runs without a tokenizer (--skip-tokenizer-init)")
        return self.tokenizer

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> dict[str, Any]:
        """An engine prompt dict (text and ids) from a text or a token-id list."""
        if isinstance(prompt, str):
            ids = self.need_tokenizer().encode(prompt, add_special_tokens=add_special_tokens)
            return {"prompt": prompt, "prompt_token_ids": list(ids)}
        text = None
        if self.tokenizer is not None:
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if not bad:
                text = self.tokenizer.decode(prompt)
        return {"prompt": text, "prompt_token_ids": list(prompt)}

    def prepare(
        self,
        prompts: Sequence[dict],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> list[PreparedPrompt]:
        """Validates every prompt (ValueError -> 400) before any is queued; the
        prepared prompts carry ``lora_request`` (None: the base model). An adapter
        whose folder is gone is vLLM's 404 (`LoRAAdapterNotFoundError`)."""
        try:
            return [self.engine.prepare(p, params, lora_request=lora_request) for p in prompts]
        except LoRAAdapterNotFoundError as e:
            raise APIError(str(e), 404) from e

    def log_request(self, request_id: str, prepared: Sequence[PreparedPrompt]) -> None:
        if not self.options.enable_log_requests:
            return
        limit = self.options.max_log_len
        for i, p in enumerate(prepared):
            text = p.text if limit is None or p.text is None else p.text[:limit]
            ids = p.token_ids if limit is None else p.token_ids[:limit]
            logger.info(
                "Received request %s-%d: prompt: %r, params: %s, prompt_token_ids: %s",
                request_id,
                i,
                text,
                p.params,
                ids,
            )

    def log_outputs(
        self,
        request_id: str,
        prepared: Sequence[PreparedPrompt],
        streams: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``streams`` as they are, or with ``--enable-log-outputs`` logging each
        generated sequence (`server/output_log.py`)."""
        if not self.options.enable_log_outputs:
            return streams
        streaming = prepared[0].params.output_kind == RequestOutputKind.DELTA
        return logged_outputs(streams, request_id, streaming, self.options.max_log_len)

    def check_admission(self, prepared: Sequence[PreparedPrompt]) -> None:
        """Raises `AdmissionRejectedError` (503) when the request, its prompts'
        sequences together, would go over an admission cap now, before a response
        starts (vLLM's preflight); each engine request is checked again as it arrives."""
        self.engine.check_admission(sum(num_seqs(p.params) for p in prepared))

    def streams(
        self, request_id: str, prepared: Sequence[PreparedPrompt], priority: int
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every prompt's engine request, merged as they come (after
        `check_admission`)."""
        self.check_admission(prepared)
        iterators = [
            self.engine.generate(p, p.params, f"{request_id}-{i}", priority=priority)
            for i, p in enumerate(prepared)
        ]
        if self.tracer is not None:
            iterators = self.tracer.watch(iterators, prepared)
        return merge_async_iterators(iterators)


def tool_parser_class(name: str | None, plugin: str | None = None) -> Any:
    """The class of ``--tool-call-parser`` (after importing ``--tool-parser-plugin``),
    or None; ValueError for an unknown name."""
    if not name and not plugin:
        return None
    from server.tool_parsers import get_tool_parser, import_tool_parser_plugin

    if plugin:
        import_tool_parser_plugin(plugin)
    return get_tool_parser(name) if name else None


def reasoning_parser_class(options: ServerOptions) -> Any:
    """The class of the engine's ``--reasoning-parser`` (after its plugin), or None."""
    if not options.reasoning_parser:
        return None
    import jaxengine.reasoning as reasoning

    if options.reasoning_parser_plugin:
        reasoning.import_reasoning_parser_plugin(options.reasoning_parser_plugin)
    return reasoning.get_reasoning_parser(options.reasoning_parser)


async def merge_async_iterators(
    iterators: Sequence[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Yields (index, item) from several async iterators as items arrive.

    Closing the merged iterator (or an error in one source) closes every source,
    which aborts their engine requests.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    pending: dict[asyncio.Task, int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(it.aclose() for it in iterators), return_exceptions=True)


async def until_disconnected(raw_request: Request | None, work: Awaitable[T]) -> T:
    """Awaits ``work``, cancelling it (which aborts its engine requests) if the
    client disconnects first; then raises `ClientDisconnected` (a `CancelledError`)."""
    task = asyncio.ensure_future(work)
    if raw_request is None:
        return await task
    watcher = asyncio.ensure_future(_wait_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler cancelled (the server stopping): the same
        await _cancel(task, watcher)
        raise
    if not task.done():
        await _cancel(task, watcher)
        raise ClientDisconnected("client disconnected")
    watcher.cancel()
    return task.result()


async def _cancel(task: asyncio.Future, watcher: asyncio.Future) -> None:
    watcher.cancel()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _wait_disconnect(raw_request: Request) -> None:
    # The body has been read; the next ASGI message is the disconnect.
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def usage_flags(request: Any, options: ServerOptions) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk) for a streamed request, as vLLM:
    ``--enable-force-include-usage`` turns both on whatever the request says."""
    if options.enable_force_include_usage:
        return True, True
    stream_options = request.stream_options
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


def timing_metrics(
    options: ServerOptions, out: RequestOutput | None, completion_tokens: int, single: bool
) -> dict[str, float | None] | None:
    """A response's ``metrics`` (``--enable-per-request-metrics``), or None: the flag
    is off, or the request is not ``single`` (one prompt, ``n`` = 1), as in vLLM,
    whose timings describe one generation stream and are not attributed to a request
    of several."""
    if not options.enable_per_request_metrics or not single:
        return None
    return per_request_metrics(out.metrics if out is not None else None, completion_tokens)


def add_stream_metrics(chunk: dict[str, Any], metrics: dict[str, Any] | None) -> None:
    """Puts ``metrics`` on a stream's final usage chunk as vLLM serializes that chunk
    (``exclude_none``): no key without metrics, and no null fields inside."""
    if metrics is not None:
        chunk["metrics"] = {k: v for k, v in metrics.items() if v is not None}


async def sse(
    payloads: AsyncIterator[dict[str, Any]], log_stack: bool = False
) -> AsyncIterator[str]:
    """Server-sent events: ``data: {...}`` per payload, then ``data: [DONE]``.

    The status line has been sent when a stream fails, so an error travels in-band
    as one more event in OpenAI's error shape; ``log_stack`` (``--log-error-stack``)
    logs its stack trace (an unexpected error's is logged always).
    """
    try:
        async for payload in payloads:
            yield _event(payload)
    except APIError as e:
        if log_stack:
            log_error_stack(e, e.status, "a stream")
        yield _event(error_body(e.message, e.status, e.param))
    except AdmissionRejectedError as e:  # refused as it arrived, past the check before
        yield _event(error_body(str(e), 503))
    except Exception as e:  # noqa: BLE001 - reported to the client, the server goes on
        logger.exception("stream failed")
        yield _event(error_body(str(e), 500))
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
