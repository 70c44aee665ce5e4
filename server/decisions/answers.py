"""A decision question's answer from the model's next-token log probabilities.

Each label is read as its first token (`label_token_ids`: the label tokenized alone,
without special tokens, as the answer that starts right after the generation prompt),
so two labels that share a first token cannot be told apart and are a 400 naming the
question's options. The answer distribution is the softmax of those tokens' logprobs
over the labels (`label_distribution`), which equals the softmax of their logits: the
whole vocabulary's normaliser cancels. Then, deterministically (ties go to the first
label):

- predicate: ``probability`` = P(``Yes``);
- choice: ``choice`` = the most probable value, ``confidence`` = its probability,
  ``probabilities`` per choice in request order;
- score: ``score`` = sum over levels of index x probability (levels count from 0, the
  lowest first), ``confidence`` = the most probable level's probability,
  ``probabilities`` per level with its ``label`` and ``value`` (the index).

No answer is a refusal: the read always yields a distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from server.decisions.protocol import Question
from server.errors import APIError


def label_token_ids(question: Question, tokenizer: Any) -> list[int]:
    """The first token id of each of ``question``'s labels; 400 for a label with no
    token or two labels with the same first token."""
    ids: list[int] = []
    for label in question.labels:
        tokens = tokenizer.encode(label, add_special_tokens=False)
        if not tokens:
            where = question.options_field
            raise APIError(f"{where}: the label {label!r} has no tokens", param=where)
        if tokens[0] in ids:
            other = question.labels[ids.index(tokens[0])]
            where = question.options_field
            raise APIError(
                f"{where}: the labels {other!r} and {label!r} start with the same token, so "
                "the model's next token cannot tell them apart: make their first words differ",
                param=where,
            )
        ids.append(tokens[0])
    return ids


def label_distribution(logprobs: Sequence[float]) -> list[float]:
    """The softmax of ``logprobs`` (one per label): the probability of each label given
    that the answer is one of them."""
    top = max(logprobs)
    if not math.isfinite(top):
        raise APIError("the model gives no probability to any answer label", 500)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def answer(question: Question, probs: Sequence[float]) -> dict[str, Any]:
    """The answer object of ``question`` (OpenAI's shape) from its label distribution."""
    base = {"type": question.type, "name": question.name}
    if question.type == "predicate":
        return {**base, "probability": probs[0]}
    best = max(range(len(probs)), key=lambda i: (probs[i], -i))
    if question.type == "choice":
        pairs = zip(question.values, probs, strict=True)
        listed = [{"value": v, "probability": p} for v, p in pairs]
        chosen = {"choice": question.values[best], "confidence": probs[best]}
        return {**base, **chosen, "probabilities": listed}
    levels = zip(question.labels, probs, strict=True)
    listed = [{"label": lb, "probability": p, "value": i} for i, (lb, p) in enumerate(levels)]
    score = math.fsum(i * p for i, p in enumerate(probs))
    return {**base, "score": score, "confidence": probs[best], "probabilities": listed}


def usage(input_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The request's usage: the prompt tokens of every read (one per question, more
    for a question of over 128 labels), of which ``cached_tokens`` came from the prefix
    cache. Nothing is output: the token each read samples is discarded."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cache_write_tokens": 0, "cached_tokens": cached_tokens},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens,
    }
