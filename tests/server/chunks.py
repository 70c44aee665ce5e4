"""Reading streamed chunks (openai client objects) of either endpoint."""

from __future__ import annotations


def _text(choice) -> str:
    delta = getattr(choice, "delta", None)
    if delta is not None:  # chat
        return delta.content or ""
    return choice.text


def joined(chunks) -> dict[int, str]:
    """Each choice's text, its chunks joined."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + _text(choice)
    return texts


def finishes(chunks) -> dict[int, list[str]]:
    """Each choice's finish reasons, in stream order (one expected)."""
    reasons: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return reasons
