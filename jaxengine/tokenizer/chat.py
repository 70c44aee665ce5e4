"""Chat templates: choosing one and rendering messages with it.

An explicit template (vLLM's ``--chat-template``: a file path or the Jinja text
itself) wins over the tokenizer's own, which for GGUF models comes from the file's
``tokenizer.chat_template`` metadata. Rendering is transformers' (its sandboxed Jinja
environment and helpers); the prompt is rendered to text and then encoded without
adding special tokens, because the template already writes BOS and role markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The Jinja text to render chats with, or None if there is none at all.

    ``chat_template`` is read as a file when it names one; text containing ``{``, ``}``
    or a newline is taken as the template itself; anything else is a missing file
    (`ValueError`). Without it, the tokenizer's template (``default`` of a named set).
    """
    if chat_template is not None:
        if _is_file(chat_template):
            return Path(chat_template).expanduser().read_text()
        if any(c in chat_template for c in "{}\n"):
            return chat_template
        raise ValueError(f"chat template file {chat_template!r} not found")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    return own or None


def _is_file(name: str) -> bool:
    try:
        return Path(name).expanduser().is_file()
    except (OSError, ValueError):  # a long one-line template is no valid path
        return False


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tokenize: bool = True,
    **kwargs: Any,
) -> list[int] | str:
    """Renders ``messages`` (OpenAI-style dicts) into prompt token ids, or text.

    ``continue_final_message`` leaves the last (assistant) message open for the model
    to continue and excludes ``add_generation_prompt``. Other keyword arguments go to
    the template (``tools``, ``documents``, template variables).
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    template = resolve_chat_template(tokenizer, chat_template)
    if template is None:
        raise ValueError(
            "the tokenizer has no chat template; give one with --chat-template "
            "(a file or the template text)"
        )
    text = tokenizer.apply_chat_template(
        list(messages),
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **kwargs,
    )
    if not tokenize:
        return text
    return list(tokenizer.encode(text, add_special_tokens=False))
