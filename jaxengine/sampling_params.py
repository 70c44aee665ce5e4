"""SamplingParams: how one request is sampled, with vLLM's field names and defaults.

A vLLM user writes `SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64,
stop=["\\n"])` and gets the same semantics here. Validation follows vLLM: every bad
value raises a `ValueError` that names the field, at construction time, so that the
server can turn it into an HTTP 400 before anything is queued. Checks that need the
model (vocabulary size, `max_logprobs`) live in `verify_against()`, which the engine
calls when a request arrives; `update_from_generation_config()` and
`update_from_tokenizer()` fill in the EOS ids and the token ids of `bad_words`.

Pure Python: no jax (and no numpy) import, so the server and the scheduler can use
it without touching the device.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum
from typing import Any, Protocol

# for the field's type, and for vLLM's users, who import it from this module
from jaxengine.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
"""Temperatures below this mean greedy sampling (vLLM's `_SAMPLING_EPS`)."""
_MIN_TEMP = 1e-2
"""Positive temperatures below this are raised to it: dividing logits by a tiny
temperature overflows float32 (vLLM's `_MAX_TEMP`, which it uses the same way)."""

MAX_LOGPROB_TOKEN_IDS = 128
"""Most `logprob_token_ids` one request may name (vLLM's cap; the sampler's width)."""

LogitsProcessor = Callable[..., Any]
"""`f(output_token_ids, logits[V]) -> logits[V]` or
`f(prompt_token_ids, output_token_ids, logits[V]) -> logits[V]`, as in vLLM. Run on
the host with numpy arrays (see `jaxengine.runner.sampling_metadata`)."""


class SamplingType(IntEnum):
    """How a request draws its tokens; the sampler treats each kind differently."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    """What each streamed `RequestOutput` carries (vLLM's enum)."""

    CUMULATIVE = 0
    """Everything generated so far."""
    DELTA = 1
    """Only what is new since the last output."""
    FINAL_ONLY = 2
    """Nothing until the request finishes, then everything."""


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (vLLM's `SamplingParams`).

    Invariants after construction: `stop` and `stop_token_ids` and `bad_words` are
    lists; `top_k` is 0 when disabled (-1 is accepted and mapped to 0); a greedy
    request (`temperature < 1e-5`) has `top_p == 1`, `top_k == 0`, `min_p == 0`.
    """

    n: int = 1
    """Number of output sequences to return for the prompt."""
    presence_penalty: float = 0.0
    """Penalizes tokens that already appear in the generated text; > 0 favours new
    tokens, < 0 favours repetition. In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Penalizes tokens by how often they appear in the generated text. In [-2, 2]."""
    repetition_penalty: float = 1.0
    """Penalizes tokens that appear in the prompt or the generated text: positive
    logits are divided by it, negative ones multiplied. > 1 favours new tokens."""
    temperature: float = 1.0
    """Randomness of sampling; 0 means greedy."""
    top_p: float = 1.0
    """Cumulative probability of the top tokens to consider, in (0, 1]."""
    top_k: int = 0
    """Number of top tokens to consider; 0 (or -1) considers all tokens."""
    min_p: float = 0.0
    """Minimum probability of a token, relative to the most likely one, in [0, 1]."""
    seed: int | None = None
    """Random seed of this request; its samples then depend only on the seed and the
    position, never on the other requests in the batch."""
    stop: str | list[str] | None = None
    """Strings that stop generation; not included in the output unless
    `include_stop_str_in_output`."""
    stop_token_ids: list[int] | None = None
    """Token ids that stop generation; included in the output token ids."""
    bad_words: list[str] | None = None
    """Words that may not be generated: the last token of a word is banned when the
    tokens before it match the word's prefix."""
    include_stop_str_in_output: bool = False
    """Whether to keep the stop string in the output text."""
    ignore_eos: bool = False
    """Whether to keep generating after the EOS token."""
    max_tokens: int | None = 16
    """Maximum number of tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """Minimum number of tokens to generate before EOS or a stop token id may be."""
    logprobs: int | None = None
    """Number of log probabilities to return per output token (plus the sampled
    token's own); None returns none, -1 the whole vocabulary."""
    prompt_logprobs: int | None = None
    """Number of log probabilities to return per prompt token; -1 means all."""
    logprob_token_ids: list[int] | None = None
    """Specific token ids whose log probabilities each generated token returns, in
    addition to the sampled token's, instead of the top `logprobs` (scoring a fixed
    label set). At most `MAX_LOGPROB_TOKEN_IDS`; `logprobs`, if set, must equal
    their count."""
    detokenize: bool = True
    """Whether to detokenize the output."""
    skip_special_tokens: bool = True
    """Whether to skip special tokens in the output text."""
    spaces_between_special_tokens: bool = True
    """Whether to put spaces between special tokens in the output text."""
    logits_processors: list[LogitsProcessor] | None = None
    """Host-side functions that modify the logits from the tokens generated so far
    (and optionally the prompt tokens)."""
    truncate_prompt_tokens: int | None = None
    """If k, only the last k prompt tokens are used (left truncation); -1 means the
    model's maximum length."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling."""
    allowed_token_ids: list[int] | None = None
    """If given, only these token ids may be sampled."""
    extra_args: dict[str, Any] | None = None
    """Arbitrary extra arguments for custom extensions: the engine's custom logits
    processors (``--logits-processors``) read theirs here (the server's vllm_xargs)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Cumulative, delta or final-only streamed outputs."""
    structured_outputs: StructuredOutputsParams | None = None
    """A constraint on the output (JSON schema, regex, choice, grammar, ...), enforced
    by a token mask in the sampler."""

    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, int | float) and 0 < self.temperature < _MIN_TEMP:
            logger.warning(
                "temperature %s is below %s, which may cause NaN or inf; raised to %s",
                self.temperature,
                _MIN_TEMP,
                _MIN_TEMP,
            )
            self.temperature = _MIN_TEMP
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
        if isinstance(self.output_kind, int):
            self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}."
            )
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Zero temperature means greedy sampling: the filters are irrelevant.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0  # n > 1 is allowed, as vLLM: n equal sequences
        self._all_stop_token_ids = set(self.stop_token_ids)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Builds params where a None argument means "the default" (server helper)."""
        names = {f.name for f in fields(cls) if f.init}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown SamplingParams fields: {sorted(unknown)}")
        # max_tokens=None is meaningful (up to the context length), as in vLLM.
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    # ------------------------------------------------------------------ validation

    def _verify_args(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not _check_float("temperature", self.temperature) >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < _check_float("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= _check_float("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
        self._verify_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (_check_int(name, value) < -1):
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        self._verify_token_lists()

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        t = self.truncate_prompt_tokens
        if t is not None and (_check_int("truncate_prompt_tokens", t) == 0 or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t}.")

    def _verify_token_lists(self) -> None:
        assert isinstance(self.stop, list)
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )
        for name in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
            for tok in getattr(self, name) or []:
                if _check_int(name, tok) < 0:
                    raise ValueError(f"{name} must hold non-negative token ids, got {tok}.")
        self._verify_logprob_token_ids()
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids is not None and empty!")
        if not all(isinstance(w, str) for w in self.bad_words or []):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}.")

    def _verify_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not ids:
            raise ValueError("logprob_token_ids must not be an empty list.")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than "
                f"max allowed: {MAX_LOGPROB_TOKEN_IDS}"
            )
        if self.logprobs is not None and self.logprobs != len(ids):
            raise ValueError(
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={len(ids)}."
            )

    def verify_against(self, max_logprobs: int, vocab_size: int) -> None:
        """Checks what needs the model: logprob counts and token ids in the vocab.

        `max_logprobs` is `ModelConfig.max_logprobs` (-1 = no cap). The engine calls
        this when it accepts a request; a ValueError becomes an HTTP 400.
        """
        cap = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            wanted = vocab_size if value == -1 else value
            if wanted > cap:
                raise ValueError(
                    f"Requested {name} of {wanted}, which is greater than max allowed: {cap}"
                )
        checks = {
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": self.allowed_token_ids or [],
            "logprob_token_ids": self.logprob_token_ids or [],
            "stop_token_ids": self.stop_token_ids or [],
            "bad_words": [t for word in self._bad_words_token_ids or [] for t in word],
        }
        for name, ids in checks.items():
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            if bad:
                raise ValueError(
                    f"token_id(s) {bad} in {name} are out of the vocabulary (size {vocab_size})."
                )

    # --------------------------------------------------------- engine-side updates

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Adds the model's EOS ids: to `all_stop_token_ids` (for `min_tokens`) and,
        unless `ignore_eos`, the extra EOS ids of the generation config to
        `stop_token_ids` (the primary EOS is handled by the stop checker itself)."""
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos = generation_config.get("eos_token_id")
        if eos is None:
            return
        eos_ids = {eos} if isinstance(eos, int) else set(eos)
        eos_ids.discard(model_eos_token_id)  # type: ignore[arg-type]
        if eos_ids:
            self._all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                assert self.stop_token_ids is not None
                self.stop_token_ids = sorted(eos_ids | set(self.stop_token_ids))

    def update_from_tokenizer(self, tokenizer: _Tokenizer) -> None:
        """Tokenizes `bad_words` into `bad_words_token_ids`.

        Each word is encoded as written (left-stripped) and, to ban it in the middle
        of text too, with a leading space when that spelling is a different token
        sequence of the same length (the `add_prefix_space` case).
        """
        if not self.bad_words:
            return
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                out.append(list(plain))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(list(spaced))
        self._bad_words_token_ids = out

    # -------------------------------------------------------------------- queries

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def logprobs_top_k(self) -> int | None:
        """How many top logprobs the sampler finds per generated token: `logprobs`
        (-1: the whole vocabulary), 0 when only `logprob_token_ids` are asked for (the
        sampled token's own logprob still comes), None for no logprobs at all."""
        if self.logprobs is not None:
            return 0 if self.logprob_token_ids else self.logprobs
        return 0 if self.logprob_token_ids else None

    @property
    def has_penalties(self) -> bool:
        """Whether any of presence, frequency or repetition penalty is not neutral."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def all_stop_token_ids(self) -> set[int]:
        """`stop_token_ids` plus the EOS ids the engine added (banned by min_tokens)."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token id sequences of `bad_words`, set by `update_from_tokenizer()`."""
        return self._bad_words_token_ids

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer holds back while a stop string may be forming."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> SamplingParams:
        """A deep copy; logits processors (often unpicklable closures) are shared."""
        memo = {id(p): p for p in self.logits_processors or []}
        return copy.deepcopy(self, memo)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    return float(value)


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    """Keys may be ints or digit strings (JSON objects have string keys)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}.")
    out: dict[int, float] = {}
    not_ids, negative = [], []
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            not_ids.append(key)
            continue
        val = _check_float("logit_bias", value)
        if val == math.inf:
            raise ValueError(f"logit_bias values must be finite or -inf, got {value!r}.")
        if tok < 0:
            negative.append(tok)
        out[tok] = val
    if not_ids:  # every bad key named, not only the first
        raise ValueError(f"logit_bias keys must be token ids, got {', '.join(map(repr, not_ids))}.")
    if negative:
        raise ValueError(f"logit_bias keys must be non-negative token ids, got {negative}.")
    return out
