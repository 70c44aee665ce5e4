"""POST /v1/completions: text or token-id prompts, one or many, streamed or not.

Choice ``i * n + j`` is sequence ``j`` of prompt ``i``. ``echo`` puts the prompt
before the completion (and its logprobs first, when logprobs are asked for; they are
also the choice's ``prompt_logprobs`` then, unless the request names its own).
``return_token_ids`` adds the prompt's and the choice's token ids (per chunk when
streaming, the prompt's in a choice's first chunk); as in vLLM, ``echo`` then leaves
the prompt text out (its ids are there). ``--enable-per-request-metrics`` adds vLLM's
timing ``metrics`` to a response with one prompt and ``n`` = 1 (null otherwise); a
stream carries them in its final usage chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from jaxengine.outputs import CompletionOutput, RequestOutput
from server import response_fields as R
from server.completions import beam
from server.completions.protocol import CompletionRequest
from server.serving import (
    ServingContext,
    add_stream_metrics,
    sse,
    timing_metrics,
    until_disconnected,
    usage_flags,
)
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
        if request.echo and logprobs is not None and request.prompt_logprobs is None:
            extra["prompt_logprobs"] = logprobs
        params = request.sampling_params(request.max_tokens, logprobs, ctx.default_sampling, extra)
        prompts = [
            _truncated(ctx.tokenize(p, request.add_special_tokens), request)
            for p in request.prompts()
        ]
        prepared = ctx.prepare(prompts, params, lora)
        request_id = request.request_id or R.random_id("cmpl")
        ctx.log_request(request_id, prepared)
        streams = beam.streams(ctx, request, request_id, prepared)
        view = _View(ctx, request, model, request_id, len(prepared))
        if request.stream:
            return sse(view.stream(streams), ctx.options.log_error_stack)
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
        self.token_ids = bool(request.return_token_ids)

    def _logprobs(self, out: RequestOutput, seq: CompletionOutput, echo: bool, offset: int):
        if self.request.logprobs is None:
            return None
        # every entry with logprob_token_ids (the sampled token and the ids)
        top = None if self.request.logprob_token_ids else self.request.logprobs
        ids, entries = list(seq.token_ids), list(seq.logprobs or [])
        if echo:
            ids = list(out.prompt_token_ids) + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        return R.completion_logprobs(ids, entries, top, self.ctx.tokenizer, self.as_ids, offset)

    def _prompt_text(self, out: RequestOutput) -> str:
        if self.token_ids:
            return ""  # vLLM: with return_token_ids the echo is the prompt's ids
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
            prompt_logprobs = R.prompt_logprobs(out.prompt_logprobs)
            for seq in sorted(out.outputs, key=lambda s: s.index):
                completion_tokens += len(seq.token_ids)
                choice = self._choice(index, out, seq)
                choices.append({**choice, "prompt_logprobs": prompt_logprobs})
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(prompt_tokens, completion_tokens, cached),
            "kv_transfer_params": finals[0].kv_transfer_params,  # (no KV connector: None)
            "metrics": self._metrics(finals.get(0), completion_tokens),
        }

    def _metrics(self, out: RequestOutput | None, completion_tokens: int) -> dict | None:
        """vLLM's per-request ``metrics``: for one prompt and n = 1 only."""
        single = self.count == 1 and self.request.n == 1
        return timing_metrics(self.ctx.options, out, completion_tokens, single)

    def _choice(self, index: int, out: RequestOutput, seq: CompletionOutput) -> dict[str, Any]:
        """A whole (not streamed) choice, but its prompt logprobs."""
        prefix = self._prompt_text(out) if self.request.echo else ""
        return {
            "index": index * self.request.n + seq.index,
            "text": prefix + seq.text,
            "logprobs": self._logprobs(out, seq, self.request.echo, 0),
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "prompt_token_ids": list(out.prompt_token_ids) if self.token_ids else None,
            "token_ids": list(seq.token_ids) if self.token_ids else None,
        }

    async def stream(self, streams: AsyncIterator[tuple[int, RequestOutput]]):
        include_usage, continuous = usage_flags(self.request, self.ctx.options)
        n = self.request.n
        sent = {}  # choice index -> generated tokens so far
        offsets = {}  # choice index -> text offset (for logprobs)
        prompts: dict[int, tuple[int, int]] = {}
        last = None
        async for index, out in streams:
            last = out
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
                        **self._chunk_token_ids(out, seq, first),
                    }
                )
                offsets[choice] = offsets.get(choice, 0) + len(text)
                if continuous:
                    chunk["usage"] = self._totals(prompts, sent)
                yield chunk
        if include_usage:
            final = self._chunk(None)
            final["usage"] = self._totals(prompts, sent)
            add_stream_metrics(final, self._metrics(last, sum(sent.values())))
            yield final

    def _chunk_token_ids(self, out: RequestOutput, seq: CompletionOutput, first: bool) -> dict:
        """A chunk's ``prompt_token_ids`` (a choice's first chunk) and ``token_ids``
        (its delta), or nulls without ``return_token_ids``."""
        if not self.token_ids:
            return {"prompt_token_ids": None, "token_ids": None}
        prompt = list(out.prompt_token_ids) if first else None
        return {"prompt_token_ids": prompt, "token_ids": list(seq.token_ids)}

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


def _truncated(prompt: dict[str, Any], request: CompletionRequest) -> dict[str, Any]:
    """``prompt`` cut to its first ``truncate_prompt_tokens`` with ``truncation_side:
    "right"`` (the engine keeps the last ones, vLLM's default "left"); the text of a
    cut prompt is decoded again from what is left."""
    ids = request.kept_prompt(prompt["prompt_token_ids"])
    if len(ids) == len(prompt["prompt_token_ids"]):
        return prompt
    return {"prompt": None, "prompt_token_ids": ids}
