"""Images in the scheduler: when each image is encoded, and where its embeddings live.

The runner keeps one array of ``num_rows`` image embeddings (`runner.encoder`); this
is its host side. An image (`multimodal.items.ImageItem`) is encoded once into rows
it keeps, keyed by its content hash, so a prompt prefilled in chunks, preempted, or
sent again by another request finds it there. A request holds a reference on each
image whose positions it has scheduled and not yet passed; an image nobody holds
stays cached until its rows are needed for another (least recently released first).

Each step, before a request's tokens ``[start, start + n)`` are scheduled,
`EncoderScheduler.plan` makes sure every image overlapping them is cached (or
encoded in this step: an `EncoderInput`), within the step's encoder budget
(``max_num_encoder_input_tokens``: embeddings encoded per step) and the free rows;
it cuts ``n`` before the first image that does not fit (or, where an image's tokens
attend both ways, that does not end in this chunk). References of images a step
passes are dropped when the step's plan is complete (`finish_step`), so no image this
step reads has its rows given to another image encoded in the same step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from jaxengine.core.sched_output import EncoderInput


class EncoderCache:
    """Rows of the image embeddings array, by image key, with per-request references."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, tuple[int, ...]] = {}
        self._refs: dict[str, set[str]] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # unreferenced, oldest first
        self.queries = 0
        """Images a request needed and got (once per request and image, counted by
        `EncoderScheduler`)."""
        self.hits = 0
        """Of those, the images found cached (not encoded for it)."""

    def holds(self, key: str, req_id: str) -> bool:
        return req_id in self._refs.get(key, ())

    def acquire(self, key: str, req_id: str) -> bool:
        """References a cached image for ``req_id``; False when it is not cached."""
        if key not in self._rows:
            return False
        self._ref(key, req_id)
        return True

    def allocate(self, key: str, n: int, req_id: str) -> tuple[int, ...] | None:
        """``n`` rows for a new image (evicting unreferenced images, oldest first),
        referenced by ``req_id``; None when even then they do not fit."""
        while len(self._free) < n and self._idle:
            old, _ = self._idle.popitem(last=False)
            self._free.extend(self._rows.pop(old))
            del self._refs[old]
        if len(self._free) < n:
            return None
        rows = tuple(self._free.pop() for _ in range(n))
        self._rows[key] = rows
        self._ref(key, req_id)
        return rows

    def release(self, key: str, req_id: str) -> None:
        refs = self._refs.get(key)
        if refs is None or req_id not in refs:
            return
        refs.discard(req_id)
        if not refs:
            self._idle[key] = None

    def release_all(self, req_id: str, keys: Iterable[str]) -> None:
        for key in keys:
            self.release(key, req_id)

    def reset(self) -> None:
        """Forgets every unreferenced image (the runner's rows were lost: sleep)."""
        for key in list(self._idle):
            self._free.extend(self._rows.pop(key))
            del self._refs[key]
        self._idle.clear()

    def _ref(self, key: str, req_id: str) -> None:
        self._refs.setdefault(key, set()).add(req_id)
        self._idle.pop(key, None)


class EncoderScheduler:
    """One step's image planning over an `EncoderCache` (see module doc)."""

    def __init__(self, cache: EncoderCache, budget: int, whole_images: bool = False) -> None:
        """``whole_images``: a chunk may not end inside an image (its tokens attend
        both ways, so they are computed in one step)."""
        self.cache = cache
        self.budget = budget
        self.whole_images = whole_images
        self._left = budget
        self._inputs: list[EncoderInput] = []
        self._passed: list[tuple[str, str]] = []  # (key, request) passed this step

    def plan(self, req, start: int, n: int) -> int:
        """How many of ``req``'s tokens ``[start, start + n)`` can run this step: all,
        or up to the first image that can be neither found nor encoded now."""
        rid = req.request_id
        for item in req.mm_items:
            if item.end <= start or item.start >= start + n:
                continue
            if self.whole_images and start + n < item.end:
                return max(item.start - start, 0)
            if not self.cache.holds(item.key, rid):
                hit = self.cache.acquire(item.key, rid)
                if not (hit or self._encode(item, rid)):
                    return max(item.start - start, 0)
                self.cache.queries += 1
                self.cache.hits += hit
            if item.end <= start + n:
                self._passed.append((item.key, rid))
        return n

    def _encode(self, item, rid: str) -> bool:
        if item.num_embeds > self._left:
            return False
        rows = self.cache.allocate(item.key, item.num_embeds, rid)
        if rows is None:
            return False
        self._left -= item.num_embeds
        self._inputs.append(EncoderInput(item.key, item.inputs, item.units, rows))
        return True

    def stats(self) -> dict[str, int]:
        """vLLM's multimodal cache counters (`SchedulerStats` fields)."""
        return {"mm_cache_queries": self.cache.queries, "mm_cache_hits": self.cache.hits}

    def finish_step(self) -> tuple[EncoderInput, ...]:
        """This step's encoder inputs; drops the references of the images it passes."""
        inputs, self._inputs = tuple(self._inputs), []
        for key, rid in self._passed:
            self.cache.release(key, rid)
        self._passed, self._left = [], self.budget
        return inputs
