"""Speculative decoding's parts of a worker (``--speculative-config``): how many
tokens a step verifies, the KV slots kept ahead, the draft model's pages, and the
proposer (n-gram on the host, or on the device a draft model, or a head on the
target's hidden states: an EAGLE head or the checkpoint's MTP layer)."""

from __future__ import annotations

import jax

from jaxengine.config import EngineConfig
from jaxengine.loader import LoadedModel
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.kv_sizing import bytes_per_block, cache_dtype
from jaxengine.runner.model_runner import RunnerSettings
from jaxengine.runner.piecewise import program_class
from jaxengine.runner.program import abstract_like, single_stage
from jaxengine.speculative import Proposer
from jaxengine.speculative.device.draft import DraftProposer, DraftSettings
from jaxengine.speculative.device.eagle import EagleProposer, make_eagle_step
from jaxengine.speculative.device.loading import HEADS, ON_DEVICE, LoadedDraft
from jaxengine.speculative.ngram import NgramProposer


def num_speculative_tokens(config: EngineConfig) -> int:
    """Proposed tokens per request and step: ``--num-lookahead-slots``, which
    `EngineConfig` allows only as 0 (the default: num_speculative_tokens) or equal to
    num_speculative_tokens."""
    return config.scheduler_config.num_lookahead_slots or (
        config.speculative_config.num_speculative_tokens
    )


def lookahead_tokens(config: EngineConfig) -> int:
    """KV slots the scheduler allocates beyond a step's tokens: a draft model or head
    (EAGLE, MTP) writes its proposals' KV there before the target verifies them;
    n-gram needs none."""
    method = config.speculative_config.method
    return num_speculative_tokens(config) if method in ON_DEVICE else 0


def draft_bytes_per_block(config: EngineConfig, draft: LoadedDraft | None) -> int:
    """One page of the draft's KV cache on one device (0 without a draft)."""
    if draft is None:
        return 0
    model, platform = draft.loaded.config, draft.placement.platform
    heads = draft.placement.plans[0].kv_heads_per_device
    return bytes_per_block(
        len(model.layers),
        config.cache_config.block_size,
        1,  # kv_parts: a device's rows of every head
        kv_cache_shape(model, 1, 1, 1, platform)[3],  # a row's (padded) width
        cache_dtype(config, draft.loaded.config).itemsize,
        kv_parts=kv_cache_shape(model, 1, 1, heads, platform)[2],  # K and V (padded on TPU)
    )


def make_proposer(
    config: EngineConfig,
    draft: LoadedDraft | None,
    settings: RunnerSettings,
    target: LoadedModel,
) -> Proposer | None:
    """The proposer of ``config`` (None: speculative decoding off); ``settings`` are
    the runner's: a draft model or head shares its pages and buckets."""
    sc = config.speculative_config
    k = num_speculative_tokens(config)
    if sc.method == "ngram":
        low, high = sc.prompt_lookup_min, sc.prompt_lookup_max
        return NgramProposer(k, low, high, sc.disable_by_batch_size)
    if draft is None:
        return None
    heads = draft.placement.plans[0].kv_cache_heads
    place = (draft.placement.platform, draft.placement.plans[0].tensor_size)  # padded on TPU
    model = draft.loaded.config
    draft_settings = DraftSettings(
        k=k,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        pages_per_req=settings.pages_per_req,
        token_buckets=settings.token_buckets,
        max_num_seqs=settings.max_num_seqs,
        vocab_size=model.vocab_size,
        cache_page_shape=kv_cache_shape(model, 1, settings.block_size, heads, *place)[1:],
        cache_dtype=cache_dtype(config, draft.loaded.config),
        disable_by_batch_size=sc.disable_by_batch_size,
    )
    if sc.method in HEADS:
        return eagle_proposer(draft, draft_settings, target)
    plan, backend = draft.placement.plans[0], draft.backend
    mode = config.compilation_config.cudagraph_mode
    cls = program_class(draft.loaded.module, mode, plan)
    kwargs = backend.module_kwargs()
    program = single_stage(draft.loaded.module, len(model.layers), plan, kwargs, 1, program=cls)
    return DraftProposer(program, draft.loaded.params, draft_settings)


def eagle_proposer(draft: LoadedDraft, settings: DraftSettings, target: LoadedModel):
    """The proposer of a head on the target's hidden states, ``draft`` (`load_eagle`'s
    or `load_mtp`'s), for ``target``'s runner; a head with experts (an MTP layer) runs
    them as the target does (`ShardingPlan.moe_kwargs`)."""
    plan = draft.placement.plans[0]
    kwargs = {"attention_kwargs": plan.attention_kwargs(draft.backend.module_kwargs())}
    if hasattr(draft.loaded.module, "moe_kwargs"):
        kwargs["moe_kwargs"] = plan.moe_kwargs()
    head = draft.loaded.module.clone(**kwargs)
    step = make_eagle_step(head, target.module, settings.max_num_seqs, draft.shared_embedding)
    multi = len(draft.placement.devices) > 1
    source = jax.ShapeDtypeStruct(
        (1, target.config.hidden_size),
        target.config.dtype,
        sharding=plan.replicated if multi else None,
    )
    return EagleProposer(
        step,
        draft.loaded.params,
        settings,
        len(draft.loaded.config.layers),
        source,
        abstract_like(target.params),
        plan.kv_cache_sharding if multi else None,
    )
