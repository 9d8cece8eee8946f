"""EgKvTier's parts that need no vLLM (eg_kv.vllm.tier_settings, tier_lookups,
tier_copies), against real eg-kv servers and misbehaving ones: settings are checked,
a step's lookups go out as one probe, a silent server or a backlog costs misses in bounded
time, copies round-trip and refuse what is not what was stored, stores ask
100-continue, drain waits for copies."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers.common import wait_for
from helpers.kvcache import RawServer

from eg_kv.client.connectors import connect
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError
from eg_kv.vllm.tier_copies import TRAILER, CopyJobs, trailer
from eg_kv.vllm.tier_lookups import StepLookups
from eg_kv.vllm.tier_settings import tier_settings_from

pytestmark = pytest.mark.timeout(60)

ROW = 80 * 1024


def _address(i: int) -> str:
    return f"egv2-{i:040x}"


@pytest.fixture
def client(server_factory):
    srv = server_factory(workers=1, capacity="32MiB")
    c = connect(KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0, local_reads=False))
    yield c
    c.close()


def test_settings_take_client_keys_and_refuse_unknown_ones():
    s = tier_settings_from({"url": "http://127.0.0.1:9", "timeout_s": 2, "lease_ms": 0}, env={})
    assert s.client.base_url == "http://127.0.0.1:9" and s.lease_ms == 0
    assert s.lookup_deadline_s == 5.0  # 2 x timeout_s + 1
    assert s.load_deadline_s == 5.0  # the same default
    never = tier_settings_from({"url": "http://127.0.0.1:9", "load_deadline_s": 0}, env={})
    assert never.load_deadline_s == 0  # 0: a load is never failed early
    with pytest.raises(ConfigError, match="unknown key 'urll'"):
        tier_settings_from({"urll": "x"}, env={})
    with pytest.raises(ConfigError, match="twice"):
        tier_settings_from({"url": "http://a:1", "base_url": "http://a:1"}, env={})
    for bad in ({"io_threads": 0}, {"lease_ms": -1}, {"locality": "MARS"},
                {"enable_kv_events": "yes"}, {"lookup_deadline_s": 0},
                {"load_deadline_s": -1}, {"load_deadline_s": "soon"},
                {"load_deadline_s": True}, {"load_deadline_s": "inf"},
                {"lookup_deadline_s": float("inf")}):  # fmt: skip
        with pytest.raises(ConfigError, match="EgKvTier"):
            tier_settings_from({"url": "http://127.0.0.1:9", **bad}, env={})
    env = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN": "t0k3n", "EPISTEMIC_GRAPH_KVCACHE_URL": "http://h:1"}
    from_env = tier_settings_from({}, env=env)
    assert from_env.client.token == "t0k3n"  # the token from the usual environment
    assert "t0k3n" not in repr(from_env)


def _wait_answers(lookups: StepLookups, keys: list[int], req: str, limit: float = 10) -> list:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        answers = [lookups.lookup(k, req) for k in keys]
        lookups.flush()
        if None not in answers:
            return answers
        time.sleep(0.002)
    raise AssertionError("no answer in time")


def test_a_step_is_one_probe_and_hits_come_back(client):
    for i in range(3):
        assert client.put(_address(i), b"x" * 10)
    probes: list[int] = []

    def probe(addresses: list[str]) -> list[bool] | None:
        probes.append(len(addresses))
        return client.try_exists_addresses(addresses)

    lookups = StepLookups(probe, _address, deadline_s=5.0)
    try:
        keys = list(range(6))
        assert [lookups.lookup(k, "r") for k in keys] == [None] * 6  # RETRY until flushed
        assert [lookups.lookup(k, "r2") for k in keys[:2]] == [None] * 2  # same probe
        assert _wait_answers(lookups, keys, "r") == [True] * 3 + [False] * 3
        assert probes == [6]  # one probe for the step's keys, whoever asked
        assert lookups.leased == {_address(i) for i in range(3)}
        assert lookups.consume([_address(0), _address(0), _address(5)]) == [_address(0)]
        assert lookups.consume([_address(0)]) == []  # its lease was handed on once
        lookups.mark_miss([1])
        assert lookups.lookup(1, "r") is False
        # r leaves 2 a hit never loaded: its lease is released; r2 still refers to 0, 1.
        assert lookups.cleanup("r") == [_address(2)]
        assert len(lookups) == 2
        assert lookups.cleanup("r2") == []  # 0 was loaded, 1 failed its load
        assert len(lookups) == 0 and lookups.leased == set()
    finally:
        lookups.close()


def test_unloaded_hits_are_returned_for_release_and_old_hits_are_asked_again(client):
    assert client.put(_address(7), b"y")
    now = [100.0]
    lookups = StepLookups(client.try_exists_addresses, _address, deadline_s=5.0, max_age_s=1.0,
                          clock=lambda: now[0])  # fmt: skip
    try:
        t0 = time.monotonic()
        while lookups.lookup(7, "a") is None and time.monotonic() - t0 < 10:
            lookups.flush()
            time.sleep(0.002)
        assert lookups.lookup(7, "a") is True
        now[0] += 2.0  # older than max_age_s: its lease may be gone
        assert lookups.lookup(7, "a") is None and lookups.counters["refreshed"] == 1
        assert _wait_answers(lookups, [7], "a") == [True]
        assert lookups.cleanup("a") == [_address(7)]  # never loaded: release its lease
    finally:
        lookups.close()


def _lease_counts(c) -> tuple[int, int]:
    extra = c.stats().extra
    return extra.get("leases_taken", 0), extra.get("leases_released", 0)


def test_every_lease_a_probe_takes_is_loaded_or_released(client):
    """Two ways a lease was lost (held until ``lease_ms``, pinning the block): a request
    that finished while its probe was in flight (the late hit was forgotten), and a hit
    asked again for its age (the refresh's second lease replaced the first)."""
    for i in range(2):
        assert client.put(_address(i), b"z" * 10)
    gate = threading.Event()

    def probe(addresses: list[str]) -> list[bool] | None:
        gate.wait(10)
        return client.try_exists_addresses(addresses, lease_ms=60_000)

    now = [100.0]
    lookups = StepLookups(probe, _address, deadline_s=30.0, max_age_s=1.0,
                          clock=lambda: now[0])  # fmt: skip
    try:
        taken0, released0 = _lease_counts(client)
        assert lookups.lookup(0, "gone") is None
        lookups.flush()  # the probe is in flight (held at the gate)
        assert lookups.cleanup("gone") == []  # its verdict is not in yet
        gate.set()
        wait_for(lambda: lookups.take_unused() == [_address(0)], timeout=10,
                 what="the late hit's lease handed over for release")  # fmt: skip
        assert _wait_answers(lookups, [1], "waits") == [True]
        now[0] += 2.0  # older than max_age_s: asked again, with a lease of its own
        assert _wait_answers(lookups, [1], "waits") == [True]
        assert lookups.take_unused() == [_address(1)]  # the first lease, to end
        to_end = [_address(0), _address(1), *lookups.consume([_address(1)])]
        assert client.release(to_end) == 3
        taken, released = _lease_counts(client)
        assert (taken - taken0, released - released0) == (3, 3)
    finally:
        gate.set()
        lookups.close()


def test_a_silent_server_or_a_backlog_costs_misses_in_bounded_time():
    with RawServer("silent") as raw:
        c = connect(KvCacheConfig.from_env({}, base_url=raw.url, timeout_s=30.0))
        lookups = StepLookups(c.try_exists_addresses, _address, deadline_s=0.5, max_batches=2)
        try:
            t0 = time.monotonic()
            longest = 0.0
            first: list = []
            for step in range(3):  # three steps, three batches: the third is shed
                s = time.monotonic()
                first.append(lookups.lookup(step, "r"))
                lookups.flush()
                longest = max(longest, time.monotonic() - s)
            assert first == [None, None, None]
            assert lookups.lookup(2, "r") is False and lookups.counters["shed"] == 1
            # Each batch's deadline runs from its own flush, a few ms apart: wait for both
            # (waiting for the first alone saw the second still pending, once in CI).
            while lookups.lookup(0, "r") is None or lookups.lookup(1, "r") is None:
                assert time.monotonic() - t0 < 3
                s = time.monotonic()
                lookups.flush()
                longest = max(longest, time.monotonic() - s)
                time.sleep(0.01)
            assert lookups.lookup(0, "r") is False and lookups.lookup(1, "r") is False
            assert lookups.counters["expired"] == 2
            assert 0.4 < time.monotonic() - t0 < 3 and longest < 0.1
        finally:
            lookups.close()
            c.close()


def _view(rows: int) -> memoryview:
    return memoryview(bytearray(rows * ROW)).cast("B", (rows, ROW))


def _wait_finished(copies: CopyJobs, n: int) -> list:
    done: list = []
    t0 = time.monotonic()
    while len(done) < n and time.monotonic() - t0 < 20:
        done += copies.finished()
        time.sleep(0.005)
    return done


def test_copies_round_trip_and_refuse_what_was_not_stored(client):
    src = _view(4)
    flat = src.cast("B")
    for r in range(4):
        flat[r * ROW : (r + 1) * ROW] = os.urandom(ROW)
    stores = CopyJobs(client, src, ROW, threads=3)
    stores.submit(1, False, [_address(100 + r) for r in range(4)], [0, 1, 2, 3])
    (stored,) = _wait_finished(stores, 1)
    assert stored.ok == [True] * 4 and not stored.is_load and stored.nbytes == 4 * ROW
    # Block 104: the right length, other bytes; 105: one byte short; 106: absent.
    forged = bytes(flat[0:ROW])
    assert client.put(_address(104), forged + trailer(_address(999), forged))
    assert client.put(_address(105), forged + trailer(_address(105), forged)[:-1])
    dst = _view(7)
    loads = CopyJobs(client, dst, ROW, threads=3)
    loads.submit(2, True, [_address(100 + r) for r in range(7)], [6, 5, 4, 3, 2, 1, 0])
    (loaded,) = _wait_finished(loads, 1)
    assert loaded.ok == [True] * 4 + [False] * 3
    out = dst.cast("B")
    for r in range(4):
        assert out[(6 - r) * ROW : (7 - r) * ROW] == flat[r * ROW : (r + 1) * ROW]
    assert loads.running == 0 and loads.drain(0)
    stores.close()
    loads.close()
    assert TRAILER == 16


@pytest.mark.slow
def test_stores_ask_100_continue_and_drain_waits_for_copies():
    with RawServer("continue100") as raw, RawServer("silent") as silent:
        c = connect(KvCacheConfig.from_env({}, base_url=raw.url, timeout_s=5.0))
        copies = CopyJobs(c, _view(1), ROW)
        copies.submit(1, False, [_address(1)], [0])
        (job,) = _wait_finished(copies, 1)
        assert job.ok == [True]
        assert b"expect: 100-continue" in raw.heads[-1].lower()
        copies.close()
        c.close()
        slow = connect(KvCacheConfig.from_env({}, base_url=silent.url, timeout_s=1.0))
        copies = CopyJobs(slow, _view(2), ROW)
        copies.submit(3, True, [_address(1), _address(2)], [0, 1])
        assert copies.running == 1 and not copies.drain(0.1)  # still copying
        t0 = time.monotonic()
        waiter = threading.Thread(target=copies.drain)
        waiter.start()
        waiter.join(5)
        assert not waiter.is_alive() and 0.5 < time.monotonic() - t0 < 3  # the timeout
        assert [j.ok for j in copies.finished()] == [[False, False]]
        copies.close()
        slow.close()


@pytest.mark.slow
def test_a_load_cut_behind_a_queue_of_copies_hands_its_slots_back_at_once():
    """A load past its deadline whose copies have not begun is settled when it is cut: its
    slots do not wait for the copies queued ahead of it (before, they came back only when
    the stores ahead had timed out and a thread reached the load's copy to skip it)."""
    with RawServer("silent") as silent:
        slow = connect(KvCacheConfig.from_env({}, base_url=silent.url, timeout_s=1.0))
        copies = CopyJobs(slow, _view(3), ROW, threads=1)
        copies.submit(1, False, [_address(1), _address(2)], [0, 1])  # 2 x 1 s on 1 thread
        copies.submit(2, True, [_address(3)], [2])  # queued behind them
        (cut,) = copies.overdue(0)
        assert (cut.job_id, cut.ok) == (2, [False]) and cut.released is not None
        assert cut.released.wait(0.5), "the cut load's slot waited for the queue"
        assert copies.overdue(0) == []  # reported once; stores are never cut
        (stores,) = _wait_finished(copies, 1)
        assert (stores.job_id, stores.ok) == (1, [False, False])
        assert copies.drain(5) and copies.finished() == []
        assert len(silent.heads) == 2  # the load's GET was never sent
        copies.close()
        slow.close()


def test_a_block_stored_while_a_snapshot_is_in_flight_is_not_reported_removed(server_factory):
    """The removal relay's first snapshot is taken by the server before the tier stores a
    block, and its answer arrives after the tier watched that block: its absence from the
    snapshot says nothing (on e19d5d6 the relay reported it removed, and CI's test_tier saw
    4 removals where 2 blocks were deleted). Deleted afterwards, it is reported once, from
    the log's event."""
    from eg_kv.client.sync import ServerConnector
    from eg_kv.vllm.tier_events import RemovalRelay

    srv = server_factory(workers=1, capacity="4MiB")
    taken, release = threading.Event(), threading.Event()

    class LateSnapshot(ServerConnector):  # a real client whose first answer comes late
        def snapshot(self, *a, **kw):
            snap = super().snapshot(*a, **kw)
            if not taken.is_set():
                taken.set()
                release.wait(20)
            return snap

    relay = RemovalRelay(lambda: LateSnapshot(base_url=srv.url, timeout_s=5), wait_s=0.5)
    writer = connect(KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0))
    try:
        assert taken.wait(20)  # the server took the snapshot: the block is not in it
        assert writer.put(_address(1), b"stored after the snapshot")
        relay.watch(_address(1), "key-1")
        release.set()
        assert relay.following.wait(20)
        assert relay.take() == []
        assert writer.delete(_address(1))
        deadline = time.monotonic() + 20
        got: list = []
        while not got and time.monotonic() < deadline:
            got = relay.take()
            time.sleep(0.02)
        assert got == ["key-1"]
    finally:
        release.set()
        writer.close()
        relay.close(10)
