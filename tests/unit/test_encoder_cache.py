"""The scheduler's image planning (`core/encoder_cache.py`) with fake requests: each
image encoded once, held while a request needs it, evicted oldest-released first,
chunks cut before an image that does not fit, no rows reassigned within a step."""

from __future__ import annotations

from types import SimpleNamespace

from jaxengine.core.encoder_cache import EncoderCache, EncoderScheduler
from jaxengine.multimodal.items import ImageItem


def _item(key: str, start: int, n: int) -> ImageItem:
    return ImageItem(key, tuple(range(start, start + n)), {}, 1)


def _req(rid: str, *items: ImageItem):
    return SimpleNamespace(request_id=rid, mm_items=items)


def test_an_image_is_encoded_once_and_found_again():
    plan = EncoderScheduler(EncoderCache(8), budget=8)
    a = _req("a", _item("x", 2, 4))
    assert plan.plan(a, 0, 4) == 4  # the image starts in this chunk: encoded now
    (encoded,) = plan.finish_step()
    assert encoded.key == "x" and len(encoded.rows) == 4
    assert plan.plan(a, 4, 4) == 4 and plan.finish_step() == ()  # held: no second encode
    b = _req("b", _item("x", 0, 4))
    assert plan.plan(b, 0, 4) == 4 and plan.finish_step() == ()  # released, still cached
    assert (plan.cache.queries, plan.cache.hits) == (2, 1)


def test_a_chunk_is_cut_before_an_image_that_does_not_fit():
    plan = EncoderScheduler(EncoderCache(6), budget=6)
    a = _req("a", _item("x", 1, 4), _item("y", 6, 4))
    assert plan.plan(a, 0, 12) == 6  # y needs 4 more rows while x holds 4 of 6
    plan.finish_step()
    assert plan.plan(a, 6, 6) == 6  # x was passed and released: y takes its rows
    (encoded,) = plan.finish_step()
    assert encoded.key == "y"


def test_rows_read_in_a_step_are_not_given_away_in_it():
    plan = EncoderScheduler(EncoderCache(4), budget=8)
    a, b = _req("a", _item("x", 0, 4)), _req("b", _item("y", 0, 4))
    assert plan.plan(a, 0, 8) == 8  # passes x in this step
    assert plan.plan(b, 0, 8) == 0  # x's rows stay x's until the step is planned
    plan.finish_step()
    assert plan.plan(b, 0, 8) == 8  # next step: x is released and evicted for y


def test_the_step_budget_limits_encoding():
    plan = EncoderScheduler(EncoderCache(16), budget=6)
    a, b = _req("a", _item("x", 0, 4)), _req("b", _item("y", 3, 4))
    assert plan.plan(a, 0, 8) == 8
    assert plan.plan(b, 0, 8) == 3  # 4 more embeddings exceed the step's budget of 6
    plan.finish_step()
    assert plan.plan(b, 3, 5) == 5


def test_evicts_the_image_released_first():
    cache = EncoderCache(8)
    cache.allocate("x", 4, "a")
    cache.allocate("y", 4, "b")
    cache.release("x", "a")
    cache.release("y", "b")
    cache.allocate("z", 4, "c")
    assert not cache.acquire("x", "d") and cache.acquire("y", "d")
