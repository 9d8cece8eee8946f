"""The vLLM connector's scheduler-side lease book (eg_kv.vllm.scheduler_leases), with a
release function that records what it is asked: which leases end when, and that the book
and its queue are bounded. The same book against a real server, with a worker's load in
between: tests/client/test_client_leases.py; inside vLLM's own config:
tests/vllm/connector_proc.py."""

from __future__ import annotations

import threading

import pytest

from eg_kv.vllm import scheduler_leases
from eg_kv.vllm.scheduler_leases import SchedulerLeases

pytestmark = pytest.mark.timeout(30)


class Releases:
    """What the book asked to release, batch by batch; ``gate`` holds the thread."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, addresses):
        self.gate.wait(10)
        self.batches.append(list(addresses))
        return len(addresses)


def test_a_loads_leases_end_lag_steps_after_the_step_that_planned_it():
    got = Releases()
    book = SchedulerLeases(got, lag=2)  # async scheduling: two batches in flight
    book.looked_up("r", ["a", "b"])
    book.step()
    book.planned("r")  # step 1 loads them
    book.step()  # step 2 built while step 1 may still run
    assert book.drain(5) and got.batches == []
    book.step()  # step 3: vLLM has step 1's output
    assert book.drain(5) and got.batches == [["a", "b"]]
    assert book.stats()["held"] == 0 and book.counters["released"] == 2
    book.close()


def test_a_newer_answer_replaces_the_older_leases_and_unloaded_ones_end_at_once():
    got = Releases()
    book = SchedulerLeases(got, lag=1)
    book.looked_up("r", ["a", "b"])
    book.looked_up("r", ["a", "b", "c"])  # asked again a step later: leased again
    book.looked_up("s", ["x"])
    book.not_loaded("s")  # vLLM allocated no external tokens, or it finished
    book.not_loaded("t")  # nothing held: nothing sent
    book.looked_up("u", [])
    assert book.drain(5) and got.batches == [["a", "b"], ["x"]]
    assert book.stats()["held"] == 3
    book.close(timeout_s=5)  # what is held is released at shutdown
    assert got.batches[-1] == ["a", "b", "c"]


def test_the_held_table_and_the_release_queue_are_bounded(monkeypatch):
    monkeypatch.setattr(scheduler_leases, "MAX_HELD", 3)
    monkeypatch.setattr(scheduler_leases, "MAX_QUEUED", 2)
    got = Releases()
    got.gate.clear()  # a server that does not answer: the thread is stuck on the first
    book = SchedulerLeases(got, lag=1)
    for i in range(4):
        book.looked_up(f"r{i}", [f"a{i}"])  # the fourth pushes out r0: released
    assert book.stats()["held"] == 3
    book.not_loaded("r1")  # queued behind the stuck one
    book.not_loaded("r2")  # past the queue's bound: dropped, its lease ends on its own
    assert book.counters["release_dropped"] == 1
    got.gate.set()
    assert book.drain(5) and got.batches == [["a0"], ["a1"]]
    book.close()
