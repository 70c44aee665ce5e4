"""A vision-language model's processor: prompt text and images -> ids and `ImageItem`s.

`ImageProcessor` loads transformers' ``AutoProcessor`` from the model folder (its
``processor_config.json``, ``preprocessor_config.json`` and tokenizer) and calls it
on the prompt and its images, so resizing, tiling, normalisation and the expansion of
each image's placeholder are the model's own. Each family's module here splits the
processor's batch-of-one output per image (`idefics3.split`); a family whose
processor ``AutoProcessor`` cannot build here has its own ``load_processor``
(`qwen2_5_vl`: no torchvision).

A compile-only engine (``jaxengine tpu-check``) of a folder that may hold only
``config.json`` builds its processor with `ImageProcessor.from_config`: the folder's
image processor where it has one, else the family's transformers image processor
from its defaults with the tower's patch sizes (`default_image_processor`), and no
tokenizer. It sizes the encoder (its unit buckets, its rows) and processes nothing.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

from jaxengine.multimodal.items import ImageItem, image_key, to_pil

_FAMILIES = {
    "Idefics3ForConditionalGeneration": "idefics3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
}
"""Vision-language architectures -> their host module in this package."""


_TEXT_DECODER_ONLY = {"Gemma4ForConditionalGeneration": "image, video and audio"}
"""Multimodal architectures served as their text decoder only when their checkpoint
has no vision tower -> the inputs refused."""


def media_refusal(hf_config: Any) -> str | None:
    """Why a prompt with media cannot run on a checkpoint of `_TEXT_DECODER_ONLY`
    without a vision tower; None for any other checkpoint."""
    if is_multimodal(hf_config):
        return None
    for arch in getattr(hf_config, "architectures", None) or ():
        if arch in _TEXT_DECODER_ONLY:
            return (
                f"{arch}: {_TEXT_DECODER_ONLY[arch]} inputs are not supported yet "
                "(only its text decoder runs here)"
            )
    return None


def is_multimodal(hf_config: Any) -> bool:
    """Whether the checkpoint's architecture takes images here (and it has a tower)."""
    archs = getattr(hf_config, "architectures", None) or ()
    has_tower = getattr(hf_config, "vision_config", None) is not None
    return has_tower and any(a in _FAMILIES for a in archs)


def images_both_ways(hf_config: Any) -> bool:
    """Whether the checkpoint's image tokens attend to each other both ways (Gemma 3;
    Gemma 4 as its config says: the family's ``both_ways``)."""
    return is_multimodal(hf_config) and _both_ways(_family(hf_config), hf_config)


def _both_ways(family: Any, hf_config: Any) -> bool:
    hook = getattr(family, "both_ways", None)
    return bool(hook(hf_config)) if hook is not None else family.BIDIRECTIONAL


def _family(hf_config: Any):
    arch = next(a for a in hf_config.architectures if a in _FAMILIES)
    return importlib.import_module(f"jaxengine.multimodal.{_FAMILIES[arch]}")


class ImageProcessor:
    """The model's processor and its family's split (see module doc)."""

    def __init__(self, processor: Any, hf_config: Any, defaults: dict | None = None) -> None:
        """``defaults``: ``--mm-processor-kwargs`` (a request's own go over them)."""
        self.processor = processor
        self.family = _family(hf_config)
        self.image_token_id = int(hf_config.image_token_id)
        self.defaults = dict(defaults or {})
        self._both_ways = _both_ways(self.family, hf_config)

    @classmethod
    def from_folder(cls, folder: str, hf_config: Any, defaults: dict | None = None):
        import transformers

        load = getattr(
            _family(hf_config), "load_processor", transformers.AutoProcessor.from_pretrained
        )
        try:
            processor = load(str(folder))
        except Exception as e:  # noqa: BLE001 - any failure means no usable processor
            raise ValueError(f"{folder}: cannot load the model's image processor: {e}") from e
        return cls(processor, hf_config, defaults)

    @classmethod
    def from_config(cls, hf_config: Any, defaults: dict | None = None, folder: str | None = None):
        """The processor of a compile-only engine (module doc): it sizes the encoder
        as ``serve``'s would with the same image processor, and takes no prompts."""
        image_processor = default_image_processor(hf_config, folder)
        return cls(SizesOnly(image_processor, hf_config), hf_config, defaults)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def embeds_per_unit(self) -> int:
        return self.family.embeds_per_unit(self.processor)

    @property
    def max_units(self) -> int:
        """The most encoder units (tiles, tokens) one image can take with the engine's
        processor arguments (``defaults``): what the encoder's buckets and cache are
        sized for. A request's ``mm_processor_kwargs`` may lower it, not raise it."""
        return self.family.max_units(self.processor, self.defaults)

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways in the decoder
        (Gemma 3): a prefill chunk may then not end inside an image."""
        return self._both_ways

    @property
    def max_embeds_per_image(self) -> int:
        return self.max_units * self.embeds_per_unit

    def process(
        self,
        text: str,
        images: Sequence[Any],
        kwargs: dict | None = None,
        add_special_tokens: bool = True,
    ) -> tuple[list[int], list[ImageItem]]:
        """The prompt's token ids (placeholders expanded) and one item per image, in
        the prompt's order; ``add_special_tokens`` False for a rendered chat (its
        special tokens are in the text). ValueError when the processor refuses the
        pair (e.g. the number of placeholders and images differ)."""
        pil = [to_pil(image) for image in images]
        merged = {**self.defaults, **(kwargs or {})}
        self._check_limits(kwargs, merged)
        try:
            out = self.processor(
                text=[text],
                images=[pil] if pil else None,
                return_tensors="np",
                add_special_tokens=add_special_tokens,
                **merged,
            )
        except Exception as e:  # noqa: BLE001 - the processor's errors are the input's
            raise ValueError(f"the image processor refused the prompt: {e}") from e
        ids = [int(t) for t in out["input_ids"][0]]
        if not pil:
            return ids, []
        parts = self.family.split(ids, out, self.processor, self.image_token_id)
        if len(parts) != len(pil):
            raise ValueError(
                f"the prompt has {len(parts)} image placeholders but {len(pil)} images were given"
            )
        items = [
            ImageItem(image_key(image, merged), **part)
            for image, part in zip(pil, parts, strict=True)
        ]
        for item in items:
            if item.units > self.max_units:
                raise ValueError(
                    f"an image of {item.units} encoder units (tiles, tokens) exceeds the "
                    f"{self.max_units} the engine's encoder was sized for"
                )
        return ids, items

    def _check_limits(self, kwargs: dict | None, merged: dict) -> None:
        """ValueError when a request's ``mm_processor_kwargs`` allow larger images than
        the engine's (its encoder buckets and cache are sized for those)."""
        if not kwargs:
            return
        asked = self.family.max_units(self.processor, merged)
        if asked > self.max_units:
            raise ValueError(
                f"mm_processor_kwargs {kwargs!r} allow images of {asked} encoder units "
                f"(tiles, tokens), more than the {self.max_units} the engine was sized for "
                "(--mm-processor-kwargs, else the model's processor config): a request "
                "may lower the image size limits (e.g. max_pixels), not raise them"
            )


class SizesOnly:
    """A processor without a tokenizer (`ImageProcessor.from_config`): the image
    processor and the per-image token counts the families read, nothing to call."""

    tokenizer = None

    def __init__(self, image_processor: Any, hf_config: Any) -> None:
        self.image_processor = image_processor
        self.image_seq_length = getattr(hf_config, "mm_tokens_per_image", None)  # Gemma 3
        self.image_seq_len = _tile_tokens(hf_config)  # Idefics3's tokens per tile

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "this engine was built to compile (jaxengine tpu-check), without the model's "
            "processor: it processes no prompts"
        )


_TOWER_SIZES = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
    "pooling_kernel_size": "pooling_kernel_size",
}
"""Image processor argument -> the ``vision_config`` field that fixes it (the tower's
patch geometry: a processor of other patches would not fit the tower)."""


def default_image_processor(hf_config: Any, folder: str | None = None) -> Any:
    """``folder``'s image processor (its ``preprocessor_config.json``), else the
    defaults of transformers' image processor class for ``hf_config``'s model type
    (the PIL one: no torchvision) with the tower's sizes (`_TOWER_SIZES`)."""
    import transformers

    if folder is not None and os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
        return transformers.AutoImageProcessor.from_pretrained(folder)
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(hf_config.model_type)
    if not names:
        raise ValueError(f"no image processor is known for model type {hf_config.model_type!r}")
    if isinstance(names, dict):  # {"pil": ..., "torchvision": ...}
        name = names.get("pil") or next(iter(names.values()))
    else:  # (slow, fast) in older transformers
        name = names[0]
    image_processor_class = getattr(transformers, name)
    probe, vision = image_processor_class(), hf_config.vision_config
    sizes = {
        arg: getattr(vision, field)
        for arg, field in _TOWER_SIZES.items()
        if hasattr(probe, arg) and getattr(vision, field, None) is not None
    }
    return image_processor_class(**sizes) if sizes else probe


def _tile_tokens(hf_config: Any) -> int | None:
    """Idefics3's image tokens per tile: ``(image_size / patch_size)^2 / scale_factor^2``
    (its processor's ``image_seq_len``); None for another family."""
    vision, scale = hf_config.vision_config, getattr(hf_config, "scale_factor", None)
    if not scale or not hasattr(vision, "image_size"):
        return None
    return int((vision.image_size // vision.patch_size) ** 2 / scale**2)


def prompt_images(
    prompt: dict,
    processor: ImageProcessor | None,
    limit: int,
    max_embeds: int,
    refusal: str | None = None,
) -> tuple[str, list[int], list[ImageItem]]:
    """``(text, token ids, images)`` of a prompt dict with ``multi_modal_data``
    (vLLM's ``{"prompt", "multi_modal_data": {"image": ...}, "mm_processor_kwargs"}``;
    ``"add_special_tokens": False`` for a rendered chat, as `LLM.chat` and the server
    send it).
    ValueError names what cannot be served: a text-only model (``refusal``, from
    `media_refusal`, where its media are not supported yet), another modality, more
    images than ``limit`` (``--limit-mm-per-prompt``), a prompt given only as token
    ids, or an image larger than the device's ``max_embeds`` image embeddings."""
    data = prompt["multi_modal_data"]
    kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
    if processor is None and refusal is not None:
        raise ValueError(f"{refusal}; the prompt has multi_modal_data {kinds}")
    if processor is None:
        raise ValueError("this model is not a multimodal model: it takes no images")
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data {kinds}: only 'image' is supported")
    images = data.get("image", [])
    images = list(images) if isinstance(images, list | tuple) else [images]
    if len(images) > limit:
        raise ValueError(f"At most {limit} image(s) may be provided in one prompt.")
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError("a prompt with images needs its text ('prompt'): token ids alone "
                         "cannot place the images")  # fmt: skip
    special = bool(prompt.get("add_special_tokens", True))
    ids, items = processor.process(text, images, prompt.get("mm_processor_kwargs"), special)
    for item in items:
        if item.num_embeds > max_embeds:
            raise ValueError(
                f"an image of {item.num_embeds} embeddings exceeds the encoder cache of "
                f"{max_embeds} (--max-num-batched-tokens sizes it)"
            )
    return text, ids, items
