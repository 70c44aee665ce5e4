"""Request fields that would change the output but that jaxengine does not run: a 400.

OpenAI's and vLLM's servers accept these fields; silently dropping one would hand
the client an output it did not ask for, so each is refused, naming the field, when
it asks for something other than the default. Fields that cannot change the output
(``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``) are not listed: they are accepted and ignored, like any
unknown field (which is logged).

The request models (`server/protocol.py`) declare every field named here and run
`refuse_unsupported` on each value the client sent, so pydantic reports the field
as the error's location (``param``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationInfo, field_validator, model_validator

logger = logging.getLogger("jaxengine.server")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """When a field's value is refused, and why."""

    refuses: Callable[[Any, dict[str, Any]], bool]
    """``refuses(value, other_fields)``: True for a value that asks for the feature."""
    reason: str


def _given(value: Any, _: dict[str, Any]) -> bool:
    return value is not None and value != {} and value != []


REFUSED: dict[str, Refusal] = {
    # both endpoints (vLLM's extra fields, and OpenAI's best_of)
    "length_penalty": Refusal(
        lambda v, data: v is not None and v != 1.0 and not data.get("use_beam_search"),
        "length_penalty applies to beam search only: set use_beam_search",
    ),
    "early_stopping": Refusal(
        lambda v, data: v not in (None, False) and not data.get("use_beam_search"),
        "early_stopping applies to beam search only: set use_beam_search",
    ),
    "best_of": Refusal(
        lambda v, data: v is not None and v != data.get("n", 1),
        "best_of different from n is not supported",
    ),
    "logits_processors": Refusal(_given, "per-request logits processors are not supported"),
    "cache_salt": Refusal(
        _given, "cache_salt is not supported: the prefix cache is shared by all requests"
    ),
    # completions
    "suffix": Refusal(_given, "suffix is not supported"),
    "prompt_embeds": Refusal(_given, "prompt_embeds are not supported (text and token ids only)"),
    "mm_processor_kwargs": Refusal(
        _given, "mm_processor_kwargs apply to images, which only chat messages carry"
    ),
    # chat
    "functions": Refusal(
        _given, "the legacy `functions` field is not supported; send `tools` instead"
    ),
    "function_call": Refusal(
        _given, "the legacy `function_call` field is not supported; send `tool_choice` instead"
    ),
    "audio": Refusal(_given, "audio output is not supported (text only)"),
    "modalities": Refusal(
        lambda v, _: v is not None and list(v) != ["text"],
        'only the "text" output modality is supported',
    ),
    "prediction": Refusal(_given, "predicted outputs are not supported"),
    "web_search_options": Refusal(lambda v, _: v is not None, "web search is not supported"),
    "verbosity": Refusal(_given, "verbosity is not supported"),
}
"""Every refused field, by name."""

CHAT_REFUSED: dict[str, Refusal] = {k: r for k, r in REFUSED.items() if k != "mm_processor_kwargs"}
"""Chat's refused fields: `REFUSED` but ``mm_processor_kwargs``, which goes to the
engine with a request's images (`server/chat_rendering/images.py`)."""


class RefusingModel(BaseModel):
    """A request body that refuses the fields of its ``refused`` table (a 400 at the
    field) and logs the unknown fields it ignores. OpenAI's requests refuse
    `REFUSED`; the Responses and Anthropic requests bring their own tables."""

    refused: ClassVar[dict[str, Refusal]] = REFUSED

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()}
            ignored = sorted(set(data) - known - set(cls.model_fields))
            if ignored:
                logger.warning("fields present in the request but ignored: %s", ignored)
        return data

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        refusal = cls.refused.get(info.field_name)
        if refusal is not None and refusal.refuses(value, info.data):
            raise ValueError(refusal.reason)
        return value
