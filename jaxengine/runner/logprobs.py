"""Logprobs read back to the host: a sampled row's entry and a chunk's prompt logprobs.

The sampler and the prompt-logprobs function leave their results on device
(`runner.sampler`: `sampled_logprob`, `sampled_rank`, the top-k ids and logprobs,
and the ``logprob_token_ids`` gather); these functions turn a step's rows into the
host entries that `RunnerOutput.logprobs` and ``prompt_logprobs`` carry.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxengine.runner.batch import SeqChunk
from jaxengine.runner.request_table import RequestState


def pick(lp, i: int, k: int | None):
    """(logprob, rank, top ids, top logprobs) of row ``i`` with ``k`` top entries."""
    k = lp.topk_ids.shape[1] if k is None or k < 0 else min(k, lp.topk_ids.shape[1])
    return (
        float(lp.sampled_logprob[i]),
        int(lp.sampled_rank[i]),
        lp.topk_ids[i, :k].tolist(),
        lp.topk_logprobs[i, :k].tolist(),
    )


def row_logprobs(lp, i: int, params):
    """Row ``i``'s entry: `pick` of the top-k, or with ``logprob_token_ids`` (sampled
    logprob, rank, the ids, their logprobs, their ranks)."""
    k = params.logprobs_top_k
    if lp is None or k is None:
        return None
    ids = params.logprob_token_ids
    if not ids:
        return pick(lp, i, k)
    n = len(ids)
    return (
        float(lp.sampled_logprob[i]),
        int(lp.sampled_rank[i]),
        list(ids),
        lp.ids_logprobs[i, :n].tolist(),
        lp.ids_ranks[i, :n].tolist(),
    )


def prompt_targets(num_tokens: int, states, chunks, wanted) -> np.ndarray:
    """Per packed token: the next prompt token (whose logprob is wanted), else -1."""
    targets = np.full(num_tokens, -1, np.int32)
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
    return targets


def prompt_logprobs(
    compute: Any, num_tokens: int, states: list[RequestState], chunks: list[SeqChunk]
) -> list | None:
    """Each request's prompt-logprob entries (position, token, logprob, rank, top ids,
    top logprobs) for the chunk it ran, or None for one that asked for none (None
    when none did). ``compute(targets)``: the program's compiled prompt logprobs of
    the step's hidden states."""
    wanted = [s.params.prompt_logprobs is not None for s in states]
    if not any(wanted):
        return None
    targets = prompt_targets(num_tokens, states, chunks, wanted)
    out = jax.device_get(compute(targets))
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
                entries.append((position, int(targets[j]), *pick(out, j, k)))
            result.append(entries)
        start += n
    return result
