"""Images in `LLM.chat` conversations: OpenAI's ``image_url`` parts (loaded by
`media.load_image` under the engine's media flags) and vLLM's offline ``image_pil``
parts, each handed to the chat template as ``{"type": "image"}``."""

from __future__ import annotations

from typing import Any

IMAGE_PARTS = ("image_url", "image_pil")


def has_images(conversation: list[dict]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PARTS
        for message in conversation
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


def part_url(part: dict[str, Any]) -> str:
    """The URL of an ``image_url`` part (``{"url": ...}`` or the URL as a string);
    ValueError for a part without one."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(
            'an image_url part needs "image_url": {"url": "..."} (or the URL as a string)'
        )
    return url


def conversation_images(conversation: list[dict], settings: Any) -> tuple[list[dict], list]:
    """(the messages with each image part as ``{"type": "image"}``, the images in
    order); `media.MediaError` (a ValueError) names a URL that cannot be loaded."""
    from jaxengine.multimodal.media import load_image

    messages, images = [], []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_pil":
                images.append(part["image_pil"])
            elif kind == "image_url":
                images.append(load_image(part_url(part), settings))
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, images
