"""`StreamTable`: the one place requests' outputs go, for every engine client.

Producers on other threads deliver batches to streams opened on several event
loops (one callback per loop per batch, order kept); errors end their stream;
`fail_all` fails one owner's streams (or all) and refuses new ones; counts and
owners are per data-parallel rank. Host only: no model, no jax.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from jaxengine.entrypoints.streams import StreamTable
from jaxengine.outputs import CompletionOutput, RequestOutput


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    seq = CompletionOutput(0, "", [token], None, None, "length" if finished else None)
    return RequestOutput(request_id, None, [0], None, [seq], finished)


class LoopThread:
    """An event loop running on its own thread (as each server worker's would)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.callbacks = 0
        original = self.loop.call_soon_threadsafe

        def counting(callback: Callable[..., Any], *args: Any, **kwargs: Any):
            self.callbacks += 1
            return original(callback, *args, **kwargs)

        self.loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loops():
    pair = [LoopThread(), LoopThread()]
    yield pair
    for lt in pair:
        lt.stop()


async def _open(table: StreamTable, request_id: str, owner: int):
    return table.open(request_id, owner)


async def _drain(stream) -> list[int]:
    tokens = []
    while not stream.finished:
        tokens += (await stream.next()).outputs[0].token_ids
    return tokens


def test_one_batch_reaches_streams_on_several_loops_in_order(loops):
    table = StreamTable()
    a, b = loops
    streams = {
        "a0": a.run(_open(table, "a0", 0)),
        "a1": a.run(_open(table, "a1", 1)),
        "b0": b.run(_open(table, "b0", 0)),
    }
    before = [a.callbacks, b.callbacks]
    batch = [(rid, output(rid, t)) for t in (1, 2) for rid in ("a0", "b0", "a1")]
    batch += [(rid, output(rid, 3, finished=True)) for rid in ("b0", "a1", "a0")]
    batch.append(("gone", output("gone", 9)))  # not open: dropped
    producer = threading.Thread(target=table.deliver, args=(batch,))
    producer.start()
    producer.join(10)
    assert [a.callbacks - before[0], b.callbacks - before[1]] == [1, 1]  # one per loop
    assert a.run(_drain(streams["a0"])) == [1, 2, 3]
    assert a.run(_drain(streams["a1"])) == [1, 2, 3]
    assert b.run(_drain(streams["b0"])) == [1, 2, 3]


def test_an_error_ends_its_stream_only(loops):
    table = StreamTable()
    (a, _) = loops
    bad, good = a.run(_open(table, "bad", 0)), a.run(_open(table, "good", 0))
    table.deliver([("bad", ValueError("too long")), ("good", output("good", 1))])
    with pytest.raises(ValueError, match="too long"):
        a.run(bad.next())
    assert table.owner_of("bad") is None and table.count() == 1
    table.deliver([("bad", output("bad", 2))])  # after its error: dropped
    assert a.run(good.next()).outputs[0].token_ids == [1]
    assert bad.queue.empty()


def test_fail_all_fails_one_owner_then_everyone(loops):
    table = StreamTable()
    a, b = loops
    zero, one = a.run(_open(table, "x", 0)), b.run(_open(table, "y", 1))
    table.fail_all(RuntimeError("rank 1 died"), owner=1)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        b.run(one.next())
    with pytest.raises(RuntimeError, match="rank 1 died"):
        b.run(_open(table, "z", 1))  # a failed owner takes no new stream
    assert table.counts() == {0: 1}
    also_zero = a.run(_open(table, "w", 0))  # the others still do
    table.fail_all(RuntimeError("all gone"))
    for stream in (zero, also_zero):
        with pytest.raises(RuntimeError, match="all gone"):
            a.run(stream.next())
    with pytest.raises(RuntimeError, match="all gone"):
        a.run(_open(table, "v", 0))
    assert table.count() == 0


def test_counts_owners_duplicates_and_owner_filtered_delivery(loops):
    table = StreamTable()
    (a, _) = loops
    for rid, owner in [("r0", 0), ("r1", 1), ("r2", 1), ("r3", 2)]:
        a.run(_open(table, rid, owner))
    assert table.counts() == {0: 1, 1: 2, 2: 1}
    assert [table.count(o) for o in range(4)] == [1, 2, 1, 0] and table.count() == 4
    assert table.owner_of("r2") == 1 and table.owner_of("nope") is None
    with pytest.raises(ValueError, match="duplicate request id 'r1'"):
        a.run(_open(table, "r1", 0))
    table.close("r1")
    table.close("r1")  # idempotent
    reopened = a.run(_open(table, "r1", 2))  # an id may come back, on another rank
    table.deliver([("r1", output("r1", 7))], owner=1)  # the old owner's late output
    table.deliver([("r1", output("r1", 8))], owner=2)
    assert a.run(reopened.next()).outputs[0].token_ids == [8]
    assert table.counts() == {0: 1, 1: 1, 2: 2}


def test_delivery_to_a_closed_loop_is_dropped():
    table = StreamTable()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_open(table, "r", 0))
    loop.close()
    table.deliver([("r", output("r", 1))])  # nobody listens: no error
    table.fail_all(RuntimeError("late"))


def test_streams_import_no_jax():
    code = "import sys, jaxengine.entrypoints.streams; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
