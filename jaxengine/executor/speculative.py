"""Speculative decoding's parts of a worker (``--speculative-config``): how many
tokens a step verifies, the KV slots kept ahead, the draft model and the proposer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxengine.config import EngineConfig, LoRAConfig, SpeculativeConfig
from jaxengine.executor.loading import is_torch, load_replica, stage_program
from jaxengine.loader import LoadedModel
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.attention_backend import AttentionBackend
from jaxengine.runner.draft import DraftProposer, DraftSettings
from jaxengine.runner.kv_sizing import bytes_per_block
from jaxengine.spec import Proposer
from jaxengine.spec.ngram import NgramProposer
from sharding.placement import Placement


@dataclasses.dataclass(frozen=True)
class LoadedDraft:
    """The draft model, loaded on the target's devices."""

    placement: Placement
    loaded: LoadedModel
    backend: AttentionBackend


def num_speculative_tokens(config: EngineConfig) -> int:
    """Proposed tokens per request and step: ``--num-lookahead-slots``, which
    `EngineConfig` allows only as 0 (the default: num_speculative_tokens) or equal to
    num_speculative_tokens."""
    return config.scheduler_config.num_lookahead_slots or (
        config.speculative_config.num_speculative_tokens
    )


def lookahead_tokens(config: EngineConfig) -> int:
    """KV slots the scheduler allocates beyond a step's tokens: a draft model writes
    its proposals' KV there before the target verifies them; n-gram needs none."""
    method = config.speculative_config.method
    return num_speculative_tokens(config) if method == "draft_model" else 0


def load_draft(
    config: EngineConfig, devices: Sequence[Any] | None, vocab_size: int
) -> LoadedDraft | None:
    """The draft model of ``config`` (None unless the method is draft_model), checked
    against the target: JAX model, same vocabulary, context at least max_model_len."""
    sc = config.speculative_config
    if sc.method != "draft_model":
        return None
    mc = dataclasses.replace(
        config.model_config,
        model=sc.option("model"),
        tokenizer=None,
        revision=sc.option("revision"),
        quantization=sc.option("quantization"),
        hf_overrides={},
        served_model_name=None,
        model_impl="jax",
    )
    draft_config = dataclasses.replace(
        config, model_config=mc, lora_config=LoRAConfig(), speculative_config=SpeculativeConfig()
    )
    placement, loaded, backend = load_replica(draft_config, devices)
    if is_torch(loaded) or loaded.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {mc.model} has a vocabulary of "
            f"{loaded.config.vocab_size} tokens, the target {vocab_size}: a draft model "
            "must share the target's tokenizer"
        )
    return LoadedDraft(placement, loaded, backend)


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
        _cache_dtype(config, draft).itemsize,
    )


def _cache_dtype(config: EngineConfig, draft: LoadedDraft) -> Any:
    return jnp.dtype(config.cache_config.cache_dtype(jnp.dtype(draft.loaded.config.dtype).name))


def make_proposer(
    config: EngineConfig, draft: LoadedDraft | None, settings: Any
) -> Proposer | None:
    """The proposer of ``config`` (None: speculative decoding off); ``settings`` are
    the runner's (`RunnerSettings`): the draft model shares its pages and buckets."""
    sc = config.speculative_config
    k = num_speculative_tokens(config)
    if sc.method == "ngram":
        low, high = sc.prompt_lookup_min, sc.prompt_lookup_max
        return NgramProposer(k, low, high, sc.disable_by_batch_size)
    if draft is None:
        return None
    heads = draft.placement.plans[0].kv_cache_heads
    model = draft.loaded.config
    program = stage_program(draft.loaded, draft.placement, draft.backend, 1)
    draft_settings = DraftSettings(
        k=k,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        pages_per_req=settings.pages_per_req,
        token_buckets=settings.token_buckets,
        max_num_seqs=settings.max_num_seqs,
        vocab_size=model.vocab_size,
        cache_page_shape=kv_cache_shape(model, 1, settings.block_size, heads)[1:],
        cache_dtype=_cache_dtype(config, draft),
        disable_by_batch_size=sc.disable_by_batch_size,
    )
    return DraftProposer(program, draft.loaded.params, draft_settings)
