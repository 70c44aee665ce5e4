"""A vision-language model's parts of a worker: the image processor (host), the
encoder and its parameters, and the encoder step (device), sized together.

A compile-only worker (``abstract``: ``jaxengine tpu-check``, whose folder may hold
only ``config.json``) takes the processor's sizes from `ImageProcessor.from_config`
and the encoder's parameters as shapes: nothing is read, drawn or placed."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxengine.config import EngineConfig
from jaxengine.loader import LoadedModel, checkpoint_tensors, is_torch
from jaxengine.loader.encoder_params import (
    abstract_params,
    dummy_module_params,
    load_module_params,
)
from jaxengine.models import image_encoder
from jaxengine.multimodal.processor import ImageProcessor, is_multimodal
from jaxengine.runner.encoder import EncoderRunner
from jaxengine.worker.target import device_bytes


@dataclasses.dataclass(frozen=True)
class ImageParts:
    processor: ImageProcessor
    encoder: Any  # the family's image encoder (`models.idefics3.Idefics3ImageEncoder`)
    params: Any  # its parameters (host arrays or shapes: the encoder step places them)


def load_images(
    config: EngineConfig, loaded: LoadedModel, abstract: bool = False
) -> ImageParts | None:
    """The processor, encoder and encoder parameters of a model that takes images
    (None for a text-only one), after refusing what images do not run with yet. The
    encoder's tensors are read in a second pass over the checkpoint; ``abstract``:
    a compile-only worker's (module doc)."""
    if is_torch(loaded) or not is_multimodal(loaded.hf_config):
        return None
    encoder = image_encoder(loaded.hf_config, loaded.config.dtype)
    if config.parallel_config.pipeline_parallel_size > 1:
        raise NotImplementedError("images with --pipeline-parallel-size > 1 are not supported yet")
    if config.speculative_config.num_speculative_tokens:
        raise NotImplementedError("speculative decoding with images is not supported yet")
    mc, lc = config.model_config, config.load_config
    folder, kwargs = str(loaded.source.path), config.multimodal_config.mm_processor_kwargs
    inputs = encoder.example_inputs()
    if abstract:
        processor = ImageProcessor.from_config(loaded.hf_config, kwargs, folder)
        return ImageParts(processor, encoder, abstract_params(encoder.module, *inputs))
    processor = ImageProcessor.from_folder(folder, loaded.hf_config, kwargs)
    if lc.load_format == "dummy":
        params = dummy_module_params(encoder.module, inputs, mc.seed)
    else:
        tensors = checkpoint_tensors(mc, lc)
        params = load_module_params(encoder.module, inputs, tensors, str(loaded.source.path))
    return ImageParts(processor, encoder, params)


def encoder_rows(config: EngineConfig, processor: ImageProcessor) -> int:
    """Image embeddings the device keeps, which is also the embeddings encoded per
    step: the token budget, or one largest image if that is more (vLLM's
    ``encoder_cache_size`` and ``max_num_encoder_input_tokens``)."""
    budget = config.scheduler_config.max_num_batched_tokens
    return max(budget, processor.max_embeds_per_image)


def encoder_bytes(config: EngineConfig, images: ImageParts | None, dtype: Any) -> int:
    """What the image encoder will hold on each device of the tensor group: its
    parameters (replicated) and its rows of embeddings (`encoder_rows`), which the KV
    cache's sizing leaves room for (they are placed after it). 0 without images."""
    if images is None:
        return 0
    rows = encoder_rows(config, images.processor) * images.encoder.hidden_size
    return device_bytes(images.params) + rows * np.dtype(dtype).itemsize


def encoder_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    images: ImageParts,
    plan: Any,
    store: Any,
    abstract: bool = False,
) -> EncoderRunner:
    """The encoder step on ``plan``'s devices (replicated over the tensor group);
    ``abstract``: a compile-only one (`EncoderRunner`)."""
    return EncoderRunner(
        images.encoder,
        images.params,
        encoder_rows(config, images.processor),
        images.processor.max_units,
        loaded.config.dtype,
        None if plan is None else plan.replicated,
        store,
        images.processor.bidirectional,
        abstract,
    )
