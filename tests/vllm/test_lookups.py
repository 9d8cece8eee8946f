"""The scheduler side's asynchronous lookups (eg_kv.vllm.lookups.PendingLookups) with a
real eg-kv server and a server that never answers: a fast lookup answers in the first
ask, a slow one answers None until done, a silent server costs a miss in bounded time,
and the table stays bounded."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.common import wait_for
from helpers.kvcache import RawServer

from eg_kv.client.connectors import connect
from eg_kv.client.settings import KvCacheConfig
from eg_kv.vllm.addresses import BlockFormat, lookup_addresses, token_chain
from eg_kv.vllm.lookups import PendingLookups

pytestmark = pytest.mark.timeout(60)

FMT = BlockFormat(model="test-lookups", dtype="bfloat16", block_size=16, layout="l0:(2,16,8)")


def _addresses(n: int) -> list[str]:
    return lookup_addresses(token_chain(list(range(5, 5 + 16 * n)), 16), [FMT])


def test_a_real_server_answers_in_the_first_ask(server_factory):
    srv = server_factory(workers=1, capacity="32MiB")
    client = connect(KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0))
    try:
        addrs = _addresses(8)
        for a in addrs[:5]:
            assert client.put(a, b"x" * 100)
        lookups = PendingLookups(deadline_s=11.0, wait_s=2.0)
        assert lookups.ask("r1", (0, 8), lambda: client.contains_prefix(addrs)) == 5
        assert len(lookups) == 0  # answered: dropped
        assert lookups.counters["started"] == 1 and lookups.counters["deferred"] == 0
        lookups.close()
    finally:
        client.close()


def test_a_slow_lookup_answers_none_then_its_result():
    gate = threading.Event()
    calls = []

    def lookup() -> int:
        calls.append(1)
        gate.wait(10)
        return 7

    lookups = PendingLookups(deadline_s=30.0, wait_s=0.01)
    assert lookups.ask("r", "k", lookup) is None
    assert lookups.ask("r", "k", lookup) is None
    gate.set()
    deadline = time.monotonic() + 5
    answer = None
    while answer is None and time.monotonic() < deadline:
        answer = lookups.ask("r", "k", lookup)
        time.sleep(0.005)
    assert answer == 7
    assert len(calls) == 1  # one lookup for every ask
    assert len(lookups) == 0
    lookups.close()


def test_another_key_restarts_and_drop_forgets():
    gate = threading.Event()
    lookups = PendingLookups(deadline_s=30.0, wait_s=0.0)
    assert lookups.ask("r", (0, 4), lambda: gate.wait(10) and 4) is None
    assert lookups.ask("r", (1, 4), lambda: gate.wait(10) and 3) is None
    assert lookups.counters["started"] == 2 and len(lookups) == 1
    lookups.drop("r")
    lookups.drop("r")  # twice is fine
    assert len(lookups) == 0
    gate.set()
    lookups.close()


def test_the_table_is_bounded_and_overflow_is_a_miss_at_once():
    """Past the bound a new lookup is a miss without running (it ran inline on the
    scheduler's thread, up to the client's timeout, for every request)."""
    gate = threading.Event()
    lookups = PendingLookups(deadline_s=30.0, wait_s=0.0, max_pending=3)
    for i in range(3):
        assert lookups.ask(f"r{i}", 0, lambda: gate.wait(10) and 1) is None
    ran = []
    assert lookups.ask("r3", 0, lambda: ran.append(1) or 2) == 0
    assert ran == [] and len(lookups) == 3 and lookups.counters["full"] == 1
    gate.set()
    lookups.close()
    assert len(lookups) == 0


def test_lookups_dropped_or_expired_before_they_start_never_run():
    """A silent server holds both threads; the lookups queued behind them and then dropped
    (the request finished) or expired never run: the queue holds live lookups only."""
    gate = threading.Event()
    lookups = PendingLookups(deadline_s=0.2, wait_s=0.0, threads=1)
    ran: list[str] = []
    assert lookups.ask("busy", 0, lambda: gate.wait(10) and 1) is None
    for i in range(5):
        assert lookups.ask(f"r{i}", 0, lambda i=i: ran.append(f"r{i}") or 1) is None
    for i in range(3):
        lookups.drop(f"r{i}")
    deadline = time.monotonic() + 5
    while len(lookups) > 1 and time.monotonic() < deadline:  # r3, r4 expire when asked
        for i in (3, 4):
            if f"r{i}" in lookups._pending:
                lookups.ask(f"r{i}", 0, lambda: 1)
        time.sleep(0.05)
    gate.set()
    got = lookups.ask("last", 0, lambda: 7)  # queued after them: once it ran, they had
    while got is None and time.monotonic() < deadline + 5:
        time.sleep(0.01)
        got = lookups.ask("last", 0, lambda: 7)
    lookups.close()
    assert got == 7 and ran == []


def test_a_failing_lookup_is_a_miss():
    def boom() -> int:
        raise OSError("down")

    lookups = PendingLookups(deadline_s=5.0, wait_s=1.0)
    assert lookups.ask("r", 0, boom) == 0
    assert lookups.counters["failed"] == 1
    lookups.close()


@pytest.mark.slow
def test_a_server_that_never_answers_costs_a_miss_in_bounded_time():
    """A raw socket that accepts and never answers: the scheduler asks every 'step' and
    gets None, never blocks longer than wait_s, and gets 0 once the lookup gave up."""
    with RawServer("silent") as raw:
        client = connect(KvCacheConfig.from_env({}, base_url=raw.url, timeout_s=0.5))
        try:
            addrs = _addresses(4)
            lookups = PendingLookups(deadline_s=3.0, wait_s=0.002)
            t0 = time.monotonic()
            answers = []
            longest = 0.0
            while time.monotonic() - t0 < 10:
                s = time.monotonic()
                answer = lookups.ask("r", (0, 4), lambda: client.contains_prefix(addrs))
                longest = max(longest, time.monotonic() - s)
                answers.append(answer)
                if answer is not None:
                    break
                time.sleep(0.01)
            assert answers[-1] == 0
            assert None in answers  # it was deferred while the server kept silent
            assert time.monotonic() - t0 < 4.5  # the client's timeout or the deadline
            assert longest < 0.25  # no ask held the "scheduler"
            assert len(lookups) == 0
            lookups.close()
        finally:
            client.close()


def test_the_answer_of_a_dropped_or_expired_lookup_goes_to_discard():
    """What a lookup leased is released when nobody reads its answer (the connector's
    discard), whether its entry was dropped, expired or the table closed while it ran."""
    gate = threading.Event()
    discarded: list[tuple[int, list[str]]] = []
    lookups = PendingLookups(deadline_s=0.2, wait_s=0.0, miss=(0, []), discard=discarded.append)

    def lookup(name: str):
        return lambda: (gate.wait(10), (1, [name]))[1]

    assert lookups.ask("dropped", "k", lookup("a")) is None
    started = time.monotonic()
    assert lookups.ask("expired", "k", lookup("b")) is None
    lookups.drop("dropped")
    while time.monotonic() - started < 0.2:  # until past the deadline
        time.sleep(0.01)
    assert lookups.ask("expired", "k", lookup("b")) == (0, [])  # a miss
    assert lookups.ask("open", "k", lookup("c")) is None  # queued behind the two
    lookups.close()  # "c" never starts: nothing of it to discard
    gate.set()
    wait_for(lambda: len(discarded) == 2, timeout=5, what="both answers discarded")
    assert sorted(discarded) == [(1, ["a"]), (1, ["b"])]
