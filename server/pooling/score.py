"""Scoring and classification endpoints, as vLLM serves them: POST /score and
/v1/score (a score per text pair), /rerank and /v1/rerank (Jina's and Cohere's shape:
documents ordered by their score against a query) and /classify (a classification
model's label probabilities per input).

On a cross-encoder a pair is one sequence with the second text's tokens typed 1
(`pair_prompt`); the score is the one-label head's sigmoid (``use_activation``
false: the logit). An embedding model scores as a bi-encoder: each text is embedded
once and a pair's score is the cosine similarity of its two embeddings. Every input
is one engine request, all prepared before any is queued.
"""

from __future__ import annotations

from typing import Any

from jaxengine.pooling_params import (
    PoolingParams,
    bi_encoder,
    cosine_similarity,
    pair_prompt,
    score_pairs,
    unique_texts,
)
from server import response_fields as R
from server.errors import APIError
from server.pooling.embedding import run_pooled
from server.pooling.protocol import ClassificationRequest, RerankRequest, ScoreRequest
from server.serving import ServingContext


class ScoreHandler:
    """/score, /rerank and /classify on one `ServingContext`."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _run(self, request: Any, prompts: list[dict], task: str, prefix: str, raw):
        """(model name, request id, results in input order, prompt tokens)."""
        ctx = self.ctx
        model, lora = ctx.resolve_model(request.model)
        pooler = ctx.engine.pooler
        if pooler is None or not pooler.num_labels:
            raise APIError(
                f"this model has no classification head: /{task} needs a "
                "*ForSequenceClassification model (a cross-encoder to score)",
                param="model",
            )
        params = PoolingParams(
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            use_activation=request.use_activation,
            task=task,
        )
        request_id, results, prepared = await run_pooled(
            ctx, request, prompts, (params, lora), prefix, raw
        )
        return model, request_id, results, sum(len(p.token_ids) for p in prepared)

    def _pairs(self, first: Any, second: Any) -> list[dict]:
        tokenizer = self.ctx.need_tokenizer()
        return [pair_prompt(tokenizer, a, b) for a, b in _score_pairs(first, second)]

    async def _scores(self, request: Any, first: Any, second: Any, prefix: str, raw):
        """(model name, request id, each pair's score, prompt tokens): a cross-encoder's
        head on each pair, or a bi-encoder's cosine of the two texts' embeddings."""
        if not bi_encoder(self.ctx.engine.pooler):
            prompts = self._pairs(first, second)
            model, rid, results, tokens = await self._run(request, prompts, "score", prefix, raw)
            return model, rid, [_one(r) for r in results], tokens
        return await self._bi_encoder_scores(request, first, second, prefix, raw)

    async def _bi_encoder_scores(self, request: Any, first: Any, second: Any, prefix: str, raw):
        if request.use_activation is not None:
            raise APIError(
                "use_activation applies to a cross-encoder's head; this embedding model "
                "scores pairs by the cosine similarity of their embeddings",
                param="use_activation",
            )
        pairs = _score_pairs(first, second)
        ctx = self.ctx
        model, lora = ctx.resolve_model(request.model)
        texts = unique_texts(pairs)
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, task="embed")
        prompts = [ctx.tokenize(t, True) for t in texts]
        run = (params, lora)
        rid, results, prepared = await run_pooled(ctx, request, prompts, run, prefix, raw)
        by_text = dict(zip(texts, results, strict=True))
        scores = [cosine_similarity(by_text[a], by_text[b]) for a, b in pairs]
        return model, rid, scores, sum(len(p.token_ids) for p in prepared)

    async def score(self, request: ScoreRequest, raw=None) -> dict[str, Any]:
        model, rid, scores, tokens = await self._scores(
            request, request.text_1, request.text_2, "score", raw
        )
        data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]
        return {"id": rid, "object": "list", "created": R.now(), "model": model,
                "data": data, "usage": _usage(tokens)}  # fmt: skip

    async def rerank(self, request: RerankRequest, raw=None) -> dict[str, Any]:
        if not request.documents:
            raise APIError("`documents` must not be empty", param="documents")
        model, rid, scores, tokens = await self._scores(
            request, request.query, request.documents, "rerank", raw
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        ranked = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                item["document"] = {"text": request.documents[i]}
            ranked.append(item)
        return {"id": rid, "model": model, "usage": {"total_tokens": tokens}, "results": ranked}

    async def classify(self, request: ClassificationRequest, raw=None) -> dict[str, Any]:
        texts = [request.input] if isinstance(request.input, str) else list(request.input)
        if not texts:
            raise APIError("`input` must not be empty", param="input")
        prompts = [self.ctx.tokenize(t, True) for t in texts]
        model, rid, results, tokens = await self._run(request, prompts, "classify", "classify", raw)
        labels = self.ctx.engine.pooler.labels
        data = []
        for i, probs in enumerate(results):
            values = [float(x) for x in probs]
            best = max(range(len(values)), key=values.__getitem__)
            data.append({"index": i, "label": labels[best] if labels else str(best),
                         "probs": values, "num_classes": len(values)})  # fmt: skip
        return {"id": rid, "object": "list", "created": R.now(), "model": model,
                "data": data, "usage": _usage(tokens)}  # fmt: skip


def _score_pairs(first: Any, second: Any) -> list[tuple]:
    try:
        return score_pairs(first, second)
    except ValueError as e:
        raise APIError(str(e)) from None


def _one(result: Any) -> float:
    if len(result) != 1:
        raise APIError(f"scoring needs a head of one label; this one has {len(result)}")
    return float(result[0])


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
