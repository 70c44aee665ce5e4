"""POST /v1/embeddings and vLLM's /pooling on a pooling model (``--runner pooling``):
OpenAI's embeddings endpoint with vLLM's extra fields (``truncate_prompt_tokens``,
``normalize``, ``messages`` for a conversation through the chat template).

Each input is one engine request (`PoolingParams`), prepared before any is queued;
the response lists the embeddings in input order, as floats or as base64 of their
little-endian float32 bytes (``encoding_format``), with the prompt tokens' usage.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from jaxengine.pooling_params import PoolingParams
from server import response_fields as R
from server.errors import APIError
from server.pooling.protocol import EmbeddingRequest, PoolingRequest
from server.serving import ServingContext, until_disconnected


class EmbeddingHandler:
    """Turns an `EmbeddingRequest` into engine requests and OpenAI's response."""

    def __init__(self, ctx: ServingContext, chat: Any) -> None:
        self.ctx, self.chat = ctx, chat

    async def create(self, request: EmbeddingRequest, raw_request=None) -> dict[str, Any]:
        """/v1/embeddings: one embedding per input."""
        return await self._respond(request, "embed", "embedding", raw_request)

    async def pooling(self, request: PoolingRequest, raw_request=None) -> dict[str, Any]:
        """/pooling: each input's pooled output (``task`` "token_embed": per token)."""
        return await self._respond(request, request.task, "pooling", raw_request)

    async def _respond(self, request: Any, task: str, kind: str, raw) -> dict[str, Any]:
        ctx = self.ctx
        model, lora = ctx.resolve_model(request.model)
        require_pooler(ctx)
        params = PoolingParams(
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            dimensions=request.dimensions,
            normalize=request.normalize,
            task=task,
        )
        prefix = "embd" if kind == "embedding" else "pool"
        prompts = self._prompts(request)
        request_id, finals, prepared = await run_pooled(
            ctx, request, prompts, (params, lora), prefix, raw
        )
        field = "embedding" if kind == "embedding" else "data"
        data = [
            {"index": i, "object": kind, field: _encode(v, request)} for i, v in enumerate(finals)
        ]
        tokens = sum(len(p.token_ids) for p in prepared)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"id": request_id, "object": "list", "created": R.now(), "model": model,
                "data": data, "usage": usage}  # fmt: skip

    def _prompts(self, request: EmbeddingRequest) -> list[dict]:
        if request.messages is not None:
            return [{"prompt_token_ids": self.chat.render(request)}]
        return [self.ctx.tokenize(p, request.add_special_tokens) for p in request.prompts()]


def require_pooler(ctx: ServingContext) -> None:
    """A 400 unless the server runs a pooling model (the embedding endpoints)."""
    if ctx.engine.pooler is None:
        raise APIError(
            "this model generates text and serves no embeddings: start the server "
            "with --runner pooling (--convert embed for a generative model)",
            param="model",
        )


async def run_pooled(ctx: ServingContext, request: Any, prompts: list[dict], run: tuple,
                     prefix: str, raw) -> tuple[str, list[Any], list]:  # fmt: skip
    """Runs one engine request per prompt with ``run`` = (`PoolingParams`, LoRA
    adapter or None), all prepared before any is queued: (request id, each prompt's
    pooled result in input order, the prepared prompts)."""
    params, lora = run
    prepared = ctx.prepare(prompts, params, lora)
    request_id = request.request_id or R.random_id(prefix)
    ctx.log_request(request_id, prepared)
    streams = ctx.streams(request_id, prepared, request.priority)
    finals = await until_disconnected(raw, _collect(streams))
    return request_id, [finals[i] for i in range(len(prepared))], prepared


async def _collect(streams) -> dict[int, Any]:
    finals = {}
    async for index, out in streams:
        if out.finished:
            finals[index] = out.outputs.data
    return finals


def _encode(vector: Any, request: EmbeddingRequest) -> list[float] | str:
    values = np.asarray(vector, np.float32)
    if request.encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()
