"""A pooling model's request bodies: /v1/embeddings, /pooling, /score, /rerank and
/classify (OpenAI's fields, and vLLM's). Cohere's /v2/embed body is
`server/pooling/cohere.py`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from server.protocol import OpenAIModel


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
