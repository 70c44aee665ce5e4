"""`PoolingParams`: how a pooling request (an embedding) is computed, as vLLM names it.

A pooling request runs its prompt through the model once, with no decoding: the
model's last hidden states are pooled per request (``--pooler-config``'s pooling
type: LAST, MEAN, CLS or ALL), cut to ``dimensions`` (Matryoshka models) and
normalized when ``normalize``. Pure Python.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from jaxengine.sampling_params import RequestOutputKind

POOLING_TASKS = ("embed", "token_embed", "encode")
"""The tasks that run: one vector per request ("embed") or one per token
("token_embed"; "encode" is vLLM's older name for it)."""
REFUSED_TASKS = ("classify", "score", "token_classify", "reward")
"""vLLM's other pooling tasks: not supported yet."""


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
    """"embed" (the default) or "token_embed"."""
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    # what the engine's sequence bookkeeping reads of a request's parameters
    n: int = 1
    detokenize: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS + REFUSED_TASKS:
            raise ValueError(
                f"pooling task {self.task!r} is not one of {list(POOLING_TASKS + REFUSED_TASKS)}"
            )
        if self.task in REFUSED_TASKS:
            raise NotImplementedError(f"pooling task {self.task} is not supported yet")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (truncate < -1 or truncate == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}")

    is_pooling = True  # (a class attribute: the scheduler tells requests apart by it)

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

    @property
    def per_token(self) -> bool:
        """One vector per prompt token ("token_embed")."""
        return self.task in ("token_embed", "encode")
