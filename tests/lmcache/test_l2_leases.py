"""The LMCache L2 adapter's lookup-and-lock leases its hits on a real server, and each load
releases one: a slab full of locked chunks keeps them until loaded (a put meanwhile gets
507), then takes new ones; ``lease_ms`` 0 turns it off; a bad one is refused."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from helpers.kvcache import lm_keys, wait_completions

from eg_kv.errors import ConfigError
from eg_kv.kvcache import RemoteKVL2Connector

pytestmark = pytest.mark.timeout(120)
CHUNK = 64 * 1024


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/kv/stats", timeout=10) as r:
        return json.loads(r.read())


def put_status(url: str, address: str) -> int:
    req = urllib.request.Request(f"{url}/kv/{address}", data=bytes(CHUNK), method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("local_reads", [False, True])
def test_lookup_and_lock_leases_and_the_load_releases(server_factory, local_reads):
    # 16 pages of 64 KiB: the 16 chunks fill the slab, all of which leases may hold.
    srv = server_factory(
        workers=1, capacity="1MiB", extra=("--page-size", "64KiB", "--lease-share", "1")
    )
    conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, local_reads=local_reads)
    try:
        keys = lm_keys(16)
        blocks = [bytearray(os.urandom(CHUNK)) for _ in keys]
        f = conn.submit_batch_set(keys, [memoryview(b) for b in blocks])
        assert wait_completions(conn, {f})[f][1] is True
        f = conn.submit_batch_exists([*keys, *lm_keys(1, start=99)])
        assert wait_completions(conn, {f})[f][3] == [True] * 16 + [False]
        st = stats(srv.url)
        assert (st["leases_taken"], st["leased_blocks"]) == (16, 16)
        # Locked: a put from elsewhere finds only leased chunks to evict.
        assert put_status(srv.url, "elsewhere") == 507
        bufs = [bytearray(CHUNK) for _ in keys]
        f = conn.submit_batch_get(keys[:4], [memoryview(b) for b in bufs[:4]])
        assert wait_completions(conn, {f})[f][3] == [True] * 4
        assert bufs[:4] == blocks[:4]
        st = stats(srv.url)
        assert (st["leases_released"], st["leased_blocks"]) == (4, 12)
        assert put_status(srv.url, "elsewhere") == 201  # a loaded chunk may go now
        # Two lookups lease twice: a load ends one, the next load the other.
        f = conn.submit_batch_exists(keys[4:6])
        assert wait_completions(conn, {f})[f][3] == [True, True]
        for loaded, released, leased in ((keys[4:8], 8, 10), (keys[4:6], 10, 8)):
            f = conn.submit_batch_get(loaded, [memoryview(bytearray(CHUNK)) for _ in loaded])
            assert wait_completions(conn, {f})[f][3] == [True] * len(loaded)
            st = stats(srv.url)
            assert (st["leases_released"], st["leased_blocks"]) == (released, leased)
    finally:
        conn.close()


def test_lease_ms_0_takes_no_lease_and_a_bad_one_is_refused(server_factory):
    srv = server_factory(workers=1, capacity="8MiB")
    conn = RemoteKVL2Connector(base_url=srv.url, lease_ms=0, local_reads=False)
    try:
        keys = lm_keys(2)
        f = conn.submit_batch_set(keys, [memoryview(bytes(100)) for _ in keys])
        wait_completions(conn, {f})
        f = conn.submit_batch_exists(keys)
        assert wait_completions(conn, {f})[f][3] == [True, True]
        assert stats(srv.url)["leases_taken"] == 0
    finally:
        conn.close()
    for bad in (-1, "soon", True):
        with pytest.raises(ConfigError, match="lease_ms"):
            RemoteKVL2Connector(base_url=srv.url, lease_ms=bad)


def test_a_load_releases_only_what_this_connectors_lookup_leased(server_factory):
    """Another client's lease on a chunk survives this connector's load of it (a load
    ends only a lease this connector's lookup took), and a load with no lookup before
    it releases nothing. On the server's host the lookup leases in the reader's own table
    and the load releases there: no request; over HTTP, one batch-release request for the
    whole batch of loads (issue 37: one per chunk cost loads 1.5-3x)."""
    import re

    from helpers.common import wait_for

    from eg_kv.client.settings import KvCacheConfig
    from eg_kv.client.sync import ServerConnector

    srv = server_factory(workers=1, capacity="8MiB")

    def release_requests() -> int:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        pattern = r'eg_kv_requests_total\{method="POST",route="batch_release",status="200"\} (\S+)'
        return int(sum(float(v) for v in re.findall(pattern, text)))

    keys = lm_keys(2)
    bufs = [bytearray(CHUNK) for _ in keys]
    released = expected = 0
    other = ServerConnector(KvCacheConfig(base_url=srv.url, local_reads=False))
    for local in (True, False):
        conn = RemoteKVL2Connector(base_url=srv.url, timeout_s=10, local_reads=local)
        try:
            f = conn.submit_batch_set(keys, [memoryview(bytes(CHUNK)) for _ in keys])
            assert wait_completions(conn, {f})[f][1] is True
            # Another client leases the first chunk.
            found = other.try_exists_addresses(conn.addresses.addresses(keys[:1]), lease_ms=60000)
            assert found == [True]
            f = conn.submit_batch_get(keys, [memoryview(b) for b in bufs])
            assert wait_completions(conn, {f})[f][3] == [True, True]
            assert stats(srv.url)["leased_blocks"] == 1  # the other client's lease stands
            # This connector's own lookup leases both; its load then releases them, once.
            f = conn.submit_batch_exists(keys)
            assert wait_completions(conn, {f})[f][3] == [True, True]
            assert stats(srv.url)["leased_blocks"] == 2
            f = conn.submit_batch_get(keys, [memoryview(b) for b in bufs])
            assert wait_completions(conn, {f})[f][3] == [True, True]
            released += 2
            st = stats(srv.url)
            assert (st["leases_released"], st["leased_blocks"]) == (released, 1)
        finally:
            conn.close()
        assert other.release(conn.addresses.addresses(keys[:1])) == 1  # a request: the marker
        released += 1
        # Local: released in the reader's table, no request. HTTP: one for the batch.
        # Requests are counted in order: once the marker shows, the batch's would.
        expected += 1 if local else 2
        wait_for(lambda: release_requests() >= expected, what="the marker counted")  # noqa: B023
        assert release_requests() == expected
    other.close()
