"""The device side of one engine: a host wrapper around the compiled step functions.

`ModelRunner.execute(SchedulerOutput) -> RunnerOutput` (the contract in
`jaxengine.core.sched_output`): it updates its per-request state, copies swapped
pages, packs the scheduled tokens into the smallest bucket (`runner.batch`,
`runner.buckets`), runs the compiled model step (forward, KV write, last-token logits)
and the compiled sampler variant that covers the batch, and returns only sampled ids
and requested logprobs to the host.

The model step and the sampler are two compiled functions, not one: fusing them would
multiply the compile count by the number of sampler variants. Logits stay on device
between them. Per-request `logits_processors` (host callables) take a slower path:
the logits come to the host, the processors run, and the logits go back.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jaxengine.core.sched_output import RunnerOutput, SchedulerOutput
from jaxengine.models.layers.attention import kv_cache_shape
from jaxengine.runner.batch import SeqChunk, pack_batch
from jaxengine.runner.buckets import Bucket, BucketSet
from jaxengine.runner.compile_guard import CompileGuard
from jaxengine.runner.compiled import CompiledFunctions
from jaxengine.runner.sampling_metadata import (
    SamplingBatch,
    SamplingRow,
    apply_logits_processors,
    pick_variant,
    request_seed,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _RequestState:
    """What the runner keeps of a request between steps."""

    token_ids: list[int]  # prompt + outputs so far
    num_prompt: int
    block_ids: list[int]
    params: Any
    seed: int
    num_computed: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """The runner's shape parameters, fixed for its lifetime."""

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    token_buckets: tuple[int, ...]
    num_host_blocks: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    seed: int = 0
    eos_token_id: int | None = None


class ModelRunner:
    """Owns the KV cache and the compiled functions of one model."""

    def __init__(self, loaded: Any, settings: RunnerSettings, plan: Any = None) -> None:
        self.loaded = loaded
        self.settings = settings
        self.plan = plan  # sharding.plan.ShardingPlan, or None for the default device
        self.params = loaded.params
        config = loaded.config
        self.vocab_size = config.vocab_size
        self.pages_per_req = -(-settings.max_model_len // settings.block_size)
        self.buckets = BucketSet(list(settings.token_buckets), settings.max_num_seqs)
        heads = plan.kv_cache_heads if plan is not None else None
        shape = kv_cache_shape(config, settings.num_blocks, settings.block_size, heads)
        self.kv_caches = self._allocate_kv_caches(shape, config.dtype, len(config.layers))
        self.host_pages = None
        if settings.num_host_blocks:
            host_shape = (settings.num_host_blocks, *shape[1:])
            self.host_pages = [np.zeros(host_shape, config.dtype) for _ in config.layers]
        self.guard = CompileGuard()
        self.compiled = self._compiled_functions()
        self.requests: dict[str, _RequestState] = {}
        self._request_counter = 0

    def _allocate_kv_caches(self, shape: tuple, dtype: Any, num_layers: int) -> Any:
        """Zeroed per-layer caches, placed by the plan (split by KV heads)."""
        plan = self.plan
        placed = None if plan is None else (plan.kv_cache_sharding,) * num_layers
        zeros = jax.jit(
            lambda: tuple(jax.numpy.zeros(shape, dtype) for _ in range(num_layers)),
            out_shardings=placed,
        )
        return zeros()

    def _compiled_functions(self) -> CompiledFunctions:
        return CompiledFunctions(self)

    # ------------------------------------------------------------------ warm-up

    def warmup(self, progress: bool = True, arm: bool = True) -> None:
        """Compiles every bucket's step, prompt-logprobs and sampler variants, then arms
        the compile guard (``arm=False`` leaves that to a caller warming several
        engines in one process, whose compilations every guard hears)."""
        self.compiled.compile_all(progress)
        if arm:
            self.guard.arm()

    # ------------------------------------------------------------------ state

    def _register(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            seed = request_seed(params, self.settings.seed, self._request_counter)
            self._request_counter += 1
            self.requests[new.req_id] = _RequestState(
                token_ids=list(new.prompt_token_ids),
                num_prompt=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                params=params,
                seed=seed,
                num_computed=new.num_computed_tokens,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed = cached.num_computed_tokens
            end = cached.num_computed_tokens + len(cached.new_token_ids)
            if end > len(state.token_ids):  # tokens the runner has not seen (defensive)
                state.token_ids[cached.num_computed_tokens :] = cached.new_token_ids

    # ------------------------------------------------------------------ swap

    def _swap(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            dev = [d for d, _ in out.blocks_to_swap_out]
            pages = self.compiled.gather_pages(self.kv_caches, dev)
            for layer, host in enumerate(self.host_pages):
                host[[h for _, h in out.blocks_to_swap_out]] = pages[layer]
        if out.blocks_to_swap_in:
            host_ids = [h for h, _ in out.blocks_to_swap_in]
            pages = [host[host_ids] for host in self.host_pages]
            dev = [d for _, d in out.blocks_to_swap_in]
            self.kv_caches = self.compiled.scatter_pages(self.kv_caches, dev, pages)

    # ------------------------------------------------------------------ step

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one scheduled step; returns one entry per scheduled request."""
        self._register(out)
        self._swap(out)
        order = list(out.num_scheduled_tokens)
        if not order:
            return RunnerOutput(
                req_ids=[], sampled_token_ids=[], logprobs=None, prompt_logprobs=None
            )
        states = [self.requests[r] for r in order]
        chunks = [
            SeqChunk(
                s.token_ids[s.num_computed : s.num_computed + out.num_scheduled_tokens[r]],
                s.num_computed,
                s.block_ids,
            )
            for r, s in zip(order, states, strict=True)
        ]
        sampling = self._sampling_rows(out, order, states)
        groups = self.micro_batches([len(c.token_ids) for c in chunks])
        # dispatch every micro-batch's forward and sampling before reading any result,
        # so pipeline stages work on different micro-batches at once
        launched = [self._launch([chunks[i] for i in g], [sampling[i] for i in g]) for g in groups]
        rows: list[tuple[Any, Any, int]] = [None] * len(order)  # (token ids, logprobs, row)
        prompt_lps: list = [None] * len(order)
        for group, (bucket, batch, hidden, result) in zip(groups, launched, strict=True):
            token_ids, lp = jax.device_get(result)
            for row, i in enumerate(group):
                rows[i] = (token_ids, lp, row)
            group_lps = self._prompt_logprobs(
                bucket,
                batch,
                hidden,
                [order[i] for i in group],
                [states[i] for i in group],
                [chunks[i] for i in group],
            )
            for row, i in enumerate(group):
                prompt_lps[i] = group_lps[row] if group_lps else None

        sampled, logprobs = [], []
        for i, (req_id, state) in enumerate(zip(order, states, strict=True)):
            state.num_computed += out.num_scheduled_tokens[req_id]
            if sampling[i] is None:
                sampled.append([])
                logprobs.append(None)
                continue
            token_ids, lp, row = rows[i]
            token = int(token_ids[row])
            state.token_ids.append(token)
            sampled.append([token])
            logprobs.append(_row_logprobs(lp, row, state.params.logprobs))
        return RunnerOutput(
            req_ids=order,
            sampled_token_ids=sampled,
            logprobs=logprobs if any(x is not None for x in logprobs) else None,
            prompt_logprobs=prompt_lps if any(x is not None for x in prompt_lps) else None,
        )

    @staticmethod
    def _sampling_rows(out: SchedulerOutput, order: list[str], states: list) -> list:
        """Each scheduled request's `SamplingRow` (with its grammar bitmask row, if
        any), or None for a request mid-prefill (it samples nothing)."""
        rows = () if out.grammar_bitmask is None else out.grammar_bitmask
        masks = dict(zip(out.structured_output_req_ids, rows, strict=True))
        return [
            None
            if r in out.partial_req_ids
            else SamplingRow(
                s.params, s.output_ids, s.token_ids[: s.num_prompt], s.seed, None, masks.get(r)
            )
            for r, s in zip(order, states, strict=True)
        ]

    def micro_batches(self, num_tokens: list[int]) -> list[list[int]]:
        """The step's requests (by index) in the groups that run as separate batches:
        one group here; pipeline parallelism splits them so stages overlap."""
        return [list(range(len(num_tokens)))]

    def _launch(self, chunks: list[SeqChunk], sampling: list):
        """Packs, runs and samples one micro-batch without waiting for it:
        ``(bucket, batch, hidden, (token ids, logprobs) on device)``."""
        bucket = self.buckets.select(sum(len(c.token_ids) for c in chunks), len(chunks))
        batch = pack_batch(
            chunks,
            page_size=self.settings.block_size,
            num_tokens=bucket.num_tokens,
            num_reqs=bucket.num_reqs,
            pages_per_req=self.pages_per_req,
        )
        logits, hidden = self._forward(bucket, batch)
        return bucket, batch, hidden, self._sample(bucket, logits, sampling)

    def _forward(self, bucket: Bucket, batch):
        logits, hidden, self.kv_caches = self.compiled.step(self.params, self.kv_caches, batch)
        return logits, hidden

    def _sample(self, bucket: Bucket, logits, rows: list):
        batch = SamplingBatch(
            rows, bucket.num_reqs, self.vocab_size, eos_token_id=self.settings.eos_token_id
        )
        needed = batch.required_flags(self.settings.logprobs_mode)
        flags = pick_variant(needed, self.compiled.sampler_variants) or needed
        if batch.any_logits_processors:
            host = apply_logits_processors(np.asarray(logits), batch.rows)
            logits = self.compiled.to_device(host)
        result = self.compiled.sample(logits, batch.to_metadata(flags), flags)
        return result.token_ids, result.logprobs

    def _prompt_logprobs(self, bucket, batch, hidden, order, states, chunks):
        wanted = [s.params.prompt_logprobs is not None for s in states]
        if not any(wanted):
            return None
        targets = np.full(bucket.num_tokens, -1, np.int32)
        start = 0
        for state, chunk, want in zip(states, chunks, wanted, strict=True):
            n = len(chunk.token_ids)
            if want:
                pos = np.arange(chunk.num_computed, chunk.num_computed + n) + 1
                inside = pos < state.num_prompt
                targets[start : start + n] = np.where(
                    inside, np.take(state.token_ids, np.minimum(pos, len(state.token_ids) - 1)), -1
                )
            start += n
        out = jax.device_get(self.compiled.prompt_logprobs(self.params, hidden, targets))
        result, start = [], 0
        for state, chunk, want in zip(states, chunks, wanted, strict=True):
            n = len(chunk.token_ids)
            if not want:
                result.append(None)
            else:
                k = state.params.prompt_logprobs
                entries = []
                for j in range(start, start + n):
                    if targets[j] < 0:
                        continue
                    position = chunk.num_computed + (j - start) + 1
                    entries.append((position, int(targets[j]), *_pick(out, j, k)))
                result.append(entries)
            start += n
        return result

    def close(self) -> None:
        self.guard.close()


def _pick(lp, i: int, k: int | None):
    """(logprob, rank, top ids, top logprobs) of row ``i`` with ``k`` top entries."""
    k = lp.topk_ids.shape[1] if k is None or k < 0 else min(k, lp.topk_ids.shape[1])
    return (
        float(lp.sampled_logprob[i]),
        int(lp.sampled_rank[i]),
        lp.topk_ids[i, :k].tolist(),
        lp.topk_logprobs[i, :k].tolist(),
    )


def _row_logprobs(lp, i: int, k: int | None):
    if lp is None or k is None:
        return None
    return _pick(lp, i, k)
