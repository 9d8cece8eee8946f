"""Regression tests of a review of the set clients and the L2 adapter: real servers on
loopback, a real DNS server for membership changes, raw sockets for misbehaving members."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers.common import wait_for
from helpers.dns_zone import pod
from helpers.kvcache import RawServer
from helpers.server_sets import SRV_NAME, set_url, start_set

from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.client.sets import ClusterConnector
from eg_kv.client.settings import KvCacheConfig
from eg_kv.kvcache import RemoteKVL2Connector
from eg_kv.lmcache.write_gate import WriteGate

#: The refresh period (and previous-home window) of the sets whose membership changes:
#: long enough that a step taken right after the change lands inside the window.
REFRESH_S = 3.0


def wait_done(conn: RemoteKVL2Connector, fid: int) -> tuple:
    """The completion of future ``fid`` (bounded)."""
    found: list[tuple] = []

    def done() -> bool:
        found.extend(d for d in conn.drain_completions() if d[0] == fid)
        return bool(found)

    wait_for(done, timeout=20, what=f"completion {fid}")
    return found[0]


def dns_set(zone, dns_port: int, ports: list[int], **settings) -> KvCacheConfig:
    """Point the SRV entry at ``ports`` and return a config of the set it names."""
    zone.set(
        srv={SRV_NAME: [(0, 1, port, pod(i)) for i, port in enumerate(ports)]},
        a={pod(i): ["127.0.0.1"] for i in range(len(ports))},
    )
    return KvCacheConfig(
        base_url=f"dnssrv+http://{SRV_NAME}", refresh_s=REFRESH_S,
        dns_server=f"127.0.0.1:{dns_port}", **settings,
    )  # fmt: skip


def grow(zone, kv, ports: list[int]) -> None:
    """Add members (the SRV entry names ``ports``) and wait until the client sees them."""
    zone.set(
        srv={SRV_NAME: [(0, 1, port, pod(i)) for i, port in enumerate(ports)]},
        a={pod(i): ["127.0.0.1"] for i in range(len(ports))},
    )
    wait_for(lambda: len(kv.router.view().members) == len(ports), timeout=20, what="the change")


def member_id(kv, port: int) -> str:
    """The set's id of the member at ``port``."""
    return next(m for m, member in kv.router.view().members.items() if member.port == port)


def in_window(kv) -> bool:
    view = kv.router.view()
    return view.previous is not None and time.monotonic() - view.changed_at < view.window_s


# -- 1: an L2 delete releases only a reference this connector took


def test_l2_delete_after_a_restart_never_releases_another_servers_chunk(server_factory):
    srv = server_factory(workers=1, capacity="16MiB")
    key = "m@0@0@abc/def"
    a = RemoteKVL2Connector(base_url=srv.url, timeout_s=5)
    b = RemoteKVL2Connector(base_url=srv.url, timeout_s=5)
    try:
        assert wait_done(a, a.submit_batch_set([key], [memoryview(b"A" * 100)]))[3] == [True]
        # B's layout differs: 409 at the plain address, stored under the sized one.
        assert wait_done(b, b.submit_batch_set([key], [memoryview(b"B" * 200)]))[3] == [True]
        b.close()
        b2 = RemoteKVL2Connector(base_url=srv.url, timeout_s=5)  # B's process restarted
        try:
            # No record of the key: nothing is sent, False reported.
            assert wait_done(b2, b2.submit_batch_delete([key]))[3] == [False]
        finally:
            b2.close()
        buf = bytearray(100)
        assert wait_done(a, a.submit_batch_get([key], [memoryview(buf)]))[3] == [True]
        assert bytes(buf) == b"A" * 100  # A's chunk survived B's restarted delete
        with RemoteKVConnector(base_url=srv.url) as kv:
            assert kv.exists(a.addresses.address(key)) and kv.exists(a.addresses.sized(key, 200))
        # A delete of a key this connector stored releases its own reference.
        assert wait_done(a, a.submit_batch_delete([key]))[3] == [True]
        with RemoteKVConnector(base_url=srv.url) as kv:
            assert not kv.exists(a.addresses.address(key))
            assert kv.exists(a.addresses.sized(key, 200))  # B's copy is untouched
    finally:
        a.close()


# -- 2: waiting for the client's own pool is not the member being unreachable


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_full_connection_pool_does_not_mark_a_live_member_down(server_factory):
    servers = start_set(server_factory, n=2)
    # Over HTTP: a local read would take no connection from the pool.
    config = KvCacheConfig(
        base_url=set_url(servers), max_connections=1, timeout_s=1.0, local_reads=False
    )
    with ClusterConnector(config) as kv:
        member = kv.router.home("held")[1]
        other = next(f"other{i}" for i in range(200) if kv.router.home(f"other{i}")[1] == member)
        assert kv.put("held", b"h" * 64)
        holding, release = threading.Event(), threading.Event()
        got: list = []

        def slow_sink(length, read_exact):
            buf = bytearray(length)
            read_exact(memoryview(buf))
            holding.set()
            release.wait(20)  # the connection stays taken meanwhile
            return bytes(buf)

        t = threading.Thread(target=lambda: got.append(kv.fetch("held", slow_sink)))
        t.start()
        try:
            assert holding.wait(20)
            start = time.monotonic()
            assert kv.exists(other) is False  # no free connection within timeout_s
            assert time.monotonic() - start >= 0.9
            assert member not in kv.router.down(), "a busy client marked a live member down"
        finally:
            release.set()
            t.join(20)
        assert got == [b"h" * 64]
        assert kv.get("held") == b"h" * 64


# -- 3: the async set closes the connectors of members that left


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_the_async_set_closes_the_session_of_a_member_that_left(server_factory, dns_server):
    zone, dns_port = dns_server
    servers = start_set(server_factory, n=2)
    config = dns_set(zone, dns_port, [s.port for s in servers], timeout_s=5)

    async def run() -> None:
        kv = AsyncRemoteKVConnector(config)
        try:
            assert len(kv.router.view().members) == 2
            keys = [f"a{i}" for i in range(40)]
            for k in keys:
                assert await kv.put(k, b"x")  # both members get a session
            conns = dict(kv._members._conns)
            assert len(conns) == 2
            sessions = {c.config.base_url.rstrip("/"): c._http.session for c in conns.values()}
            assert all(s is not None and not s.closed for s in sessions.values())
            zone.set(srv={SRV_NAME: [(0, 1, servers[0].port, pod(0))]})
            left = sessions[servers[1].url]
            deadline = time.monotonic() + 30
            while not left.closed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(kv.router.view().members) == 1
            assert left.closed, "the departed member's aiohttp session was left open"
            assert not sessions[servers[0].url].closed
            assert await kv.exists_many(keys[:1]) is not None
        finally:
            await kv.close()

    asyncio.run(run())


# -- 4 and 6: the previous-home ask after a membership change


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_an_l2_load_asks_the_previous_home_only_within_its_deadline(server_factory, dns_server):
    zone, dns_port = dns_server
    old, new = start_set(server_factory, n=2)
    timeout_s = 2.0
    config = dns_set(zone, dns_port, [old.port], timeout_s=timeout_s)
    l2 = RemoteKVL2Connector(config)
    try:
        keys = [f"m@0@0@load{i}/x" for i in range(40)]
        with RemoteKVConnector(base_url=old.url) as direct:
            for k in keys:
                assert direct.put(l2.addresses.address(k), b"L" * 256)
        grow(zone, l2._client, [old.port, new.port])
        new_id = member_id(l2._client, new.port)
        moved = [k for k in keys if l2._client.router.home(l2.addresses.address(k))[1] == new_id]
        assert moved, "some keys moved to the new member"
        buf = bytearray(256)
        # Half a timeout left before the batch's deadline: the previous home (a request
        # of up to timeout_s) is not asked.
        short = WriteGate(time.monotonic() + timeout_s / 2)
        assert in_window(l2._client)
        assert l2._load(moved[0], buf, short) is False
        assert bytes(buf) == bytes(256)
        # With room before the deadline it is asked (and the load hits).
        assert in_window(l2._client)
        assert l2._load(moved[1], buf, WriteGate()) is True and bytes(buf) == b"L" * 256
    finally:
        l2.close()


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_delete_whose_answer_was_lost_is_not_sent_on(server_factory, dns_server):
    zone, dns_port = dns_server
    old = server_factory(workers=1, capacity="16MiB")
    with RawServer("dropwrite") as dropper:  # applies a DELETE, then drops the connection
        config = dns_set(zone, dns_port, [old.port], timeout_s=2)
        with ClusterConnector(config) as kv, RemoteKVConnector(base_url=old.url) as other:
            keys = [f"del{i}" for i in range(40)]
            for k in keys:  # another client's (the set's own DELETEs go where its PUT went)
                assert other.put(k, b"d")
            grow(zone, kv, [old.port, dropper.port])
            dropper_id = member_id(kv, dropper.port)
            moved = [k for k in keys if kv.router.home(k)[1] == dropper_id]
            assert moved, "some keys moved to the new member"
            assert in_window(kv)
            assert kv.delete(moved[0]) is False  # the answer was lost
            assert dropper.applied == 1
            with RemoteKVConnector(base_url=old.url) as direct:
                assert direct.exists(moved[0]), "a lost DELETE was sent to the previous home"


@pytest.mark.slow
def test_a_delete_absent_at_the_home_goes_to_the_previous_home(server_factory, dns_server):
    zone, dns_port = dns_server
    old, new = start_set(server_factory, n=2)
    config = dns_set(zone, dns_port, [old.port], timeout_s=5)
    with ClusterConnector(config) as kv, RemoteKVConnector(base_url=old.url) as other:
        keys = [f"gone{i}" for i in range(40)]
        for k in keys:  # another client's (the set's own DELETEs go where its PUT went)
            assert other.put(k, b"g")
        grow(zone, kv, [old.port, new.port])
        new_id = member_id(kv, new.port)
        moved = [k for k in keys if kv.router.home(k)[1] == new_id]
        assert moved and in_window(kv)
        assert kv.delete(moved[0]) is True  # 404 at the new home, 204 at the previous one
        with RemoteKVConnector(base_url=old.url) as direct:
            assert not direct.exists(moved[0])


# -- 5: close() while lookups run


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_lookups_while_the_set_closes_return_misses_never_raise(server_factory):
    servers = start_set(server_factory, n=3)
    kv = ClusterConnector(KvCacheConfig(base_url=set_url(servers), timeout_s=5))
    keys = [f"c{i}" for i in range(60)]
    assert all(kv.put(k, b"c") for k in keys)
    assert all(kv.exists_many(keys))
    assert len(kv.router.plan(keys)[1]) == 3, "a lookup fans out to every member"
    # Every fan-out thread busy: the next lookup's groups wait in the pool's queue, so
    # close() cancels them.
    hold = threading.Event()
    busy = [kv._fanout.submit(hold.wait, 20) for _ in range(64)]
    results: list = []
    errors: list = []

    def lookup() -> None:
        try:
            results.append(kv.exists_many(keys))
        except BaseException as e:  # what the test is about
            errors.append(e)

    threads = [threading.Thread(target=lookup) for _ in range(4)]
    for t in threads:
        t.start()
    # 64 - 16 running blockers queued, and every group of each lookup (a batch over
    # several members sends all its groups through the pool).
    wait_for(lambda: kv._fanout._work_queue.qsize() == 64 - 16 + 3 * 4, timeout=20,
             what="the lookups' groups queued")  # fmt: skip
    kv.close()
    hold.set()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert results == [[False] * len(keys)] * 4
    del busy
