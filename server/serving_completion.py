"""POST /v1/completions: text or token-id prompts, one or many, streamed or not.

Choice ``i * n + j`` is sequence ``j`` of prompt ``i``. ``echo`` puts the prompt
before the completion (and its logprobs first, when logprobs are asked for).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from jaxengine.outputs import CompletionOutput, RequestOutput
from server import responses as R
from server.protocol import CompletionRequest
from server.serving import ServingContext, sse, until_disconnected, usage_flags
from server.structured import structured_outputs_params


class CompletionHandler:
    """Turns a `CompletionRequest` into engine requests and OpenAI responses."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: CompletionRequest, raw_request=None):
        """A response dict, or an async iterator of SSE lines when streaming."""
        ctx = self.ctx
        model, lora = ctx.resolve_model(request.model)
        logprobs = request.logprobs
        extra: dict[str, Any] = {
            "structured_outputs": structured_outputs_params(request, ctx.structured_config)
        }
        if request.echo and logprobs is not None:
            extra["prompt_logprobs"] = logprobs
        params = request.sampling_params(request.max_tokens, logprobs, ctx.default_sampling, extra)
        prompts = [ctx.tokenize(p, request.add_special_tokens) for p in request.prompts()]
        prepared = ctx.prepare(prompts, params, lora)
        request_id = request.request_id or R.random_id("cmpl")
        ctx.log_request(request_id, prepared)
        streams = ctx.streams(request_id, prepared, request.priority)
        view = _View(ctx, request, model, request_id, len(prepared))
        if request.stream:
            return sse(view.stream(streams))
        return await until_disconnected(raw_request, view.collect(streams))


class _View:
    """Builds one request's response (or chunks) from its engine outputs."""

    def __init__(self, ctx, request: CompletionRequest, model: str, rid: str, count: int):
        self.ctx, self.request, self.model, self.id = ctx, request, model, rid
        self.created = R.now()
        self.count = count
        self.as_ids = bool(request.return_tokens_as_token_ids) or (
            ctx.options.return_tokens_as_token_ids
        )
        self.show_cached = ctx.options.enable_prompt_tokens_details

    def _logprobs(self, out: RequestOutput, seq: CompletionOutput, echo: bool, offset: int):
        top = self.request.logprobs
        if top is None:
            return None
        ids, entries = list(seq.token_ids), list(seq.logprobs or [])
        if echo:
            ids = list(out.prompt_token_ids) + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        return R.completion_logprobs(ids, entries, top, self.ctx.tokenizer, self.as_ids, offset)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.ctx.tokenizer.decode(out.prompt_token_ids) if self.ctx.tokenizer else ""

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return R.usage(prompt, completion, cached if self.show_cached else None)

    async def collect(self, streams: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in streams:
            finals[index] = out
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for index in range(self.count):
            out = finals[index]
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens or 0
            for seq in sorted(out.outputs, key=lambda s: s.index):
                completion_tokens += len(seq.token_ids)
                prefix = self._prompt_text(out) if self.request.echo else ""
                choices.append(
                    {
                        "index": index * self.request.n + seq.index,
                        "text": prefix + seq.text,
                        "logprobs": self._logprobs(out, seq, self.request.echo, 0),
                        "finish_reason": seq.finish_reason,
                        "stop_reason": seq.stop_reason,
                        "prompt_logprobs": None,
                    }
                )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(prompt_tokens, completion_tokens, cached),
        }

    async def stream(self, streams: AsyncIterator[tuple[int, RequestOutput]]):
        include_usage, continuous = usage_flags(self.request, self.ctx.options)
        n = self.request.n
        sent = {}  # choice index -> generated tokens so far
        offsets = {}  # choice index -> text offset (for logprobs)
        prompts: dict[int, tuple[int, int]] = {}
        async for index, out in streams:
            prompts[index] = (len(out.prompt_token_ids), out.num_cached_tokens or 0)
            for seq in out.outputs:
                choice = index * n + seq.index
                first = choice not in sent
                echo = self.request.echo and first
                text = (self._prompt_text(out) if echo else "") + seq.text
                sent[choice] = sent.get(choice, 0) + len(seq.token_ids)
                chunk = self._chunk(
                    {
                        "index": choice,
                        "text": text,
                        "logprobs": self._logprobs(out, seq, echo, offsets.get(choice, 0)),
                        "finish_reason": seq.finish_reason,
                        "stop_reason": seq.stop_reason,
                    }
                )
                offsets[choice] = offsets.get(choice, 0) + len(text)
                if continuous:
                    chunk["usage"] = self._totals(prompts, sent)
                yield chunk
        if include_usage:
            final = self._chunk(None)
            final["usage"] = self._totals(prompts, sent)
            yield final

    def _chunk(self, choice: dict | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }

    def _totals(self, prompts: dict[int, tuple[int, int]], sent: dict[int, int]) -> dict:
        prompt = sum(p for p, _ in prompts.values())
        cached = sum(c for _, c in prompts.values())
        return self._usage(prompt, sum(sent.values()), cached)
