"""OpenAI's Decisions API, as vLLM serves it: ``POST /v1/decisions``.

No text is generated: each question's answer is read from the model's next-token
distribution, as vLLM does it. Every question is its own chat prompt, the input's
messages with the question asked in the last user turn and its answer labels listed
(`server/decisions/prompt.py`), rendered by the chat template with the generation
prompt and ``enable_thinking: false`` (so a thinking template's answer does not start
inside a reasoning block). The prompt runs as one chat request with ``max_tokens: 1``,
greedy, neutral sampling fields (so the logprobs are the same in every
``--logprobs-mode``) and ``logprob_token_ids`` = the labels' first tokens; their
full-vocabulary logprobs, normalised over the labels, are the answer
(`server/decisions/answers.py`). A question of over 128 labels (the engine's cap on
``logprob_token_ids``) is read in several requests over the same prompt, whose
logprobs join exactly. The token each read samples is discarded.

The reads go through `ChatHandler.start`, so the chat template, images (on a model that
takes them; elsewhere an image part is a 400 naming it), LoRA adapters named in
``model``, the request log, admission control and ``/metrics`` are chat's. Every read
is prepared (tokenized, checked against the context length) before any runs; then all
questions run at once, sharing the input's prefix through the prefix cache. A
pooling model serves no decisions (400).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from jaxengine.outputs import RequestOutput
from jaxengine.sampling_params import MAX_LOGPROB_TOKEN_IDS
from server import response_fields as R
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.decisions.answers import answer, label_distribution, label_token_ids, usage
from server.decisions.prompt import input_messages, question_messages
from server.decisions.protocol import DecisionRequest, Question, parse_questions
from server.errors import APIError
from server.serving import ServingContext, until_disconnected

NOT_GENERATIVE = (
    "this is a pooling model, not a generative model: /v1/decisions reads a generative "
    "model's next-token distribution"
)

Streams = AsyncIterator[tuple[int, RequestOutput]]


def read_request(
    model: str, messages: list[dict[str, Any]], label_ids: Sequence[int], request_id: str
) -> ChatCompletionRequest:
    """The chat request that reads the next-token logprobs of ``label_ids`` after
    ``messages`` (one sampled token, discarded; greedy, nothing that reshapes logits)."""
    return ChatCompletionRequest(
        model=model,
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        logprobs=True,
        logprob_token_ids=list(label_ids),
        request_id=request_id,
        chat_template_kwargs={"enable_thinking": False},
    )


class DecisionsHandler:
    """Answers Decisions requests with reads through a `ChatHandler`."""

    def __init__(self, ctx: ServingContext, chat: ChatHandler) -> None:
        self.ctx = ctx
        self.chat = chat

    async def create(self, request: DecisionRequest, raw_request: Request | None = None) -> dict:
        """The decision object: ``model``, ``answers`` in question order, ``usage``."""
        ctx = self.ctx
        if ctx.engine.pooler is not None:
            raise APIError(NOT_GENERATIVE, param="model")
        model = ctx.check_model(request.model)
        images_ok = bool(getattr(ctx.engine, "takes_images", False))
        questions = parse_questions(request.questions, images_ok)
        conversation = input_messages(request.input, images_ok)
        tokenizer = ctx.need_tokenizer()
        label_ids = [label_token_ids(q, tokenizer) for q in questions]
        reads = self._reads(request.model, conversation, questions, label_ids)
        streams = await self._start(reads)
        outputs = await until_disconnected(raw_request, _finals(streams))
        return _decision(model, questions, label_ids, outputs)

    def _reads(
        self,
        model: str,
        conversation: list[dict[str, Any]],
        questions: list[Question],
        label_ids: list[list[int]],
    ) -> list[ChatCompletionRequest]:
        """One chat request per question and slice of at most 128 labels."""
        decision_id = R.random_id("decision")
        reads = []
        for question, ids in zip(questions, label_ids, strict=True):
            messages = question_messages(conversation, question)
            for start in range(0, len(ids), MAX_LOGPROB_TOKEN_IDS):
                chunk = ids[start : start + MAX_LOGPROB_TOKEN_IDS]
                rid = f"{decision_id}-{question.index}-{start // MAX_LOGPROB_TOKEN_IDS}"
                reads.append(read_request(model, messages, chunk, rid))
        return reads

    async def _start(self, reads: list[ChatCompletionRequest]) -> list[Streams]:
        """Every read prepared and its streams opened (nothing runs before they are
        iterated); a 400 in any closes the others'."""
        started: list[Streams] = []
        try:
            for read in reads:
                _, streams = await self.chat.start(read)
                started.append(streams)
        except APIError as e:
            await _close(started)
            param = "input" if e.param == "messages" else e.param
            raise APIError(e.message, e.status, param) from None
        except BaseException:
            await _close(started)
            raise
        return started


async def _close(started: list[Streams]) -> None:
    await asyncio.gather(*(s.aclose() for s in started), return_exceptions=True)


async def _final(streams: Streams) -> RequestOutput:
    final = None
    try:
        async for _, out in streams:
            final = out
    finally:
        await streams.aclose()  # aborts the engine request if it has not finished
    if final is None:
        raise APIError("a decision read ended without an output", 500)
    return final


async def _finals(started: list[Streams]) -> list[RequestOutput]:
    """The reads' final outputs, run at once; a failure (or a cancel) stops them all."""
    tasks = [asyncio.ensure_future(_final(s)) for s in started]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _decision(
    model: str,
    questions: list[Question],
    label_ids: list[list[int]],
    outputs: list[RequestOutput],
) -> dict[str, Any]:
    """The decision object from the reads' outputs (in `_reads` order)."""
    answers, left = [], iter(outputs)
    for question, ids in zip(questions, label_ids, strict=True):
        logprobs: dict[int, float] = {}
        for _ in range(0, len(ids), MAX_LOGPROB_TOKEN_IDS):
            logprobs.update(_label_logprobs(next(left)))
        missing = [t for t in ids if t not in logprobs]
        if missing:
            raise APIError(f"the read of question {question.index} lacks tokens {missing}", 500)
        answers.append(answer(question, label_distribution([logprobs[t] for t in ids])))
    prompt = sum(len(out.prompt_token_ids or ()) for out in outputs)
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    return {"model": model, "answers": answers, "usage": usage(prompt, cached)}


def _label_logprobs(out: RequestOutput) -> dict[int, float]:
    """{token id: logprob} at the read's one generated position."""
    seq = out.outputs[0]
    if not seq.logprobs:
        return {}
    return {tid: lp.logprob for tid, lp in seq.logprobs[0].items()}
