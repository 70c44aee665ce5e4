"""POST /v1/chat/completions: messages rendered by the chat template, then generated.

The stream sends, per choice, a first delta with the role, content deltas, and one
last chunk carrying ``finish_reason``. ``echo`` repeats the final message's content
when it has the response role (``continue_final_message``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from jaxengine.outputs import RequestOutput
from jaxengine.tokenizer import apply_chat_template, resolve_chat_template
from server import responses as R
from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.serving import ServingContext, sse, until_disconnected, usage_flags

_PART_TYPES_TEXT = ("text", "input_text")


class ChatHandler:
    """Turns a `ChatCompletionRequest` into one engine request and OpenAI responses."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def render(self, request: ChatCompletionRequest | Any) -> list[int]:
        """The prompt token ids of a request's messages (also used by /tokenize)."""
        ctx = self.ctx
        tokenizer = ctx.need_tokenizer()
        template = request.chat_template or ctx.options.chat_template
        try:
            template_text = resolve_chat_template(tokenizer, template)
        except ValueError as e:
            raise APIError(str(e), param="chat_template") from None
        fmt = content_format(ctx.options.chat_template_content_format, template_text)
        messages = [normalize_message(m, fmt) for m in request.messages]
        kwargs = dict(request.chat_template_kwargs or {})
        for name in ("tools", "documents"):
            if getattr(request, name, None):
                kwargs.setdefault(name, getattr(request, name))
        try:
            ids = apply_chat_template(
                tokenizer,
                messages,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **kwargs,
            )
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(f"chat template failed: {e}", param="messages") from None
        if getattr(request, "add_special_tokens", False):
            bos = getattr(tokenizer, "bos_token_id", None)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return list(ids)

    async def create(self, request: ChatCompletionRequest, raw_request=None):
        ctx = self.ctx
        model = ctx.check_model(request.model)
        ids = self.render(request)
        params = request.sampling_params(
            request.wanted_max_tokens(), request.wanted_logprobs(), ctx.default_sampling
        )
        prepared = ctx.prepare([{"prompt_token_ids": ids}], params)
        request_id = request.request_id or R.random_id("chatcmpl")
        ctx.log_request(request_id, prepared)
        streams = ctx.streams(request_id, prepared, request.priority)
        view = _ChatView(ctx, request, model, request_id, len(prepared[0].token_ids))
        if request.stream:
            return sse(view.stream(streams))
        return await until_disconnected(raw_request, view.collect(streams))


def content_format(option: str, template: str | None) -> str:
    """ "string" or "openai": how message content reaches the template."""
    if option != "auto":
        return option
    text = template or ""
    iterates = any(s in text for s in ("['type']", '["type"]', ".type ==", "content[0]"))
    return "openai" if iterates else "string"


def normalize_message(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A message whose content is a string (``fmt="string"``) or a list of text parts."""
    if "role" not in message:
        raise APIError("each message needs a `role`", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if not isinstance(content, list):
        raise APIError("message content must be a string or a list of parts", param="messages")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES_TEXT:
            raise APIError(
                f"content part type {kind!r} is not supported (text only)", param="messages"
            )
        parts.append(part.get("text", ""))
    if fmt == "openai":
        return {**message, "content": [{"type": "text", "text": t} for t in parts]}
    return {**message, "content": "\n".join(parts)}


class _ChatView:
    def __init__(self, ctx: ServingContext, request: ChatCompletionRequest, model, rid, n_prompt):
        self.ctx, self.request, self.model, self.id = ctx, request, model, rid
        self.n_prompt = n_prompt
        self.created = R.now()
        self.role = ctx.options.response_role
        self.as_ids = bool(request.return_tokens_as_token_ids) or (
            ctx.options.return_tokens_as_token_ids
        )
        last = request.messages[-1]
        self.echo = ""
        if request.echo and last.get("role") == self.role:
            self.echo = normalize_message(last, "string")["content"]

    def _logprobs(self, seq) -> dict | None:
        top = self.request.wanted_logprobs()
        if top is None:
            return None
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
        choices = [
            {
                "index": seq.index,
                "message": {"role": self.role, "content": self.echo + seq.text},
                "logprobs": self._logprobs(seq),
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
            for seq in sorted(final.outputs, key=lambda s: s.index)
        ]
        completion = sum(len(s.token_ids) for s in final.outputs)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(final, completion),
            "prompt_logprobs": None,
        }

    async def stream(self, streams: AsyncIterator[tuple[int, RequestOutput]]):
        include_usage, continuous = usage_flags(self.request, self.ctx.options)
        sent: dict[int, int] = {}
        last = None
        for index in range(self.request.n):  # the role first, for every choice
            delta = {"role": self.role, "content": self.echo}
            chunk = self._chunk(index, delta, None, None, None)
            if continuous:
                chunk["usage"] = self._usage(None, 0)
            yield chunk
        async for _, out in streams:
            last = out
            for seq in out.outputs:
                sent[seq.index] = sent.get(seq.index, 0) + len(seq.token_ids)
                chunk = self._chunk(
                    seq.index,
                    {"content": seq.text},
                    self._logprobs(seq),
                    seq.finish_reason,
                    seq.stop_reason,
                )
                if continuous:
                    chunk["usage"] = self._usage(out, sum(sent.values()))
                yield chunk
        if include_usage and last is not None:
            final = self._base([])
            final["usage"] = self._usage(last, sum(sent.values()))
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
