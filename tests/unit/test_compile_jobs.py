"""`CompileJobs`: each job runs once, by whichever thread needs it first."""

from __future__ import annotations

import threading
import time

import pytest

from jaxengine.runner.warmup import CompileJobs


def recording_jobs(keys, delay=0.0):
    runs: list[tuple[str, str]] = []

    def job(key):
        def run():
            time.sleep(delay)
            runs.append((key, threading.current_thread().name))

        return run

    return [(k, job(k)) for k in keys], runs


def test_run_all_runs_each_job_once_in_order_then_on_done():
    jobs, runs = recording_jobs("abc")
    done = []
    compiles = CompileJobs(jobs, on_done=lambda: done.append(len(runs)))
    compiles.ensure("b")
    compiles.run_all()
    assert [k for k, _ in runs] == ["b", "a", "c"]
    assert done == [3] and compiles.finished
    compiles.ensure("a")  # done already: nothing runs
    compiles.ensure("unknown")  # nothing to compile ahead for it
    assert len(runs) == 3


def test_background_thread_runs_the_rest_while_a_caller_takes_what_it_needs():
    jobs, runs = recording_jobs("abcdef", delay=0.05)
    done = threading.Event()
    compiles = CompileJobs(jobs, on_done=done.set)
    compiles.start()
    compiles.ensure("f")  # needed now: runs here unless the thread already has it
    assert "f" in [k for k, _ in runs]
    assert compiles.wait(10) and done.is_set()
    assert sorted(k for k, _ in runs) == list("abcdef")  # each exactly once
    assert {name for _, name in runs} <= {"jaxengine-compile", threading.current_thread().name}


def test_a_caller_waits_for_the_job_the_thread_is_running():
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(10)

    compiles = CompileJobs([("slow", slow)])
    compiles.start()
    assert started.wait(10)
    waiter = threading.Thread(target=compiles.ensure, args=("slow",))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # blocked on the thread's run, not running it again
    release.set()
    waiter.join(10)
    assert not waiter.is_alive() and compiles.wait(10)


def test_a_failed_job_raises_in_whoever_needs_it_and_the_thread_goes_on():
    def broken():
        raise RuntimeError("out of memory")

    jobs, runs = recording_jobs("xy")
    compiles = CompileJobs([("bad", broken), *jobs])
    compiles.start()
    assert compiles.wait(10)
    assert [k for k, _ in runs] == ["x", "y"]
    with pytest.raises(RuntimeError, match="out of memory"):
        compiles.ensure("bad")


def test_close_stops_the_thread_after_its_current_job_without_on_done():
    jobs, runs = recording_jobs("abcdefgh", delay=0.05)
    done = []
    compiles = CompileJobs(jobs, on_done=lambda: done.append(True))
    compiles.start()
    time.sleep(0.07)
    compiles.close()
    count = len(runs)
    time.sleep(0.15)
    assert len(runs) == count < 8 and not done and compiles.finished
