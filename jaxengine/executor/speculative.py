"""Speculative decoding's parts of a worker (``--speculative-config``): how many
tokens a step verifies, the KV slots kept ahead, the draft model or EAGLE head, and
the proposer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxengine.config import EngineConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from jaxengine.executor.eagle import eagle_proposer, load_eagle
from jaxengine.executor.loading import (
    LoadedDraft,
    cache_dtype,
    is_torch,
    load_replica,
    stage_program,
)
from jaxengine.loader import LoadedModel
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.draft import DraftProposer, DraftSettings
from jaxengine.runner.kv_sizing import bytes_per_block
from jaxengine.runner.model_runner import RunnerSettings
from jaxengine.spec import Proposer
from jaxengine.spec.ngram import NgramProposer


def num_speculative_tokens(config: EngineConfig) -> int:
    """Proposed tokens per request and step: ``--num-lookahead-slots``, which
    `EngineConfig` allows only as 0 (the default: num_speculative_tokens) or equal to
    num_speculative_tokens."""
    return config.scheduler_config.num_lookahead_slots or (
        config.speculative_config.num_speculative_tokens
    )


def lookahead_tokens(config: EngineConfig) -> int:
    """KV slots the scheduler allocates beyond a step's tokens: a draft model or EAGLE
    head writes its proposals' KV there before the target verifies them; n-gram
    needs none."""
    method = config.speculative_config.method
    return num_speculative_tokens(config) if method in _ON_DEVICE else 0


_ON_DEVICE = ("draft_model", "eagle")  # methods that run a model of their own


def load_draft(
    config: EngineConfig, devices: Sequence[Any] | None, target: LoadedModel
) -> LoadedDraft | None:
    """The draft model or EAGLE head of ``config`` (None for the other methods),
    checked against the target: JAX models, same vocabulary (and hidden size for a
    head)."""
    method = config.speculative_config.method
    if method not in _ON_DEVICE:
        return None
    if is_torch(target):
        raise ValueError(
            f"speculative_config: the {method} method needs the target's JAX model "
            "(--model-impl jax)"
        )
    draft_config = dataclasses.replace(
        config,
        model_config=_draft_model_config(config),
        lora_config=LoRAConfig(),
        speculative_config=SpeculativeConfig(),
    )
    if method == "eagle":
        return load_eagle(draft_config, devices, target)
    placement, loaded, backend = load_replica(draft_config, devices)
    vocab_size = target.config.vocab_size
    if is_torch(loaded) or loaded.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {draft_config.model_config.model} has a "
            f"vocabulary of {loaded.config.vocab_size} tokens, the target {vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    return LoadedDraft(placement, loaded, backend)


def _draft_model_config(config: EngineConfig) -> ModelConfig:
    sc = config.speculative_config
    return dataclasses.replace(
        config.model_config,
        model=sc.option("model"),
        tokenizer=None,
        revision=sc.option("revision"),
        quantization=sc.option("quantization"),
        hf_overrides={},
        served_model_name=None,
        model_impl="jax",
    )


def draft_bytes_per_block(config: EngineConfig, draft: LoadedDraft | None) -> int:
    """One page of the draft's KV cache on one device (0 without a draft)."""
    if draft is None:
        return 0
    model = draft.loaded.config
    return bytes_per_block(
        len(model.layers),
        config.cache_config.block_size,
        draft.placement.plans[0].kv_heads_per_device,
        model.head_dim,
        cache_dtype(config, draft.loaded.config).itemsize,
    )


def make_proposer(
    config: EngineConfig, draft: LoadedDraft | None, settings: RunnerSettings, target: LoadedModel
) -> Proposer | None:
    """The proposer of ``config`` (None: speculative decoding off); ``settings`` are
    the runner's: a draft model or EAGLE head shares its pages and buckets."""
    sc = config.speculative_config
    k = num_speculative_tokens(config)
    if sc.method == "ngram":
        low, high = sc.prompt_lookup_min, sc.prompt_lookup_max
        return NgramProposer(k, low, high, sc.disable_by_batch_size)
    if draft is None:
        return None
    heads = draft.placement.plans[0].kv_cache_heads
    model = draft.loaded.config
    draft_settings = DraftSettings(
        k=k,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        pages_per_req=settings.pages_per_req,
        token_buckets=settings.token_buckets,
        max_num_seqs=settings.max_num_seqs,
        vocab_size=model.vocab_size,
        cache_page_shape=kv_cache_shape(model, 1, settings.block_size, heads)[1:],
        cache_dtype=cache_dtype(config, draft.loaded.config),
        disable_by_batch_size=sc.disable_by_batch_size,
    )
    if sc.method == "eagle":
        return eagle_proposer(draft, draft_settings, target)
    program = stage_program(draft.loaded, draft.placement, draft.backend, 1)
    return DraftProposer(program, draft.loaded.params, draft_settings)
