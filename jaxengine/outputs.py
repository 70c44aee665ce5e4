"""What `LLM.generate()` returns and the async engine streams: vLLM's output classes.

`RequestOutput` holds one request's prompt and its `CompletionOutput`s (one per
`n`); user code written for vLLM (`out.outputs[0].text`, `out.outputs[0].token_ids`,
`out.prompt_logprobs`, `out.metrics`) works unchanged. Logprobs are, as in vLLM, a
list with one `dict[token_id, Logprob]` per position; `logprobs_dict()` builds one
entry from what the sampler returns.

Pure Python: no jax, no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
"""Why a sequence finished: a stop token or string ("stop"), `max_tokens` or the
context length ("length"), or the request was aborted ("abort")."""


@dataclass
class Logprob:
    """The log probability of one token, its 1-based rank in the vocabulary (by
    log probability, ties counted as above) and its text when detokenized."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: the sampled token plus the top-k tokens."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""One dict per prompt token; the first is None (nothing predicts it)."""


def logprobs_dict(
    sampled_id: int,
    sampled_logprob: float,
    sampled_rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    top_ranks: Sequence[int] | None = None,
) -> dict[int, Logprob]:
    """One position's logprobs: the sampled token first, then the top-k tokens with
    ranks 1..k (or the ``top_ranks`` given: the ranks of `logprob_token_ids`, which
    are any tokens). A sampled token that is also among them keeps its own rank."""
    out = {int(sampled_id): Logprob(float(sampled_logprob), int(sampled_rank))}
    ranks = range(1, len(top_ids) + 1) if top_ranks is None else top_ranks
    for rank, tok, lp in zip(ranks, top_ids, top_logprobs, strict=True):
        out.setdefault(int(tok), Logprob(float(lp), int(rank)))
    return out


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    """Which of the request's `n` sequences this is."""
    text: str
    """The generated text (a delta when the request streams with DELTA)."""
    token_ids: Sequence[int]
    """The generated token ids."""
    cumulative_logprob: float | None
    """Sum of the sampled tokens' log probabilities; None without logprobs."""
    logprobs: SampleLogprobs | None
    """Per-token logprobs when `SamplingParams.logprobs` is set."""
    finish_reason: FinishReason | str | None = None
    """None while the sequence is running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence; None when it ended
    on EOS, on length, or is still running."""
    lora_request: Any = None
    """Always None: LoRA is not supported yet (kept for vLLM compatibility)."""

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass
class RequestMetrics:
    """Timestamps (seconds, `time.time()`) of a request's life in the engine."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    """first_scheduled_time - arrival_time."""
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


RequestStateStats = RequestMetrics
"""vLLM v1's name for the per-request timing record."""


@dataclass
class RequestOutput:
    """The output of one request: its prompt and its generated sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: Any = None
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache."""
    kv_transfer_params: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Room for engine-specific fields that vLLM does not have."""

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a later output of the same request into this one.

        With `aggregate`, sequences with the same index are concatenated (DELTA
        outputs collected into one); otherwise the newer sequence replaces the older.
        """
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                _extend(self.outputs[i], new)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


def _extend(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = [*old.token_ids, *new.token_ids]
    if new.logprobs:
        old.logprobs = [*(old.logprobs or []), *new.logprobs]
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` is a vector (``[H]`` or ``[dimensions]``)
    or, per token, ``[num_prompt_tokens, H]`` (a numpy array)."""

    data: Any


@dataclass
class EmbeddingOutput:
    """vLLM's view of one embedding: ``embedding`` as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (`LLM.encode`, `LLM.embed`)."""

    request_id: str
    outputs: Any
    """A `PoolingOutput` (`LLM.encode`) or `EmbeddingOutput` (`LLM.embed`)."""
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    lora_request: Any = None
    num_cached_tokens: int | None = None

    @classmethod
    def _viewed(cls, out: PoolingRequestOutput, outputs: Any):
        """``out`` as this class, its ``outputs`` replaced by ``outputs``."""
        return cls(**{**vars(out), "outputs": outputs})


def _floats(data: Any) -> list[float]:
    """``data`` (a numpy vector or a sequence) as Python floats; numpy's ``tolist``
    converts a 384-wide vector about ten times faster than a loop."""
    return data.tolist() if hasattr(data, "tolist") else [float(x) for x in data]


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`PoolingRequestOutput` whose ``outputs`` is an `EmbeddingOutput`."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if getattr(data, "ndim", 1) != 1:
            raise ValueError("embed() gives one vector per request; use encode() for tokens")
        return cls._viewed(out, EmbeddingOutput(_floats(data)))


@dataclass
class ClassificationOutput:
    """vLLM's view of one classification: the labels' probabilities."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """vLLM's view of one scored pair: the cross-encoder's score."""

    score: float


class ClassificationRequestOutput(PoolingRequestOutput):
    """`PoolingRequestOutput` whose ``outputs`` is a `ClassificationOutput`."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls._viewed(out, ClassificationOutput(_floats(out.outputs.data)))


class ScoringRequestOutput(PoolingRequestOutput):
    """`PoolingRequestOutput` whose ``outputs`` is a `ScoringOutput` (a head of one
    label's sigmoid, as vLLM scores cross-encoders)."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ScoringRequestOutput:
        data = out.outputs.data
        if len(data) != 1:
            raise ValueError(f"scoring needs a head of one label; this one has {len(data)}")
        return cls._viewed(out, ScoringOutput(float(data[0])))
