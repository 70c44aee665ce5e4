"""The runner's custom logits processors (``--logits-processors``) and the batch they see.

`ProcessorBatch` holds the engine's processor instances (`jaxengine.logits_processor`)
and what vLLM calls the persistent batch: batch index ``i`` is row ``i`` of a step's
sampled logits. Each step it compares the rows' requests with the previous step's,
hands every processor the `BatchUpdate` (removed: an index whose request left or was
replaced; added: a request at a new index, with its params, prompt ids and live
output list; nothing is reported as moved), and collects each processor's
``state(num_rows)``: the arrays the compiled sampler's ``apply`` reads.

The state's shapes and dtypes must depend on the row count alone: `template` records
them once per row count (the warm-up compiles against it) and each step's state is
checked against it, so a processor whose shapes drift is an error naming it, never
a compilation after warm-up. A lock keeps a background warm-up's `template` apart
from the engine thread's steps.

numpy only: no jax import.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxengine.logits_processor import BatchUpdate, LogitsProcessor, qualified_name
from jaxengine.runner.sampling_metadata import SamplingRow


class ProcessorBatch:
    """The processors of one runner and the requests at each batch index."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = tuple(processors)
        self._ids: list[str | None] = []  # request at each batch index, last step
        self._outputs: dict[str, list[int]] = {}  # live output list per request
        self._templates: dict[int, tuple] = {}  # row count -> (spec, zero states)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.processors)

    @property
    def custom(self) -> bool:
        """Whether a processor's code is the user's: outside ``jaxengine``, so outside
        what the `ExecutableStore` hashes (the built-in thinking budget is inside)."""
        return any(not type(p).__module__.startswith("jaxengine.") for p in self.processors)

    def template(self, num_rows: int) -> tuple:
        """Zero states shaped as each processor's for ``num_rows`` rows (warm-up)."""
        with self._lock:
            return self._template(num_rows)[1]

    def step(self, ids: Sequence[str | None], rows: Sequence[SamplingRow | None], num_rows: int):
        """Updates every processor with this step's batch (``ids[i]`` and ``rows[i]``:
        batch index i's request and sampling row, None for an index that samples
        nothing) and returns their states for ``num_rows`` rows."""
        with self._lock:
            update = self._update(ids, rows)
            for proc in self.processors:
                proc.update_state(update)
            states = tuple(proc.state(num_rows) for proc in self.processors)
            self._check(states, num_rows)
        return states

    def clear(self) -> None:
        """Every request leaves (the runner's release)."""
        with self._lock:
            self._ids, self._outputs = [], {}

    # ------------------------------------------------------------------ internals

    def _update(self, ids: Sequence[str | None], rows: Sequence[SamplingRow | None]):
        ids = [None if row is None else rid for rid, row in zip(ids, rows, strict=True)]
        prev = self._ids
        removed = [i for i, rid in enumerate(prev) if rid is not None and _at(ids, i) != rid]
        added = []
        for i, (rid, row) in enumerate(zip(ids, rows, strict=True)):
            if rid is None:
                continue
            live = self._outputs.get(rid)
            fresh = _at(prev, i) != rid
            if live is None or fresh:
                live = self._outputs[rid] = list(row.output_token_ids)
            elif len(row.output_token_ids) != len(live):
                live[len(live) :] = row.output_token_ids[len(live) :]
            if fresh:
                added.append((i, row.params, list(row.prompt_token_ids), live))
        present = {rid for rid in ids if rid is not None}
        for rid in [r for r in self._outputs if r not in present]:
            del self._outputs[rid]
        self._ids = ids
        if not removed and not added and len(prev) == len(ids):
            return None
        return BatchUpdate(len(ids), removed, added, [])

    def _template(self, num_rows: int) -> tuple:
        if num_rows not in self._templates:
            states = tuple(proc.state(num_rows) for proc in self.processors)
            zeros = tuple(_map(lambda a: np.zeros_like(a), s) for s in states)
            self._templates[num_rows] = (_spec(states), zeros)
        return self._templates[num_rows]

    def _check(self, states: tuple, num_rows: int) -> None:
        expected = self._template(num_rows)[0]
        got = _spec(states)
        for proc, want, have in zip(self.processors, expected, got, strict=True):
            if want != have:
                raise ValueError(
                    f"logits processor {qualified_name(type(proc))}: state({num_rows}) "
                    f"changed shape or dtype ({want} at warm-up, now {have}); its arrays "
                    "must depend on the number of rows only"
                )


def _at(ids: Sequence[str | None], i: int) -> str | None:
    return ids[i] if i < len(ids) else None


def _map(fn, tree: Any) -> Any:
    """``fn`` on each array of a pytree of tuples, lists and dicts (no jax here)."""
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        mapped = [_map(fn, v) for v in tree]
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)
    return fn(np.asarray(tree))


def _spec(states: tuple) -> tuple:
    """Each state's structure with (shape, dtype) for every array."""
    return tuple(repr(_map(lambda a: (a.shape, a.dtype.name), s)) for s in states)
