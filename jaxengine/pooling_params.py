"""`PoolingParams`: how a pooling request (an embedding) is computed, as vLLM names it.

A pooling request runs its prompt through the model once, with no decoding: the
model's last hidden states are pooled per request (``--pooler-config``'s pooling
type: LAST, MEAN, CLS or ALL), cut to ``dimensions`` (Matryoshka models) and
normalized when ``normalize``. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxengine.sampling_params import RequestOutputKind

TOKEN_TYPE_SHIFT = 30
"""A prompt token id's bits from this one up carry its token type (1: the second text
of a cross-encoder's pair), as vLLM encodes them: ids stay plain ints on the host,
and the encoder (`models.bert`) splits them again."""


def with_token_types(token_ids, token_type_ids) -> list[int]:
    """``token_ids`` with each one's type in its high bits (`TOKEN_TYPE_SHIFT`)."""
    pairs = zip(token_ids, token_type_ids, strict=True)
    return [int(t) | (int(k) << TOKEN_TYPE_SHIFT) for t, k in pairs]


def plain_token_ids(token_ids) -> list[int]:
    """``token_ids`` without their token types."""
    return [int(t) & ((1 << TOKEN_TYPE_SHIFT) - 1) for t in token_ids]


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple]:
    """The (text_1, text_2) pairs to score: 1 x N, or N x N pairwise (as vLLM)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"score pairs {len(first)} texts with {len(second)}: give one first text, "
            "or as many as second texts"
        )
    return list(zip(first, second, strict=True))


def bi_encoder(pooler: Any) -> bool:
    """Whether a pooling model scores pairs as a bi-encoder: the cosine similarity of
    the two texts' embeddings (an embedding model), not a cross-encoder's head."""
    tasks = getattr(pooler, "tasks", ())
    return "score" not in tasks and "embed" in tasks


def unique_texts(pairs: Sequence[tuple]) -> list[str]:
    """Each text of ``pairs`` once, in order of first use (a bi-encoder embeds each once)."""
    return list(dict.fromkeys(text for pair in pairs for text in pair))


def cosine_similarity(a: Any, b: Any) -> float:
    """A bi-encoder's score of a pair: the cosine of their embeddings (vLLM's)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str) -> dict:
    """A cross-encoder's prompt for a pair: both texts in one sequence, the second's
    tokens typed 1 (`with_token_types`)."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer (--skip-tokenizer-init is set)")
    encoded = tokenizer(text_1, text_2)
    ids = encoded["input_ids"]
    types = encoded.get("token_type_ids") or [0] * len(ids)
    return {"prompt": None, "prompt_token_ids": with_token_types(ids, types)}


POOLING_TASKS = ("embed", "token_embed", "encode", "classify", "score", "token_classify")
"""The tasks: one vector per request ("embed") or one per token ("token_embed";
"encode" is vLLM's older name for it); a classification model's label
probabilities ("classify"), a cross-encoder's score of a pair ("score"), or one
result per token ("token_classify": a classifier's probabilities per token, a reward
model's hidden states, `LLM.reward`)."""


@dataclass
class PoolingParams:
    """Per-request pooling options (vLLM's `PoolingParams`)."""

    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (-1: the model's context length)."""
    dimensions: int | None = None
    """Cut the embedding to its first ``dimensions`` values (before normalizing)."""
    normalize: bool | None = None
    """L2-normalize the result (None: the model's default, `PoolerConfig`)."""
    task: str | None = None
    """One of `POOLING_TASKS` (None: the model's first, `PoolerSettings.tasks`)."""
    use_activation: bool | None = None
    """classify / score: sigmoid (one label) or softmax of the head's logits (the
    default), or the logits themselves (False)."""
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    # what the engine's sequence bookkeeping reads of a request's parameters
    n: int = 1
    detokenize: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task {self.task!r} is not one of {list(POOLING_TASKS)}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (truncate < -1 or truncate == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}")

    is_pooling = True  # (a class attribute: the scheduler tells requests apart by it)
    logprobs_top_k = None  # (as SamplingParams.logprobs_top_k: a pooling request samples nothing)

    def clone(self) -> PoolingParams:
        # every field is an immutable scalar (or a tuple): a shallow copy is a clone,
        # and costs a tenth of a deep one (3 clones per request on the embed path)
        return replace(self)

    @property
    def per_token(self) -> bool:
        """One result per prompt token ("token_embed", "token_classify")."""
        return self.task in ("token_embed", "encode", "token_classify")
