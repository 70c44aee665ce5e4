"""OpenAI request bodies, with vLLM's extra sampling fields (pydantic models).

The models validate types and ranges that need no model; everything else
(context length, vocabulary, logprob caps, the grammar of structured outputs) is
checked by the engine when the request is prepared. Unknown fields are ignored (and
logged), as OpenAI's and vLLM's servers do; known fields that would change the
output but are not implemented are refused (`server/unsupported_fields.py`).
Structured outputs are read from the request in `server/structured.py`, tool choice
in `server/tool_calls.py`; responses are built in `server/responses.py`.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from jaxengine.reasoning.budget import THINKING_TOKEN_BUDGET
from jaxengine.sampling_params import RequestOutputKind, SamplingParams
from server.unsupported_fields import CHAT_REFUSED, Refusal, RefusingModel

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
    # beam search (server/serving_beam.py): ``n`` is the beam width
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
    # refused unless left at their defaults (server/unsupported_fields.py)
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
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


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None  # refused
    prompt_embeds: Any = None  # refused

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one per text or token-id list."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's wording
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one tokenized prompt
        return list(prompt)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    refused: ClassVar[dict[str, Refusal]] = CHAT_REFUSED
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    # refused (server/unsupported_fields.py)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's): ``input`` (a text, texts,
    token ids or lists of them) or ``messages`` (one conversation, through the chat
    template)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    normalize: bool | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None

    @model_validator(mode="after")
    def _one_of(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of `input` and `messages`")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("`input` must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each input: a text or a token-id list."""
        data = self.input
        if isinstance(data, str):
            return [data]
        if all(isinstance(x, int) for x in data):
            return [list(data)]
        return list(data)


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM): an embedding request whose result is the raw pooled
    output, one vector per input ("embed", "classify") or one per token
    ("token_embed", "token_classify": a reward model's). None: the model's first task."""

    task: Literal["embed", "token_embed", "classify", "token_classify"] | None = None


class PoolingFields(OpenAIModel):
    """What every pooling endpoint takes besides its inputs (vLLM's names)."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool | None = None
    priority: int = 0
    request_id: str | None = None
    user: str | None = None


class ScoreRequest(PoolingFields):
    """POST /score (/v1/score): a cross-encoder's score of ``text_1`` against each
    ``text_2`` (one first text), or of the two lists pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(PoolingFields):
    """POST /rerank (/v1/rerank, Jina's and Cohere's shape): the documents ordered by
    their score against ``query``, the best ``top_n`` (0: all)."""

    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True


class ClassificationRequest(PoolingFields):
    """POST /classify: a classification model's label probabilities per input."""

    input: str | list[str]
