"""Chat messages' ``image_url`` parts: their URLs in order, what a request with images
may not ask for, and loading the images off the event loop (`jaxengine/multimodal/media.py`).

A content part ``{"type": "image_url", "image_url": {"url": ...}}`` (or the shorthand
``"image_url": "<url>"``) reaches the chat template as ``{"type": "image"}``
(`messages.normalize_message`); the images go to the engine, in message order,
beside the rendered prompt text (`image_prompt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from PIL import Image

from jaxengine.multimodal import chat as multimodal_chat
from jaxengine.multimodal.media import MediaError, MediaSettings, load_image
from server.errors import APIError

IMAGE_PART = "image_url"

NOT_MULTIMODAL = "this model is not a multimodal model: it takes no images"
"""The engine's own refusal (`multimodal.processor.prompt_images`), said before any
image is fetched or the template asked to place one."""

NOT_HERE = (
    "messages with images are taken by /v1/chat/completions only (not by /tokenize, "
    "token counting or embeddings)"
)


def part_url(part: dict[str, Any]) -> str:
    """The URL of an ``image_url`` part (`multimodal.chat.part_url`); 400 for a part
    without one."""
    try:
        return multimodal_chat.part_url(part)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def image_urls(messages: Sequence[Any]) -> list[str]:
    """The image URLs of ``messages``, in order (empty for a text-only conversation)."""
    urls = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == IMAGE_PART:
                urls.append(part_url(part))
    return urls


def check_image_request(request: Any) -> None:
    """Refuses (400) what a request with images cannot run: cutting the prompt (the
    tokens would cut through an image's) and beam search (whose steps carry token ids
    only)."""
    if request.truncate_prompt_tokens is not None:
        raise APIError(
            "truncate_prompt_tokens is not supported with images", param="truncate_prompt_tokens"
        )
    if request.use_beam_search:
        raise APIError("beam search is not supported with images", param="use_beam_search")


async def load_images(urls: Sequence[str], settings: MediaSettings) -> list[Image.Image]:
    """The images, in the order of ``urls``, loaded in parallel threads; once all are
    done, the first failure in that order is a 400 naming it."""
    loads = (asyncio.to_thread(load_image, url, settings) for url in urls)
    results = await asyncio.gather(*loads, return_exceptions=True)
    for result in results:
        if isinstance(result, MediaError):
            raise APIError(str(result), param="messages")
        if isinstance(result, BaseException):
            raise result
    return list(results)


def image_prompt(text: str, images: list[Image.Image], request: Any) -> dict[str, Any]:
    """The engine prompt of a chat with images: the rendered text (an ``{"type":
    "image"}`` part rendered by the template where each image was), the images in
    order, and the request's ``mm_processor_kwargs`` (None: the server's)."""
    return {
        "prompt": text,
        "multi_modal_data": {"image": images},
        "mm_processor_kwargs": request.mm_processor_kwargs,
        "add_special_tokens": False,  # the template rendered them (BOS text included)
    }
