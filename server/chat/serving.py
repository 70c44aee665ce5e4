"""POST /v1/chat/completions: messages rendered by the chat template, then generated.

The stream sends, per choice, a first delta with the role, content deltas, and one
last chunk carrying ``finish_reason``. ``echo`` repeats the final message's content
when it has the response role (``continue_final_message``).

The messages reach the template as `server/chat_rendering/messages.py` shapes them; a request
with ``image_url`` parts (`server/chat_rendering/images.py`) goes to the engine as the rendered text
with its images (`jaxengine/multimodal/media.py` loads them, in threads), not as token ids.

``return_token_ids`` adds the prompt's token ids (at the top level; streamed, in the
role chunks) and each choice's (per chunk when streaming); ``prompt_logprobs`` come
at the top level. ``--enable-per-request-metrics`` adds vLLM's timing ``metrics`` to a
response with ``n`` = 1 (null otherwise); a stream carries them in its final usage
chunk.

A gpt-oss model renders and parses chat in harmony instead (`server/chat_rendering/harmony.py`,
`server/chat_rendering/harmony_output.py`: the handler's ``chat_format``).

Tools (`server/tool_calls.py`) and reasoning split the generated text into
``reasoning_content``, ``content`` and ``tool_calls`` (`server/chat_rendering/output.py`);
a "required" or named ``tool_choice`` constrains the output with structured outputs,
as ``response_format`` does (`server/structured.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from jaxengine.outputs import RequestOutput
from jaxengine.structured_params import StructuredOutputsParams
from jaxengine.tokenizer import apply_chat_template, resolve_chat_template
from server import response_fields as R
from server.chat.protocol import ChatCompletionRequest
from server.chat_rendering.images import (
    NOT_HERE,
    NOT_MULTIMODAL,
    check_image_request,
    image_prompt,
    image_urls,
    load_images,
)
from server.chat_rendering.messages import (
    content_format,
    message_text,
    normalize_message,
    request_template,
)
from server.chat_rendering.output import ChatOutputParser
from server.completions import beam
from server.errors import APIError
from server.serving import (
    ServingContext,
    add_stream_metrics,
    sse,
    timing_metrics,
    until_disconnected,
    usage_flags,
)
from server.structured import structured_outputs_params
from server.tool_calls import NO_TOOLS, ToolChoice, forced_schema, resolve_tool_choice


class ChatHandler:
    """Turns a `ChatCompletionRequest` into one engine request and OpenAI responses."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self._format: Any = _UNKNOWN

    @property
    def chat_format(self) -> Any:
        """The model's own chat format, or None for the Jinja chat template: harmony
        (`server/chat_rendering/harmony.py`) for gpt-oss. Decided once, on first use."""
        if self._format is _UNKNOWN:
            from server.chat_rendering.harmony import HarmonyChatFormat, engine_speaks_harmony

            fmt = None
            if engine_speaks_harmony(getattr(self.ctx, "engine", None)):
                excluded = self.ctx.options.exclude_tools_when_tool_choice_none
                # a missing vocabulary is a 500 naming what to install, every time
                fmt = HarmonyChatFormat(exclude_tools_when_none=excluded)
            self._format = fmt
        return self._format

    def render(self, request: ChatCompletionRequest | Any) -> list[int]:
        """The prompt token ids of a request's messages (also used by /tokenize, token
        counting and embeddings' messages). Messages with images are refused (400):
        their prompt is the engine's to tokenize (`render_text`)."""
        if self.chat_format is None and image_urls(request.messages):
            raise APIError(NOT_HERE, param="messages")
        return self._token_ids(request)

    def _token_ids(self, request: Any) -> list[int]:
        """`render` once its messages are known to hold no image."""
        if self.chat_format is not None:
            return self.chat_format.render(request)
        ids = self._template(request, tokenize=True)
        if getattr(request, "add_special_tokens", False):
            bos = getattr(self.ctx.need_tokenizer(), "bos_token_id", None)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return list(ids)

    def render_text(self, request: ChatCompletionRequest) -> str:
        """The prompt text of a request's messages, each image an ``{"type": "image"}``
        part for the template to render; ``add_special_tokens`` puts the BOS text first."""
        text = self._template(request, tokenize=False)
        if request.add_special_tokens:
            bos = getattr(self.ctx.need_tokenizer(), "bos_token", None)
            if bos and not text.startswith(bos):
                text = bos + text
        return text

    def _template(self, request: Any, tokenize: bool) -> list[int] | str:
        """The messages through the chat template: token ids, or the text.

        The template gets ``tools`` (left out for ``tool_choice: "none"`` with
        --exclude-tools-when-tool-choice-none), ``documents`` and ``reasoning_effort``.
        """
        ctx = self.ctx
        tokenizer = ctx.need_tokenizer()
        kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
        template = request_template(request, kwargs, ctx.options) or ctx.options.chat_template
        try:
            template_text = resolve_chat_template(tokenizer, template)
        except ValueError as e:
            raise APIError(str(e), param="chat_template") from None
        fmt = content_format(ctx.options.chat_template_content_format, template_text)
        messages = [normalize_message(m, fmt) for m in request.messages]
        for name in ("tools", "documents", "reasoning_effort"):
            if getattr(request, name, None):
                kwargs.setdefault(name, getattr(request, name))
        excluded = ctx.options.exclude_tools_when_tool_choice_none
        if excluded and getattr(request, "tool_choice", None) == "none":
            kwargs.pop("tools", None)
        try:
            return apply_chat_template(
                tokenizer,
                messages,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=tokenize,
                **kwargs,
            )
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(f"chat template failed: {e}", param="messages") from None

    async def create(self, request: ChatCompletionRequest, raw_request=None):
        view, streams = await self.start(request)
        if request.stream:
            return sse(view.stream(streams), self.ctx.options.log_error_stack)
        return await until_disconnected(raw_request, view.collect(streams))

    async def start(self, request: ChatCompletionRequest) -> tuple[_ChatView, AsyncIterator]:
        """Queues the request in the engine: its view and output streams (after loading
        its images, if any). The other APIs over chat (Responses, Anthropic Messages)
        reshape what the view builds:
        ``await view.collect(streams)`` (a chat.completion dict) or ``view.stream(
        streams)`` (chat.completion.chunk dicts)."""
        ctx, fmt = self.ctx, self.chat_format
        choice = resolve_tool_choice(request, ctx.auto_tool_choice or fmt is not None)
        if fmt is not None:
            fmt.check(choice)
        model, lora = ctx.resolve_model(request.model)
        auto = choice.mode == "auto" and fmt is None
        tool_parser = ctx.tool_parser() if auto else None
        if tool_parser is not None:
            request = tool_parser.adjust_request(request)
        prompt = await self._prompt(request)
        extra: dict[str, Any] = {"structured_outputs": self._constraint(request, choice)}
        if fmt is not None:  # harmony's turn ends: <|return|>, <|call|>
            extra["stop_token_ids"] = [*(request.stop_token_ids or []), *fmt.stop_token_ids]
        params = request.sampling_params(
            request.wanted_max_tokens(), request.wanted_logprobs(), ctx.default_sampling, extra
        )
        if "multi_modal_data" in prompt:  # the image processor's work: off the event loop
            prepared = await asyncio.to_thread(ctx.prepare, [prompt], params, lora)
        else:
            prepared = ctx.prepare([prompt], params, lora)
        request_id = request.request_id or R.random_id("chatcmpl")
        ctx.log_request(request_id, prepared)
        streams = beam.streams(ctx, request, request_id, prepared)
        if fmt is not None:
            parser = fmt.output_parser(request, choice, _tool_call_id)
        else:
            parser = ChatOutputParser(
                request, choice, ctx.reasoning_parser(), tool_parser, _tool_call_id
            )
        prompt_ids = prepared[0].token_ids
        view = _ChatView(ctx, request, model, request_id, len(prompt_ids), parser, prompt_ids)
        return view, streams

    async def _prompt(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The engine prompt: the token ids, or with images the text and the images
        (`server/chat_rendering/images.py`), rendered before any image is fetched."""
        urls = image_urls(request.messages)  # the one scan of the messages for images
        if not urls or self.chat_format is not None:  # harmony refuses images itself
            return {"prompt_token_ids": request.kept_prompt(self._token_ids(request))}
        if not getattr(self.ctx.engine, "takes_images", False):
            raise APIError(NOT_MULTIMODAL, param="messages")
        check_image_request(request)
        text = self.render_text(request)
        images = await load_images(urls, self.ctx.options.media)
        return image_prompt(text, images, request)

    def _constraint(self, request, choice: ToolChoice) -> StructuredOutputsParams | None:
        """The request's structured outputs, or the tool-call schema it forces."""
        constraint = structured_outputs_params(request, self.ctx.structured_config)
        if not choice.forced:
            return constraint
        if constraint is not None:
            raise APIError(
                f"tool_choice {request.tool_choice!r} constrains the output to tool calls; "
                "it cannot be combined with response_format or structured outputs",
                param="tool_choice",
            )
        parallel = request.parallel_tool_calls is not False
        schema = forced_schema(request.tools, choice, parallel)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


_UNKNOWN = object()


def _tool_call_id() -> str:
    from server.tool_parsers import make_tool_call_id

    return make_tool_call_id()


class _ChatView:
    """Builds one request's response (or chunks) from its engine outputs."""

    def __init__(
        self,
        ctx: ServingContext,
        request: ChatCompletionRequest,
        model: str,
        rid: str,
        n_prompt: int,
        parser: ChatOutputParser | None = None,
        prompt_token_ids: list[int] | None = None,
    ):
        self.ctx, self.request, self.model, self.id = ctx, request, model, rid
        self.n_prompt = n_prompt
        self.prompt_ids = list(prompt_token_ids or [])
        self.token_ids = bool(request.return_token_ids)
        self.parser = parser or ChatOutputParser(request, NO_TOOLS, None, None, _tool_call_id)
        self.created = R.now()
        self.role = ctx.options.response_role
        self.as_ids = bool(request.return_tokens_as_token_ids) or (
            ctx.options.return_tokens_as_token_ids
        )
        last = request.messages[-1]
        self.echo = ""
        if request.echo and last.get("role") == self.role:
            self.echo = message_text(last)

    def _logprobs(self, seq) -> dict | None:
        top = self.request.wanted_logprobs()
        if top is None:
            return None
        if self.request.logprob_token_ids:
            top = None  # every entry: the sampled token and the ids
        return R.chat_logprobs(
            seq.token_ids, seq.logprobs or [], top, self.ctx.tokenizer, self.as_ids
        )

    def _usage(self, out: RequestOutput | None, completion: int) -> dict[str, Any]:
        """Usage so far; ``out`` None (before any output) counts no cached tokens yet."""
        cached = None
        if self.ctx.options.enable_prompt_tokens_details:
            cached = (out.num_cached_tokens or 0) if out is not None else 0
        return R.usage(self.n_prompt, completion, cached)

    async def collect(self, streams: AsyncIterator[tuple[int, RequestOutput]]) -> dict:
        final = None
        async for _, out in streams:
            final = out
        assert final is not None
        choices = []
        for seq in sorted(final.outputs, key=lambda s: s.index):
            message, called = self.parser.message_of(seq, self.role, self.echo)
            choices.append(
                {
                    "index": seq.index,
                    "message": message,
                    "logprobs": self._logprobs(seq),
                    "finish_reason": _finish_reason(seq.finish_reason, called),
                    "stop_reason": seq.stop_reason,
                    "token_ids": list(seq.token_ids) if self.token_ids else None,
                }
            )
        completion = sum(len(s.token_ids) for s in final.outputs)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(final, completion),
            "prompt_logprobs": R.prompt_logprobs(final.prompt_logprobs),
            "prompt_token_ids": list(final.prompt_token_ids) if self.token_ids else None,
            "kv_transfer_params": final.kv_transfer_params,  # (no KV connector: None)
            "metrics": self._metrics(final, completion),
        }

    def _metrics(self, out: RequestOutput | None, completion: int) -> dict | None:
        """vLLM's per-request ``metrics``: for n = 1 only."""
        single = (self.request.n or 1) == 1
        return timing_metrics(self.ctx.options, out, completion, single)

    async def stream(self, streams: AsyncIterator[tuple[int, RequestOutput]]):
        include_usage, continuous = usage_flags(self.request, self.ctx.options)
        sent: dict[int, int] = {}
        last = None
        for index in range(self.request.n):  # the role first, for every choice
            delta = {"role": self.role, "content": self.echo}
            chunk = self._chunk(index, delta, None, None, None)
            if self.token_ids:
                chunk["prompt_token_ids"] = self.prompt_ids
            if continuous:
                chunk["usage"] = self._usage(None, 0)
            yield chunk
        parsers = [self.parser.stream() for _ in range(self.request.n)]
        async for _, out in streams:
            last = out
            for seq in out.outputs:
                sent[seq.index] = sent.get(seq.index, 0) + len(seq.token_ids)
                parsed = parsers[seq.index]
                delta = parsed.feed_output(seq)
                if seq.finish_reason is not None:
                    delta = delta.add(parsed.finish())
                body = self.parser.delta_dict(delta)
                logprobs = self._logprobs(seq)
                held = not body and logprobs is None and seq.finish_reason is None
                if held and not self.token_ids:
                    continue  # the parsers hold this text back
                finish = _finish_reason(seq.finish_reason, parsed.tools_called)
                chunk = self._chunk(seq.index, body, logprobs, finish, seq.stop_reason)
                chunk["choices"][0]["token_ids"] = list(seq.token_ids) if self.token_ids else None
                if continuous:
                    chunk["usage"] = self._usage(out, sum(sent.values()))
                yield chunk
        if include_usage and last is not None:
            final = self._base([])
            final["usage"] = self._usage(last, sum(sent.values()))
            add_stream_metrics(final, self._metrics(last, sum(sent.values())))
            yield final

    def _base(self, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, index, delta, logprobs, finish_reason, stop_reason) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._base([choice])


def _finish_reason(reason: str | None, tools_called: bool) -> str | None:
    """``"tool_calls"`` for a generation that stopped by itself after calling tools."""
    return "tool_calls" if reason == "stop" and tools_called else reason
