"""A pooling model's step results: each request's rows of the hidden states pooled on
the host (`runner.pooler`), then, for a classifier, its head and activation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxengine.core.sched_output import RunnerOutput
from jaxengine.runner.pooler import PoolerSettings, activate, pool


def pooled_output(
    order: list[str],
    states: Sequence,
    chunks: Sequence,
    hidden,
    settings: PoolerSettings,
    heads: Callable[[list[np.ndarray], list], list[np.ndarray]] | None,
) -> RunnerOutput:
    """Every request's whole prompt ran in one step; its result is its rows of the
    step's ``hidden`` states pooled (``heads``: a classifier's, or None)."""
    for chunk, state in zip(chunks, states, strict=True):
        if chunk.num_computed or len(chunk.token_ids) != state.num_prompt:
            raise RuntimeError("a pooling request's prompt must run in one step")
    rows = np.asarray(jax.device_get(hidden))
    sizes = [len(c.token_ids) for c in chunks]
    params = [s.params for s in states]
    pooled = pool(rows, sizes, params, settings)
    if heads is not None:
        pooled = heads(pooled, params)
    return RunnerOutput(req_ids=order, sampled_token_ids=[[] for _ in order], pooler_output=pooled)


def classifier_heads(
    pooled: list[np.ndarray], params: list, max_rows: int, classify: Callable
) -> list[np.ndarray]:
    """A classification model's results: its head (``classify``, at most
    ``max_rows`` rows a call) on each pooled vector, or on each token's row
    ("token_classify"), then the request's activation."""
    blocks = [np.atleast_2d(v) for v in pooled]
    rows = np.concatenate(blocks)
    n = max_rows
    logits = np.concatenate([classify(rows[i : i + n]) for i in range(0, len(rows), n)])
    out, start = [], 0
    for vector, block, p in zip(pooled, blocks, params, strict=True):
        part = logits[start : start + len(block)]
        start += len(block)
        out.append(activate(part if vector.ndim == 2 else part[0], p))
    return out


def padded_logits(classifier: Callable, params, rows: np.ndarray, n: int, width: int):
    """The head's logits ``[R, num_labels]`` of pooled rows ``[R, H]`` (padded to
    ``n`` rows of ``width``: one compiled shape)."""
    padded = np.zeros((n, width), np.float32)
    padded[: rows.shape[0], : rows.shape[1]] = rows
    logits = classifier(params, padded)
    return np.asarray(jax.device_get(logits))[: rows.shape[0]]
