"""The completions request body: ``POST /v1/completions``.

Its sampling fields (OpenAI's and vLLM's) are the shared `SamplingFields`
(`server/protocol.py`).
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from server.protocol import SamplingFields

NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
"""vLLM's 400 for a missing or empty prompt (``None``, ``""``, ``[]``). One of several
prompts that is empty (``[""]``, ``[[]]``) is the engine's "The decoder prompt cannot be
empty", as in vLLM."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None  # refused
    prompt_embeds: Any = None  # refused

    @model_validator(mode="before")
    @classmethod
    def _check_prompt_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            empty = [_is_empty(data.get(key)) for key in ("prompt", "prompt_embeds")]
            if all(empty):
                raise ValueError(NO_PROMPT)
        return data

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one per text or token-id list."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:  # (a request with prompt_embeds only: refused before this)
            raise ValueError(NO_PROMPT)
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # one tokenized prompt
        return list(prompt)


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list)) and not value)
