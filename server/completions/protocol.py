"""The completions request body: ``POST /v1/completions``.

Its sampling fields (OpenAI's and vLLM's) are the shared `SamplingFields`
(`server/protocol.py`).
"""

from __future__ import annotations

from typing import Any

from server.protocol import SamplingFields


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
