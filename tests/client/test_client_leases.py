"""Leases from the clients' side against real servers: a set's members each lease their
part of a batch and release what they leased; the vLLM connector's leases are released by
the scheduler's client that took them, not by the loads (eg_kv.vllm.scheduler_leases and
eg_kv.vllm.staging.load_rows, no engine); a server without
leases (--lease-ms 0) still answers every lookup; the connector's lease_ms setting."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.connectors import connect
from eg_kv.client.sets import SetConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.errors import ConfigError
from eg_kv.vllm.scheduler_leases import SchedulerLeases
from eg_kv.vllm.settings import settings_from
from eg_kv.vllm.staging import load_rows
from eg_kv.vllm.trailers import address_tag

pytestmark = pytest.mark.timeout(120)
ROW = 8 * 1024


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def leases(url: str) -> tuple[int, int, int]:
    st = stats(url)
    return st["leases_taken"], st["leases_released"], st["leased_blocks"]


@pytest.fixture
def pair(server_factory):
    """Two servers, the members of one set."""
    return [server_factory(workers=1, capacity="8MiB") for _ in range(2)]


def test_a_set_leases_each_members_part_and_releases_it_there(pair):
    base = ",".join(s.url for s in pair)
    keys = [f"set-lease-{k}" for k in range(40)]
    with SetConnector(KvCacheConfig(base_url=base)) as kv:
        assert all(kv.put(k, bytes(ROW)) for k in keys)
        assert kv.exists_many([*keys, "absent"], lease_ms=5000) == [True] * 40 + [False]
        per_member = [leases(s.url) for s in pair]
        assert sum(t for t, _r, _h in per_member) == 40
        assert all(t > 0 for t, _r, _h in per_member)  # both members took part
        assert kv.get(keys[0], release_lease=True) == bytes(ROW)
        assert kv.release(keys[1:]) == 39
        assert [leases(s.url)[2] for s in pair] == [0, 0]
        # contains_prefix leases the prefix and gives back what lies past it
        assert kv.delete(keys[10])
        assert kv.contains_prefix(keys, lease_ms=5000) == 10
        assert sum(leases(s.url)[2] for s in pair) == 10


def test_a_sets_release_goes_to_the_member_that_granted_the_lease(pair):
    """A lease a stand-in granted (the home was down at the lookup) is released there once
    the home is up again: at the home, the release ended another engine's lease on the
    same block (same token) and left the set's own held (eg_kv.client.lease_homes)."""
    a, b = pair
    a_id = f"127.0.0.1:{a.port}"
    remote = {"local_reads": False}
    with SetConnector(KvCacheConfig(base_url=f"{a.url},{b.url}")) as kv, \
            connect(KvCacheConfig(base_url=a.url, **remote)) as at_a, \
            connect(KvCacheConfig(base_url=b.url, **remote)) as at_b:  # fmt: skip
        key = next(k for k in (f"granted-{i}" for i in range(200)) if kv.router.home(k)[1] == a_id)
        assert at_a.put(key, bytes(ROW)) and at_b.put(key, bytes(ROW))
        assert at_a.exists_many([key], lease_ms=60_000) == [True]  # another engine's, at a
        kv.router.health.failed(a_id)  # a is down for its back-off (1 s): b stands in
        assert kv.exists_many([key], lease_ms=60_000) == [True]
        assert leases(b.url)[2] == 1
        kv.router.health.succeeded(a_id)
        assert kv.router.home(key)[1] == a_id  # the home is a again
        assert kv.release([key]) == 1
        assert leases(b.url)[2] == 0  # the set's lease ended where it was granted
        assert at_a.release([key]) == 1  # the other engine's lease was still held


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_sets_get_that_releases_ends_the_lease_where_it_was_granted(pair, side):
    """``get(key, release_lease=True)`` on a set: the GET's header ended a lease at each
    member asked, the home's (another engine's) when the stand-in granted the set's."""
    a, b = pair
    a_id = f"127.0.0.1:{a.port}"
    remote = {"local_reads": False}
    config = KvCacheConfig(base_url=f"{a.url},{b.url}", **remote)
    at_a = connect(KvCacheConfig(base_url=a.url, **remote))
    at_b = connect(KvCacheConfig(base_url=b.url, **remote))

    def homed_at_a(router) -> str:
        """A key whose home is a, stored at both, leased at a by another engine; then a
        is down for its back-off (b stands in)."""
        key = next(k for k in (f"got-{side}-{i}" for i in range(200))
                   if router.home(k)[1] == a_id)  # fmt: skip
        assert at_a.put(key, bytes(ROW)) and at_b.put(key, bytes(ROW))
        assert at_a.exists_many([key], lease_ms=60_000) == [True]
        router.health.failed(a_id)
        return key

    async def run_async() -> None:
        async with AsyncSetConnector(config) as kv:
            await kv.exists_many([])  # started: its router is up
            key = homed_at_a(kv.router)
            assert await kv.try_exists_many([key], lease_ms=60_000) == [True]
            kv.router.health.succeeded(a_id)
            assert await kv.get(key, release_lease=True) == bytes(ROW)

    try:
        if side == "sync":
            with SetConnector(config) as kv:
                key = homed_at_a(kv.router)
                assert kv.exists_many([key], lease_ms=60_000) == [True]
                kv.router.health.succeeded(a_id)
                assert kv.get(key, release_lease=True) == bytes(ROW)
        else:
            asyncio.run(run_async())
        assert leases(b.url)[2] == 0  # the set's lease ended where it was granted
        assert leases(a.url)[2] == 1  # the other engine's is still held
    finally:
        at_a.close()
        at_b.close()


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_sets_delete_releases_its_reference_where_its_put_stored_it(pair, side):
    """While the home was down the set's PUT went to the stand-in; once the home is up,
    its DELETE went to the home: it ended a reference another client took there (which
    the home could then free) and left the set's own at the stand-in."""
    a, b = pair
    a_id = f"127.0.0.1:{a.port}"
    config = KvCacheConfig(base_url=f"{a.url},{b.url}", local_reads=False)
    at_a = connect(KvCacheConfig(base_url=a.url, local_reads=False))

    def refs() -> tuple[int, int]:
        return stats(a.url)["total_refs"], stats(b.url)["total_refs"]

    def homed_at_a(router) -> str:
        key = next(k for k in (f"del-{side}-{i}" for i in range(200))
                   if router.home(k)[1] == a_id)  # fmt: skip
        assert at_a.put(key, bytes(ROW))  # another client's reference, at the home
        router.health.failed(a_id)  # b stands in for its back-off
        return key

    async def run_async() -> None:
        async with AsyncSetConnector(config) as kv:
            await kv.exists_many([])  # started
            key = homed_at_a(kv.router)
            assert await kv.put(key, bytes(ROW))
            kv.router.health.succeeded(a_id)
            assert refs() == (1, 1)
            assert await kv.delete(key)

    try:
        if side == "sync":
            with SetConnector(config) as kv:
                key = homed_at_a(kv.router)
                assert kv.put(key, bytes(ROW))
                kv.router.health.succeeded(a_id)
                assert refs() == (1, 1)
                assert kv.delete(key)
        else:
            asyncio.run(run_async())
        assert refs() == (1, 0)  # the set's reference went; the other client's stays
    finally:
        at_a.close()


def test_the_async_set_leases_and_releases_alike(pair):
    base = ",".join(s.url for s in pair)
    keys = [f"aset-lease-{k}" for k in range(20)]

    async def run() -> None:
        async with AsyncSetConnector(KvCacheConfig(base_url=base)) as kv:
            for k in keys:
                assert await kv.put(k, bytes(ROW))
            assert await kv.try_exists_many(keys, lease_ms=5000) == [True] * 20
            assert await kv.get(keys[0], release_lease=True) == bytes(ROW)
            assert await kv.release(keys[1:]) == 19

    asyncio.run(run())
    assert sum(leases(s.url)[0] for s in pair) == 20
    assert [leases(s.url)[2] for s in pair] == [0, 0]


def test_the_connectors_leases_are_released_by_the_client_that_took_them(server_factory):
    """The vLLM connector's scheduler leases its lookup's hits (on the server's host, in its
    own lease table); a worker's load (another client) releases nothing; the scheduler's
    client releases them once the step that loaded them is over. Another engine's leases
    on the same blocks, under the same token, stay: a worker's release found no record of
    the scheduler's lease and went to the server, which ended one of those."""
    srv = server_factory(workers=1, capacity="8MiB")
    cfg = KvCacheConfig.from_env({}, base_url=srv.url, timeout_s=5.0)
    scheduler, worker = connect(cfg), connect(cfg)
    other = connect(KvCacheConfig.from_env({}, base_url=srv.url, local_reads=False))
    book = SchedulerLeases(scheduler.release, lag=1)
    try:
        addrs = [f"egv-lease-{k}" for k in range(6)]
        for a in addrs[:5]:
            assert worker.put(a, bytes(ROW) + address_tag(a))  # as the connector stores it
        assert other.exists_many(addrs, lease_ms=60_000) == [True] * 5 + [False]
        prefix = scheduler.contains_prefix(addrs, lease_ms=5000)
        assert prefix == 5
        book.looked_up("r", addrs[:prefix])
        book.step()
        book.planned("r")  # the step being built loads them
        rows = [bytearray(ROW) for _ in addrs]
        with ThreadPoolExecutor(4) as pool:
            ok, failed = load_rows(worker, addrs, rows, map_fn=pool.map)
        assert (ok, failed) == ([0, 1, 2, 3, 4], [5])
        assert book.drain(5.0) and book.stats() == {
            "released": 0, "release_batches": 0, "release_dropped": 0, "held": 5}  # fmt: skip
        book.step()  # the step that loaded them is over
        assert book.drain(5.0) and book.counters["released"] == 5
        assert other.release(addrs[:5]) == 5  # every one of the other engine's leases held
        assert leases(srv.url)[2] == 0
    finally:
        book.close()
        for c in (scheduler, worker, other):
            c.close()


def test_a_server_with_leases_off_answers_leasing_lookups_without_them(server_factory):
    srv = server_factory(workers=1, capacity="8MiB", extra=("--lease-ms", "0"))
    with connect(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.put("k", b"v")
        assert kv.exists_many(["k", "x"], lease_ms=5000) == [True, False]
        assert kv.get("k", release_lease=True) == b"v"
        assert kv.release(["k"]) == 0
    assert leases(srv.url) == (0, 0, 0)


def test_the_connectors_lease_setting():
    assert settings_from({"url": "http://127.0.0.1:9"}, env={}).lease_ms == 5000
    assert settings_from({"url": "http://127.0.0.1:9", "lease_ms": 0}, env={}).lease_ms == 0
    with pytest.raises(ConfigError, match="lease_ms must be at least 0"):
        settings_from({"url": "http://127.0.0.1:9", "lease_ms": -1}, env={})
    with pytest.raises(ConfigError, match="io_threads must be at least 1"):
        settings_from({"url": "http://127.0.0.1:9", "io_threads": 0}, env={})


def test_a_leasing_lookup_on_the_hosts_slab_sends_no_request(server_factory):
    """On the server's host a leasing lookup reads the slab and leases its hits in the
    reader's own lease table (eg_kv.slab.local_leases): no batch request, hit or miss, sync
    and async; the server counts the lease, and the load releases it without a request
    either. Requests are counted in order, so the marker request (a lookup over HTTP)
    showing in /metrics means any earlier one would have."""
    import re

    from helpers.common import wait_for

    from eg_kv.client.aio import AsyncServerConnector

    srv = server_factory(workers=1, capacity="8MiB")

    def requests(route: str) -> int:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        method = r'method="(?:POST|GET)"'
        pattern = rf'eg_kv_requests_total{{{method},route="{route}",status="200"}} (\S+)'
        return int(sum(float(v) for v in re.findall(pattern, text)))

    with connect(KvCacheConfig(base_url=srv.url)) as kv:
        assert kv.put("held", bytes(ROW))
        assert kv.exists_many(["absent-1", "absent-2"], lease_ms=5000) == [False, False]
        assert kv.exists_many(["held", "absent-1"], lease_ms=5000) == [True, False]

        async def aio_lookup() -> list[bool]:
            async with AsyncServerConnector(KvCacheConfig(base_url=srv.url)) as akv:
                found = await akv.exists_many(["held", "absent-3"], lease_ms=5000)
                assert await akv.get("held", release_lease=True) == bytes(ROW)
                return found

        assert asyncio.run(aio_lookup()) == [True, False]
        assert leases(srv.url) == (2, 1, 1)  # the sync lookup's lease is still held
        assert kv.get("held", release_lease=True) == bytes(ROW)
        assert leases(srv.url) == (2, 2, 0)
        with connect(KvCacheConfig(base_url=srv.url, local_reads=False)) as remote:
            assert remote.exists_many(["held"]) == [True]  # the marker
        wait_for(lambda: requests("batch_exists") >= 1, what="the marker request counted")
        assert requests("batch_exists") == 1
        assert requests("batch_release") == 0
        assert requests("block") == 0  # both loads read the slab


def test_the_sets_notes_of_granting_members_are_bounded():
    from eg_kv.client.lease_homes import MAX_PER_ADDRESS, LeaseHomes

    homes = LeaseHomes(max_noted=3)
    homes.granted([("a", "m1"), ("a", "m2"), ("b", "m1"), ("c", "m2"), ("d", "m1")])
    assert len(homes) == 3 and homes.take(["a"]) == [None]  # the oldest address forgotten
    assert homes.take(["b", "b", "x"]) == ["m1", None, None]  # one note per lease
    homes.granted([("e", f"m{i}") for i in range(MAX_PER_ADDRESS + 5)])
    assert homes.take(["e", "e"]) == ["m5", "m6"]  # the oldest of one address forgotten
