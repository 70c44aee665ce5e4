"""Pooling: a pooling request's result from its prompt's last hidden states (host side).

A pooling model's step runs each request's whole prompt at once (`PoolingParams`:
the scheduler never splits it), so the request's rows of the step's hidden states
are its prompt, and its result is those rows pooled (`PoolerSettings`): the last
row (LAST), their mean (MEAN), the first (CLS) or all of them (ALL, and the
per-token tasks); then cut to ``dimensions`` and L2-normalized as asked. A
classification model's results then go through its head (`activate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxengine.pooling_params import PoolingParams


@dataclasses.dataclass(frozen=True)
class PoolerSettings:
    """A pooling model's pooler (`--pooler-config`, resolved for the model)."""

    pooling_type: str  # LAST, MEAN, CLS or ALL
    normalize: bool  # the default when a request does not say
    dimensions: int | None = None  # the default cut (Matryoshka), None: all
    matryoshka: bool = False  # requests may ask for fewer dimensions
    num_labels: int = 0  # a classification model's: pooled rows go through its head
    labels: tuple[str, ...] = ()  # its label names (config.json's id2label)
    tasks: tuple[str, ...] = ("embed", "token_embed", "encode")  # those it runs, default first


def pool(
    hidden: np.ndarray, sizes: Sequence[int], params: Sequence[PoolingParams], settings
) -> list[np.ndarray]:
    """Each request's result: request i has the next ``sizes[i]`` rows of ``hidden``."""
    out, start = [], 0
    for n, p in zip(sizes, params, strict=True):
        out.append(pool_rows(hidden[start : start + n], p, settings))
        start += n
    return out


def activate(logits: np.ndarray, params: PoolingParams) -> np.ndarray:
    """A classification head's output as a request gets it: probabilities (sigmoid
    for one label, softmax over several), or the logits with ``use_activation``
    False."""
    logits = np.asarray(logits, np.float64)
    if params.use_activation is False:
        return logits.astype(np.float32)
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def pool_rows(rows: np.ndarray, params: PoolingParams, settings: PoolerSettings) -> np.ndarray:
    """One request's result from its prompt's rows ``[n, H]``."""
    rows = np.asarray(rows, np.float32)
    kind = "ALL" if params.per_token else settings.pooling_type
    if kind == "ALL":
        value = rows
    elif kind == "MEAN":
        value = rows.mean(axis=0)
    elif kind == "CLS":
        value = rows[0]
    else:
        value = rows[-1]
    dims = params.dimensions if params.dimensions is not None else settings.dimensions
    if dims is not None:
        value = value[..., :dims]
    normalize = settings.normalize if params.normalize is None else params.normalize
    if normalize:
        norm = np.linalg.norm(value, axis=-1, keepdims=True)
        value = value / np.maximum(norm, 1e-12)
    return value
