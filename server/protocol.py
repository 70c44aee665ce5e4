"""The request-body parts every OpenAI API shares, with vLLM's extra sampling fields
(pydantic models): `OpenAIModel`, the sampling fields of completions and chat
(`SamplingFields`), ``response_format``, ``stream_options``, and vLLM's /tokenize and
/detokenize bodies. Each API's own bodies live in its folder (`server/chat/protocol.py`,
`server/completions/protocol.py`, `server/pooling/protocol.py`, ...).

The models validate types and ranges that need no model; everything else
(context length, vocabulary, logprob caps, the grammar of structured outputs) is
checked by the engine when the request is prepared. Unknown fields are ignored (and
logged), as OpenAI's and vLLM's servers do; known fields that would change the
output but are not implemented are refused (`server/unsupported_fields.py`).
Structured outputs are read from the request in `server/structured.py`, tool choice
in `server/tool_calls.py`; responses are built in `server/response_fields.py`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from jaxengine.reasoning.budget import THINKING_TOKEN_BUDGET
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from server.unsupported_fields import RefusingModel

logger = logging.getLogger("jaxengine.server")

# Sampling fields whose server default comes from the model's generation config when
# the request leaves them out (vLLM's `--generation-config auto`).
GENERATION_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(OpenAIModel):
    """vLLM's ``stream_options``: both off unless asked for (``{}`` sends no usage)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format`` (and vLLM's ``structural_tag`` type, whose other
    keys are kept as given)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel, RefusingModel):
    """Fields shared by completions and chat: OpenAI's and vLLM's extras."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    """Which end `truncate_prompt_tokens` cuts: "left" (the default) keeps the last
    tokens, "right" the first."""
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    """Token ids whose logprobs every generated position returns (with the sampled
    token's) instead of the top-k; needs `logprobs`."""
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    """Token ids beside the text: the prompt's and each choice's (per chunk when
    streaming)."""
    # structured outputs (server/structured.py); the guided_* fields are vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # beam search (server/completions/beam.py): ``n`` is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    """transformers' (and vLLM v0's) stopping rule for beam search."""
    vllm_xargs: dict[str, Any] | None = None
    """Arguments of the engine's custom logits processors (``--logits-processors``):
    the request's `SamplingParams.extra_args`."""
    thinking_token_budget: int | None = Field(default=None, ge=0)
    """vLLM's thinking budget: after this many reasoning tokens the reasoning parser's
    end token is forced (`jaxengine.reasoning.budget`); ``extra_args`` carry it."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's disaggregated-serving handshake for its KV connector. There is no KV
    connector here (vLLM's behaviour without ``--kv-transfer-config``): accepted,
    unused, and the response's ``kv_transfer_params`` is null."""
    # refused unless left at their defaults (server/unsupported_fields.py)
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    """Arguments for the engine's image processor, with a chat's images (refused by
    completions, which carry no images)."""

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream") and (value > 0 or value == -1):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if value is not None and value < -1:
            raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        return value

    @field_validator("logprob_token_ids")
    @classmethod
    def _check_logprob_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("`logprob_token_ids` must not be an empty list.")
        return value

    @model_validator(mode="after")
    def _check_logprob_token_ids_need_logprobs(self):
        logprobs = getattr(self, "logprobs", None)  # chat: a bool; completions: a count
        if self.logprob_token_ids and (logprobs is None or logprobs is False):
            raise ValueError("when using `logprob_token_ids`, `logprobs` must be set.")
        return self

    def kept_prompt(self, ids: list[int]) -> list[int]:
        """The prompt ids ``truncation_side: "right"`` keeps: the first
        ``truncate_prompt_tokens``. Any other prompt is left whole here: the engine
        keeps its last ``truncate_prompt_tokens`` ("left", vLLM's default)."""
        keep = self.truncate_prompt_tokens
        if self.truncation_side == "right" and keep is not None and 0 < keep < len(ids):
            return ids[:keep]
        return ids

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        extra: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's params; raises ValueError (-> 400) for invalid values.

        ``extra`` fields override the request's own (e.g. echo's prompt_logprobs).
        """
        chosen = {k: getattr(self, k) for k in GENERATION_CONFIG_DEFAULTS}
        for key, value in defaults.items():
            if chosen.get(key) is None:
                chosen[key] = value
        fields = dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            # explicit ids replace the top-k (vLLM: logprobs None, logprob_token_ids set)
            logprobs=None if self.logprob_token_ids else logprobs,
            logprob_token_ids=self.logprob_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            extra_args=_extra_args(self.vllm_xargs, self.thinking_token_budget),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        return SamplingParams.from_optional(**{**fields, **chosen, **(extra or {})})


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt (completions style) or messages (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorInfo


def _extra_args(xargs: dict[str, Any] | None, budget: int | None) -> dict[str, Any] | None:
    """``vllm_xargs`` with the top-level ``thinking_token_budget`` (which wins)."""
    extra = dict(xargs or {})
    if budget is not None:
        extra[THINKING_TOKEN_BUDGET] = budget
    return extra or None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Token id -> bias clamped to [-100, 100]; a ValueError names every key that is
    not a token id."""
    if not bias:
        return None
    out, bad = {}, []
    for key, value in bias.items():
        try:
            out[int(key)] = max(-100.0, min(100.0, float(value)))
        except ValueError:
            bad.append(key)
    if bad:
        raise ValueError(f"logit_bias keys must be token ids, got {', '.join(map(repr, bad))}")
    return out
